// The CPU kernel bodies, written once over a SIMD traits type V and instantiated by each ISA
// translation unit with its own target flags. Everything here has internal linkage (anonymous
// namespace): an AVX-512 instantiation must never be merged into, or picked by, another TU.
//
// V provides: kWidth, F (register), load/store (unaligned), set1, add, mul, div, sqrt,
// div_by_const(x, c, 1/double(c)) = RN(x / c) for x >= 0 (Note [Division by a constant]),
// fma(a, b, c) = a*b + c rounded once, max (NaN in either -> all-ones NaN, else a > b ? a : b, as
// maxps), store_bf16/store_fp16 (round to nearest even, NaN canonicalised), load_bf16/load_fp16
// (exact widening), any_nan, and a double accumulator Acc with acc_zero/acc_sq/acc_sum. The last partial vector runs through the same
// vector code on zero-padded copies, so tails are bitwise the same as full vectors.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu_kernels.hpp"

namespace shardopt::detail::kernels {
namespace {  // NOLINT(build/namespaces): one private copy per ISA translation unit

// Software conversions, the reference for the vector ones (torch's c10::BFloat16 / c10::Half).
inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline uint16_t bf16_bits(float x) {
  if (x != x) return 0x7FC0;
  const uint32_t u = float_bits(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// fp16_ieee_from_fp32_value (FP16 library, used by c10::Half): exact round to nearest even via
// two float multiplies and an add.
inline uint16_t fp16_bits(float x) {
  const float scale_to_inf = bits_float(0x77800000u);
  const float scale_to_zero = bits_float(0x08800000u);
  const uint32_t w = float_bits(x);
  float base = (bits_float(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// fp16_ieee_to_fp32_value (FP16 library): exact, Inf and NaN included.
inline float fp16_value(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * bits_float(0x07800000u);
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_float(sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized)));
}

template <class V, LowPrecision kLow>
inline void store_low(uint16_t* dst, typename V::F x) {
  if constexpr (kLow == LowPrecision::BFloat16) V::store_bf16(dst, x);
  if constexpr (kLow == LowPrecision::Float16) V::store_fp16(dst, x);
}

// Tail staging: r < kWidth elements copied into a zero-padded vector-sized buffer and back.
template <int W, class T>
inline T* stage_in(T (&buf)[W], const T* src, int64_t r) {
  for (int k = 0; k < W; ++k) buf[k] = k < r ? src[k] : T{0};
  return buf;
}
template <class T>
inline void stage_out(T* dst, const T* buf, int64_t r) {
  for (int64_t k = 0; k < r; ++k) dst[k] = buf[k];
}

// Note [Prefetching the streams]
// A step streams every state once and is bound by memory. The loops leave prefetching to the
// hardware. Software prefetches 2 KiB ahead of each read stream were tried (2026-11-27): on a
// quiet Zen 5 they took AdamW at 110M parameters, one thread, from 53.5 to 48.8 ms. On the Zen 4
// of 2026-11-28 they gained nothing on a quiet core, and cost 13-20% while the other core streamed
// too, which is how ranks share a host: bench/prefetch_distance.cpp, one thread 87 ms without and
// 103-105 ms with 1-4 KiB ahead, two threads 70 vs 76-87 ms; our kernel against torch's on the
// same tensors, 85-92 ms without and 104-110 ms with, torch 85-91 ms
// (bench/log/2026-11-28-kernels-without-prefetch.md). Rerun bench/prefetch_distance.cpp on a new
// CPU before adding them back.

// ---- Adam / AdamW ---------------------------------------------------------------------------
// torch 1.13, per element: [AdamW] p *= 1-lr*wd | [Adam] g = g + wd*p (fma);
// m = fma(g, 1-b1, m*b1); v = fma((1-b2)*g, g, v*b2); [amsgrad] vmax = max(v, vmax);
// p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps).
template <class V, AdamCoeffs::Decay kDecay, bool kAmsgrad, LowPrecision kLow>
inline void adam_vec(const AdamCoeffs& c, float* pp, const float* gp, float* mp, float* vp,
                     float* vmaxp, uint16_t* lowp) {
  using F = typename V::F;
  F p = V::load(pp);
  F g = V::load(gp);
  if constexpr (kDecay == AdamCoeffs::kDecayParam) p = V::mul(p, V::set1(c.decay_param));
  if constexpr (kDecay == AdamCoeffs::kDecayGrad) g = V::fma(p, V::set1(c.decay_grad), g);
  const F m = V::fma(g, V::set1(c.one_minus_beta1), V::mul(V::load(mp), V::set1(c.beta1)));
  const F v =
      V::fma(V::mul(V::set1(c.one_minus_beta2), g), g, V::mul(V::load(vp), V::set1(c.beta2)));
  V::store(mp, m);
  V::store(vp, v);
  F s = v;
  if constexpr (kAmsgrad) {
    s = V::max(v, V::load(vmaxp));
    V::store(vmaxp, s);
  }
  const F scaled = V::div_by_const(V::sqrt(s), c.sqrt_bias_correction2,
                                   c.inv_sqrt_bias_correction2);  // Note [Division by a constant]
  const F denom = V::add(scaled, V::set1(c.eps));
  p = V::add(p, V::div(V::mul(V::set1(c.neg_step_size), m), denom));
  V::store(pp, p);
  store_low<V, kLow>(lowp, p);
}

template <class V, AdamCoeffs::Decay kDecay, bool kAmsgrad, LowPrecision kLow>
void adam_loop(const AdamCoeffs& c, const AdamSegment& s) {
  constexpr int W = V::kWidth;
  constexpr bool kHasLow = kLow != LowPrecision::None;
  const int64_t n = s.numel;
  int64_t i = 0;
  for (; i + W <= n; i += W) {  // Note [Prefetching the streams]
    adam_vec<V, kDecay, kAmsgrad, kLow>(c, s.param + i, s.grad + i, s.exp_avg + i, s.exp_avg_sq + i,
                                        kAmsgrad ? s.max_exp_avg_sq + i : nullptr,
                                        kHasLow ? s.low.data + i : nullptr);
  }
  const int64_t r = n - i;
  if constexpr (W > 1) {
    if (r > 0) {
      float p[W], g[W], m[W], v[W], vmax[W];
      uint16_t low[W];
      stage_in(p, s.param + i, r);
      stage_in(g, s.grad + i, r);
      stage_in(m, s.exp_avg + i, r);
      stage_in(v, s.exp_avg_sq + i, r);
      if constexpr (kAmsgrad) stage_in(vmax, s.max_exp_avg_sq + i, r);
      adam_vec<V, kDecay, kAmsgrad, kLow>(c, p, g, m, v, vmax, low);
      stage_out(s.param + i, p, r);
      stage_out(s.exp_avg + i, m, r);
      stage_out(s.exp_avg_sq + i, v, r);
      if constexpr (kAmsgrad) stage_out(s.max_exp_avg_sq + i, vmax, r);
      if constexpr (kHasLow) stage_out(s.low.data + i, low, r);
    }
  }
}

// Turns runtime choices into template arguments: fn(std::integral_constant<...>{}).
template <class Fn>
inline void with_low(LowPrecision kind, Fn&& fn) {
  switch (kind) {
    case LowPrecision::None:
      return fn(std::integral_constant<LowPrecision, LowPrecision::None>{});
    case LowPrecision::BFloat16:
      return fn(std::integral_constant<LowPrecision, LowPrecision::BFloat16>{});
    case LowPrecision::Float16:
      return fn(std::integral_constant<LowPrecision, LowPrecision::Float16>{});
  }
}
template <class Fn>
inline void with_bool(bool b, Fn&& fn) {
  if (b) return fn(std::true_type{});
  return fn(std::false_type{});
}

template <class V>
void adam_kernel(const AdamCoeffs& c, const AdamSegment& s) {
  with_low(s.low.kind, [&](auto low) {
    with_bool(c.amsgrad, [&](auto ams) {
      constexpr LowPrecision kLow = decltype(low)::value;
      constexpr bool kAms = decltype(ams)::value;
      switch (c.decay) {
        case AdamCoeffs::kNoDecay:
          return adam_loop<V, AdamCoeffs::kNoDecay, kAms, kLow>(c, s);
        case AdamCoeffs::kDecayParam:
          return adam_loop<V, AdamCoeffs::kDecayParam, kAms, kLow>(c, s);
        case AdamCoeffs::kDecayGrad:
          return adam_loop<V, AdamCoeffs::kDecayGrad, kAms, kLow>(c, s);
      }
    });
  });
}

// ---- SGD ------------------------------------------------------------------------------------
// torch 1.13: d = g [+ wd*p (fma)]; buf = d at step 1, else fma(d, 1-dampening, buf*momentum);
// d = nesterov ? fma(buf, momentum, d) : buf; p = fma(d, -lr, p).
template <class V, bool kMomentum, LowPrecision kLow>
inline void sgd_vec(const SgdCoeffs& c, float* pp, const float* gp, float* bufp, uint16_t* lowp) {
  using F = typename V::F;
  F p = V::load(pp);
  F d = V::load(gp);
  if (c.decay) d = V::fma(p, V::set1(c.weight_decay), d);
  if constexpr (kMomentum) {
    const F buf = c.first_step ? d
                               : V::fma(d, V::set1(c.one_minus_dampening),
                                        V::mul(V::load(bufp), V::set1(c.momentum_factor)));
    V::store(bufp, buf);
    d = c.nesterov ? V::fma(buf, V::set1(c.momentum_factor), d) : buf;
  }
  p = V::fma(d, V::set1(c.neg_lr), p);
  V::store(pp, p);
  store_low<V, kLow>(lowp, p);
}

template <class V, bool kMomentum, LowPrecision kLow>
void sgd_loop(const SgdCoeffs& c, const SgdSegment& s) {
  constexpr int W = V::kWidth;
  constexpr bool kHasLow = kLow != LowPrecision::None;
  const int64_t n = s.numel;
  int64_t i = 0;
  for (; i + W <= n; i += W) {  // Note [Prefetching the streams]
    sgd_vec<V, kMomentum, kLow>(c, s.param + i, s.grad + i,
                                kMomentum ? s.momentum_buffer + i : nullptr,
                                kHasLow ? s.low.data + i : nullptr);
  }
  const int64_t r = n - i;
  if constexpr (W > 1) {
    if (r > 0) {
      float p[W], g[W], buf[W];
      uint16_t low[W];
      stage_in(p, s.param + i, r);
      stage_in(g, s.grad + i, r);
      if constexpr (kMomentum) stage_in(buf, s.momentum_buffer + i, r);
      sgd_vec<V, kMomentum, kLow>(c, p, g, buf, low);
      stage_out(s.param + i, p, r);
      if constexpr (kMomentum) stage_out(s.momentum_buffer + i, buf, r);
      if constexpr (kHasLow) stage_out(s.low.data + i, low, r);
    }
  }
}

template <class V>
void sgd_kernel(const SgdCoeffs& c, const SgdSegment& s) {
  with_low(s.low.kind, [&](auto low) {
    with_bool(c.momentum,
              [&](auto mom) { sgd_loop<V, decltype(mom)::value, decltype(low)::value>(c, s); });
  });
}

// ---- LAMB (the engine's formulation, optimizer.cpp lamb_update) -------------------------------
// phase 1: m = fma(g, 1-b1, m*b1); v = fma((1-b2)*g, g, v*b2);
//          u = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd*p (fma)]; sums of p*p and u*u in double.
// phase 2: p = fma(u, -lr*trust, p), u recomputed from the updated m and v.
template <class V>
inline typename V::F lamb_raw_update(const LambCoeffs& c, typename V::F p, typename V::F m,
                                     typename V::F v) {
  using F = typename V::F;
  F u = V::div(V::div(m, V::set1(c.bias_correction1)),
               V::add(V::sqrt(V::div(v, V::set1(c.bias_correction2))), V::set1(c.eps)));
  if (c.decay) u = V::fma(p, V::set1(c.weight_decay), u);
  return u;
}

template <class V>
inline void lamb1_vec(const LambCoeffs& c, const float* pp, const float* gp, float* mp, float* vp,
                      typename V::Acc& acc_p, typename V::Acc& acc_u) {
  using F = typename V::F;
  const F g = V::load(gp);
  const F m = V::fma(g, V::set1(c.one_minus_beta1), V::mul(V::load(mp), V::set1(c.beta1)));
  const F v =
      V::fma(V::mul(V::set1(c.one_minus_beta2), g), g, V::mul(V::load(vp), V::set1(c.beta2)));
  V::store(mp, m);
  V::store(vp, v);
  const F p = V::load(pp);
  V::acc_sq(acc_p, p);
  V::acc_sq(acc_u, lamb_raw_update<V>(c, p, m, v));
}

template <class V>
LambNorms lamb_phase1_kernel(const LambCoeffs& c, const LambSegment& s) {
  constexpr int W = V::kWidth;
  auto acc_p = V::acc_zero();
  auto acc_u = V::acc_zero();
  const int64_t n = s.numel;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    lamb1_vec<V>(c, s.param + i, s.grad + i, s.exp_avg + i, s.exp_avg_sq + i, acc_p, acc_u);
  }
  const int64_t r = n - i;
  if constexpr (W > 1) {
    if (r > 0) {  // zero lanes add exactly 0 to both sums
      float p[W], g[W], m[W], v[W];
      stage_in(p, s.param + i, r);
      stage_in(g, s.grad + i, r);
      stage_in(m, s.exp_avg + i, r);
      stage_in(v, s.exp_avg_sq + i, r);
      lamb1_vec<V>(c, p, g, m, v, acc_p, acc_u);
      stage_out(s.exp_avg + i, m, r);
      stage_out(s.exp_avg_sq + i, v, r);
    }
  }
  return {V::acc_sum(acc_p), V::acc_sum(acc_u)};
}

template <class V, LowPrecision kLow>
inline void lamb2_vec(const LambCoeffs& c, float* pp, const float* mp, const float* vp,
                      uint16_t* lowp) {
  using F = typename V::F;
  F p = V::load(pp);
  const F u = lamb_raw_update<V>(c, p, V::load(mp), V::load(vp));
  p = V::fma(u, V::set1(c.neg_lr_trust), p);
  V::store(pp, p);
  store_low<V, kLow>(lowp, p);
}

template <class V, LowPrecision kLow>
void lamb_phase2_loop(const LambCoeffs& c, const LambSegment& s) {
  constexpr int W = V::kWidth;
  constexpr bool kHasLow = kLow != LowPrecision::None;
  const int64_t n = s.numel;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    lamb2_vec<V, kLow>(c, s.param + i, s.exp_avg + i, s.exp_avg_sq + i,
                       kHasLow ? s.low.data + i : nullptr);
  }
  const int64_t r = n - i;
  if constexpr (W > 1) {
    if (r > 0) {
      float p[W], m[W], v[W];
      uint16_t low[W];
      stage_in(p, s.param + i, r);
      stage_in(m, s.exp_avg + i, r);
      stage_in(v, s.exp_avg_sq + i, r);
      lamb2_vec<V, kLow>(c, p, m, v, low);
      stage_out(s.param + i, p, r);
      if constexpr (kHasLow) stage_out(s.low.data + i, low, r);
    }
  }
}

template <class V>
void lamb_phase2_kernel(const LambCoeffs& c, const LambSegment& s) {
  with_low(s.low.kind, [&](auto low) { lamb_phase2_loop<V, decltype(low)::value>(c, s); });
}

// ---- non-finite check (Note [Exact non-finite check] in finite.hpp) ---------------------------
template <class V, ValueKind kKind>
inline typename V::F load_value(const void* data, int64_t i) {
  if constexpr (kKind == ValueKind::Float32) return V::load(static_cast<const float*>(data) + i);
  if constexpr (kKind == ValueKind::BFloat16) {
    return V::load_bf16(static_cast<const uint16_t*>(data) + i);
  }
  if constexpr (kKind == ValueKind::Float16) {
    return V::load_fp16(static_cast<const uint16_t*>(data) + i);
  }
}

// One vector at element i: scaled (and stored) when kScale; x * 0 added into `bad`.
template <class V, ValueKind kKind, bool kScale, bool kSq>
inline void check_vec(void* data, int64_t i, typename V::F scale, typename V::F& bad,
                      typename V::Acc& acc) {
  auto x = load_value<V, kKind>(data, i);
  if constexpr (kScale) {
    x = V::mul(x, scale);
    V::store(static_cast<float*>(data) + i, x);
  }
  bad = V::add(bad, V::mul(x, V::set1(0.0f)));
  if constexpr (kSq) V::acc_sq(acc, x);
}

template <class V, ValueKind kKind, bool kScale, bool kSq>
CheckResult check_loop(const CheckSegment& s, float scale_value) {
  using T = std::conditional_t<kKind == ValueKind::Float32, float, uint16_t>;
  constexpr int W = V::kWidth;
  constexpr int kUnroll = 4;  // independent sums: the adds' latency stays off the memory stream
  const auto scale = V::set1(scale_value);
  typename V::F bad[kUnroll];
  typename V::Acc acc[kUnroll];
  for (int u = 0; u < kUnroll; ++u) bad[u] = V::set1(0.0f), acc[u] = V::acc_zero();
  const int64_t n = s.numel;
  int64_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    for (int u = 0; u < kUnroll; ++u) {
      check_vec<V, kKind, kScale, kSq>(s.data, i + u * W, scale, bad[u], acc[u]);
    }
  }
  for (; i + W <= n; i += W) check_vec<V, kKind, kScale, kSq>(s.data, i, scale, bad[0], acc[0]);
  const int64_t r = n - i;
  if constexpr (W > 1) {
    if (r > 0) {  // zero lanes: finite, and add nothing to the squares
      T buf[W];
      stage_in(buf, static_cast<const T*>(s.data) + i, r);
      check_vec<V, kKind, kScale, kSq>(buf, 0, scale, bad[0], acc[0]);
      if constexpr (kScale) stage_out(static_cast<T*>(s.data) + i, buf, r);
    }
  }
  CheckResult out;
  for (int u = 0; u < kUnroll; ++u) {
    out.non_finite = out.non_finite || V::any_nan(bad[u]);
    if constexpr (kSq) out.sum_sq += V::acc_sum(acc[u]);
  }
  return out;
}

template <class V>
CheckResult check_finite_kernel(const CheckSegment& s, const CheckOptions& o) {
  const bool sq = o.sum_squares;
  if (o.scale != 1.0f) {  // fp32 only (checked by the driver)
    return sq ? check_loop<V, ValueKind::Float32, true, true>(s, o.scale)
              : check_loop<V, ValueKind::Float32, true, false>(s, o.scale);
  }
  switch (s.kind) {
    case ValueKind::Float32:
      return sq ? check_loop<V, ValueKind::Float32, false, true>(s, 1)
                : check_loop<V, ValueKind::Float32, false, false>(s, 1);
    case ValueKind::BFloat16:
      return sq ? check_loop<V, ValueKind::BFloat16, false, true>(s, 1)
                : check_loop<V, ValueKind::BFloat16, false, false>(s, 1);
    case ValueKind::Float16:
      return sq ? check_loop<V, ValueKind::Float16, false, true>(s, 1)
                : check_loop<V, ValueKind::Float16, false, false>(s, 1);
  }
  return {};
}

template <class V>
constexpr CpuKernelTable make_table() {
  return {&adam_kernel<V>, &sgd_kernel<V>, &lamb_phase1_kernel<V>, &lamb_phase2_kernel<V>,
          &check_finite_kernel<V>};
}

}  // namespace
}  // namespace shardopt::detail::kernels
