// The 8-bit AdamW kernels (src/kernels/adam8bit.hpp): the AVX-512 VBMI kernel's quantiser and
// whole steps against the scalar kernel, bit for bit (Note [Fast 8-bit kernel]), on both sides of
// every code boundary and on the edge values a step can meet: zeros, subnormals, overflowing
// squares, infinities and NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/adam8bit.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail::kernels {
namespace {

// The CPU runs the arithmetic AVX-512 kernel (allow_adam8bit_vbmi(false)) / the VBMI one.
bool have_avx512_kernel() {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu_isa_supported(CpuIsa::Avx512) && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512cd");
#else
  return false;
#endif
}
bool have_vbmi() {
#if defined(__x86_64__) || defined(_M_X64)
  return have_avx512_kernel() && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Floats of [0, 2) around every place quantize_dynamic's byte changes (found by bisection over
// the bits, where it is monotone), around every power of two (the quantiser's binade table) and
// at random, with both signs for the signed map.
std::vector<float> probe_values(bool is_signed) {
  std::vector<float> ys;
  auto window = [&](uint32_t at) {
    for (int64_t d = -40; d <= 40; ++d) {
      const int64_t b = static_cast<int64_t>(at) + d;
      if (b >= 0 && b < static_cast<int64_t>(bits(2.0f))) {
        ys.push_back(from_bits(static_cast<uint32_t>(b)));
      }
    }
  };
  uint32_t lo = 0;
  const uint32_t end = bits(2.0f);
  while (lo < end) {  // the first float whose byte differs from lo's, then on from there
    const uint8_t q = quantize_dynamic(from_bits(lo), is_signed);
    uint32_t a = lo, b = end;
    while (b - a > 1) {
      const uint32_t mid = a + (b - a) / 2;
      (quantize_dynamic(from_bits(mid), is_signed) == q ? a : b) = mid;
    }
    if (b < end) window(b);
    lo = b;
  }
  for (int e = -40; e <= 1; ++e) window(bits(std::ldexp(1.0f, e)));
  window(0);
  window(bits(std::numeric_limits<float>::min()));
  std::mt19937 rng(56);
  std::uniform_int_distribution<uint32_t> any(0, end - 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) ys.push_back(from_bits(any(rng)));
  for (int i = 0; i < 100000; ++i) ys.push_back(unit(rng));
  if (is_signed) {
    const size_t n = ys.size();
    for (size_t i = 0; i < n; ++i) ys.push_back(-ys[i]);
  }
  return ys;
}

TEST(Adam8bitKernel, VbmiQuantiserEqualsScalarAroundEveryCodeBoundary) {
  if (!have_vbmi()) GTEST_SKIP() << "no AVX-512 VBMI here: the scalar quantiser is the only one";
  for (bool is_signed : {true, false}) {
    const std::vector<float> ys = probe_values(is_signed);
    ASSERT_GT(ys.size(), 200000u + 255u * 80u);
    std::vector<uint8_t> got(ys.size());
    quantize_dynamic_n(ys.data(), got.data(), static_cast<int64_t>(ys.size()), is_signed,
                       CpuIsa::Avx512);
    int64_t wrong = 0;
    for (size_t i = 0; i < ys.size(); ++i) {
      const uint8_t want = quantize_dynamic(ys[i], is_signed);
      if (got[i] != want && ++wrong <= 10) {
        ADD_FAILURE() << (is_signed ? "signed" : "unsigned") << " map: y = " << ys[i] << " (bits "
                      << std::hex << bits(ys[i]) << std::dec << "): " << int(got[i])
                      << ", scalar " << int(want);
      }
    }
    EXPECT_EQ(wrong, 0);
  }
}

// Every float of (-2, 2), the whole domain of the region quantiser: about 40 s on one core, so
// disabled; run it after changing the maps or the quantiser with
//   build/tests/unit_tests --gtest_filter='*EveryFloat*' --gtest_also_run_disabled_tests
TEST(Adam8bitKernel, DISABLED_VbmiQuantiserEqualsScalarOnEveryFloatBelowTwo) {
  if (!have_vbmi()) GTEST_SKIP() << "no AVX-512 VBMI here";
  constexpr uint32_t kChunk = 1u << 20;
  std::vector<float> ys(kChunk);
  std::vector<uint8_t> got(kChunk);
  for (bool is_signed : {true, false}) {
    int64_t wrong = 0;
    for (uint32_t sign : {0u, 0x80000000u}) {
      if (!is_signed && sign != 0) continue;
      for (uint32_t at = 0; at < bits(2.0f); at += kChunk) {
        for (uint32_t i = 0; i < kChunk; ++i) ys[i] = from_bits((at + i) | sign);
        quantize_dynamic_n(ys.data(), got.data(), kChunk, is_signed, CpuIsa::Avx512);
        for (uint32_t i = 0; i < kChunk; ++i) {
          if (got[i] != quantize_dynamic(ys[i], is_signed) && ++wrong <= 10) {
            ADD_FAILURE() << "y = " << ys[i] << " (bits " << std::hex << bits(ys[i]) << ")";
          }
        }
      }
    }
    EXPECT_EQ(wrong, 0) << (is_signed ? "signed" : "unsigned") << " map";
  }
}

TEST(Adam8bitKernel, VbmiQuantiserRejectsValuesOutsideItsDomain) {
  if (!have_vbmi()) GTEST_SKIP() << "no AVX-512 VBMI here";
  uint8_t out[1];
  for (float y : {2.0f, -3.0f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_THROW(quantize_dynamic_n(&y, out, 1, true, CpuIsa::Avx512), Error) << y;
  }
  for (float y : {-0.0f, -0.5f}) {  // the second moment's map: v / max(v) >= +0
    EXPECT_THROW(quantize_dynamic_n(&y, out, 1, false, CpuIsa::Avx512), Error) << y;
  }
}

// Blocks of gradients of one magnitude each (1e-30 .. 1e3), and blocks that meet the edges:
// all zero, subnormal (maxima whose reciprocal overflows), squares that overflow (v = inf), NaN,
// infinities and -0.
std::vector<float> gradient(int64_t n, int step, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> decade(-30.0f, 3.0f);
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t b = 0; b * 256 < n; ++b) {
    const float scale = std::pow(10.0f, decade(rng));
    for (int64_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) g[i] = normal(rng) * scale;
  }
  auto block = [&](int64_t b) { return g.begin() + b * 256; };
  if (step % 3 == 0) std::fill(block(1), block(2), 0.0f);
  if (step == 4) {
    for (int i = 0; i < 256; ++i) block(2)[i] = 1e-42f * static_cast<float>(i % 5);
  }
  if (step == 5) block(3)[17] = 3e20f;  // g * g overflows
  if (step == 6) block(4)[200] = std::numeric_limits<float>::quiet_NaN();
  if (step == 7) block(5)[3] = -std::numeric_limits<float>::infinity();
  if (step == 8) block(6)[255] = std::numeric_limits<float>::infinity();
  for (int i = 0; i < 256; i += 7) block(7)[i] = -0.0f;
  if (step == 9) {
    for (int i = 0; i < 256; ++i) block(8)[i] = (i % 2 ? 1e-38f : 1e-3f) * normal(rng);
  }
  return g;
}

struct State {
  std::vector<float> p, a1, a2;
  std::vector<uint8_t> q1, q2;
  explicit State(int64_t n)
      : p(static_cast<size_t>(n)), a1(static_cast<size_t>((n + 255) / 256)), a2(a1),
        q1(static_cast<size_t>(n)), q2(q1) {}
  Adam8bitSegment segment(const std::vector<float>& g) {
    return {p.data(), g.data(), q1.data(), q2.data(), a1.data(), a2.data(),
            static_cast<int64_t>(p.size())};
  }
};

bool same_float(float x, float y) {  // bit for bit, any NaN equal to any NaN
  return bits(x) == bits(y) || (std::isnan(x) && std::isnan(y));
}

TEST(Adam8bitKernel, VbmiStepsEqualScalarStepsBitwiseOnEdgeValues) {
  if (!have_vbmi()) GTEST_SKIP() << "no AVX-512 VBMI here: the scalar kernel is the only one";
  const int64_t n = 256 * 24 + 100;  // a short last block
  std::mt19937 init(8);
  std::normal_distribution<float> normal;
  State ref(n), fast(n);
  for (float& x : ref.p) x = normal(init);
  fast.p = ref.p;
  std::mt19937 rng(56);
  for (int step = 1; step <= 12; ++step) {
    const std::vector<float> g = gradient(n, step, rng);
    Adam8bitHyper h;
    h.lr = 1e-2, h.beta2 = 0.995, h.weight_decay = 0.05, h.step = step;
    fused_adam8bit(h, ref.segment(g), CpuIsa::Scalar);
    fused_adam8bit(h, fast.segment(g), CpuIsa::Auto);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!same_float(ref.p[i], fast.p[i]) || ref.q1[i] != fast.q1[i] ||
          ref.q2[i] != fast.q2[i]) {
        if (++wrong <= 5) {
          ADD_FAILURE() << "step " << step << ", element " << i << ": p " << ref.p[i] << " / "
                        << fast.p[i] << ", codes " << int(ref.q1[i]) << " " << int(ref.q2[i])
                        << " / " << int(fast.q1[i]) << " " << int(fast.q2[i]);
        }
      }
    }
    for (size_t b = 0; b < ref.a1.size(); ++b) {
      EXPECT_EQ(bits(ref.a1[b]), bits(fast.a1[b])) << "step " << step << ", block " << b;
      EXPECT_EQ(bits(ref.a2[b]), bits(fast.a2[b])) << "step " << step << ", block " << b;
    }
    EXPECT_EQ(wrong, 0) << "step " << step;
    // The edges were met: an infinite maximum, a NaN parameter.
    if (step == 5) EXPECT_TRUE(std::isinf(ref.a2[3]));
    if (step == 6) EXPECT_TRUE(std::isnan(ref.p[4 * 256 + 200]));
  }
}

