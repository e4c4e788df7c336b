// Scalar kernels: the reference every vector variant must match bit for bit, and the fallback on
// CPUs without AVX2. Compiled with -ffp-contract=off: only the explicit std::fma calls fuse.
#include <cmath>

#include "kernels/cpu_kernels_impl.hpp"

namespace shardopt::detail::kernels {
namespace {

struct ScalarIsa {
  static constexpr int kWidth = 1;
  using F = float;
  using Acc = double;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F div_by_const(F a, float c, double) { return a / c; }  // the reference divides
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F max(F a, F b) {
    if (a != a || b != b) return bits_float(0xFFFFFFFFu);  // as the vector or-with-unordered
    return a > b ? a : b;
  }
  static void store_bf16(uint16_t* dst, F x) { *dst = bf16_bits(x); }
  static void store_fp16(uint16_t* dst, F x) { *dst = fp16_bits(x); }
  static F load_bf16(const uint16_t* src) { return bits_float(static_cast<uint32_t>(*src) << 16); }
  static F load_fp16(const uint16_t* src) { return fp16_value(*src); }
  static bool any_nan(F x) { return x != x; }
  static Acc acc_zero() { return 0.0; }
  static void acc_sq(Acc& acc, F x) { acc += static_cast<double>(x) * static_cast<double>(x); }
  static double acc_sum(Acc acc) { return acc; }
};

}  // namespace

const CpuKernelTable kScalarKernels = make_table<ScalarIsa>();

}  // namespace shardopt::detail::kernels
