// How far ahead the fused kernels should prefetch (Note [Prefetching the streams] in
// src/kernels/cpu_kernels_impl.hpp) on this CPU: AdamW's loop shape (four read streams, three
// written, the arithmetic's divisions and square root; not bitwise torch's, the kernels own that)
// with no prefetch, 1, 2 and 4 KiB ahead, over 1..all threads in fixed chunks of 16K elements as
// the kernel driver splits them, rounds interleaved. Standalone: needs no torch.
//
//   g++ -O2 -fopenmp -march=native bench/prefetch_distance.cpp -o /tmp/pd && /tmp/pd [NUMEL] [ROUNDS]
//   (add -mno-avx512f for the AVX2 loop)
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#ifdef __AVX512F__
using F = __m512; constexpr int W = 16;
#define LD _mm512_loadu_ps
#define ST _mm512_storeu_ps
#define S1 _mm512_set1_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#define DIV _mm512_div_ps
#define SQRT _mm512_sqrt_ps
#define FMA _mm512_fmadd_ps
#else
using F = __m256; constexpr int W = 8;
#define LD _mm256_loadu_ps
#define ST _mm256_storeu_ps
#define S1 _mm256_set1_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#define DIV _mm256_div_ps
#define SQRT _mm256_sqrt_ps
#define FMA _mm256_fmadd_ps
#endif
static inline void vec(float* pp, const float* gp, float* mp, float* vp) {
  F p = MUL(LD(pp), S1(0.99999f)), g = LD(gp);
  F m = FMA(g, S1(0.1f), MUL(LD(mp), S1(0.9f)));
  F v = FMA(MUL(S1(0.001f), g), g, MUL(LD(vp), S1(0.999f)));
  ST(mp, m); ST(vp, v);
  F den = ADD(DIV(SQRT(v), S1(0.0316f)), S1(1e-8f));
  ST(pp, ADD(p, DIV(MUL(S1(-0.01f), m), den)));
}
template <int PF> void seg(float* p, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    if (PF) { __builtin_prefetch(p+i+PF,0,3); __builtin_prefetch(g+i+PF,0,3); __builtin_prefetch(m+i+PF,0,3); __builtin_prefetch(v+i+PF,0,3); }
    for (int j = 0; j < 16; j += W) vec(p+i+j, g+i+j, m+i+j, v+i+j);
  }
}
using Fn = void(*)(float*, const float*, float*, float*, int64_t);
int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 110000000; const int rounds = argc > 2 ? atoi(argv[2]) : 7;
  std::vector<float> p(n, 0.5f), g(n, 1e-3f), m(n, 0.f), v(n, 0.f);
  struct Var { const char* name; Fn fn; };
  Var vs[] = {{"none", seg<0>}, {"1KiB", seg<256>}, {"2KiB", seg<512>}, {"4KiB", seg<1024>}};
  const int nv = 4; const int64_t chunk = 16384, chunks = (n + chunk - 1) / chunk;
  std::vector<int> ths = {1, 2, 4, 8, omp_get_num_procs()};
  ths.erase(std::remove_if(ths.begin(), ths.end(), [](int t){ return t > omp_get_num_procs(); }), ths.end());
  ths.erase(std::unique(ths.begin(), ths.end()), ths.end());
  printf("W=%d n=%lld procs=%d\n", W, (long long)n, omp_get_num_procs());
  for (int t : ths) {
    std::vector<std::vector<double>> ms(nv);
    for (int r = 0; r < rounds + 1; ++r) for (int k = 0; k < nv; ++k) {
      const int x = (k + r) % nv; auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(t) schedule(static)
      for (int64_t c = 0; c < chunks; ++c) { const int64_t b = c * chunk, e = std::min(n, b + chunk); vs[x].fn(&p[b], &g[b], &m[b], &v[b], e - b); }
      if (r) ms[x].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("threads %2d:", t);
    for (int k = 0; k < nv; ++k) { std::sort(ms[k].begin(), ms[k].end()); printf("  %s %.1f ms", vs[k].name, ms[k][ms[k].size()/2]); }
    printf("\n"); fflush(stdout);
  }
}