// The arithmetic AVX-512 kernel (CPUs without VBMI) against the scalar one on finite values: it
// takes its maxima in another order, so NaN moments may differ (Note [Fast 8-bit kernel]).
TEST(Adam8bitKernel, ArithmeticAvx512StepsEqualScalarStepsOnFiniteValues) {
  if (!have_avx512_kernel()) GTEST_SKIP() << "no AVX-512 here";
  const int64_t n = 256 * 24 + 100;
  std::mt19937 init(9);
  std::normal_distribution<float> normal;
  State ref(n), arith(n);
  for (float& x : ref.p) x = normal(init);
  arith.p = ref.p;
  std::mt19937 rng(57);
  allow_adam8bit_vbmi(false);
  for (int step = 1; step <= 4; ++step) {  // zeros, subnormal maxima; no NaN or infinity
    const std::vector<float> g = gradient(n, step, rng);
    Adam8bitHyper h;
    h.lr = 1e-2, h.beta2 = 0.995, h.weight_decay = 0.05, h.step = step;
    fused_adam8bit(h, ref.segment(g), CpuIsa::Scalar);
    fused_adam8bit(h, arith.segment(g), CpuIsa::Avx512);
  }
  allow_adam8bit_vbmi(true);
  EXPECT_EQ(std::memcmp(ref.p.data(), arith.p.data(), sizeof(float) * ref.p.size()), 0);
  EXPECT_EQ(ref.q1, arith.q1);
  EXPECT_EQ(ref.q2, arith.q2);
  EXPECT_EQ(std::memcmp(ref.a1.data(), arith.a1.data(), sizeof(float) * ref.a1.size()), 0);
  EXPECT_EQ(std::memcmp(ref.a2.data(), arith.a2.data(), sizeof(float) * ref.a2.size()), 0);
}

}  // namespace
}  // namespace shardopt::detail::kernels
