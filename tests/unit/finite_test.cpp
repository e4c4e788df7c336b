// The non-finite check kernels (src/kernels/finite.hpp) on every instruction set this CPU has:
// every 16-bit pattern and the fp32 edge values classified exactly, one planted NaN/Inf found at
// every position (tails, unaligned starts), the fused scaling bitwise equal to torch's mul_, the
// squares against a double reference, and the threaded driver against one pass.
#include "unit/kernels_support.hpp"

#include <limits>

#include "kernels/finite.hpp"

namespace shardopt::detail::kernels {
namespace {

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Its own fixture name: KernelIsa is already a suite of kernels_test.cpp.
class FiniteIsa : public KernelIsa {};

CheckResult check(CpuIsa isa, ValueKind kind, void* data, int64_t n, float scale = 1.0f,
                  bool sq = false) {
  CheckOptions o;
  o.scale = scale;
  o.sum_squares = sq;
  return raw::check_finite(isa, {kind, data, n}, o);
}

// Every bf16 and fp16 bit pattern, alone among finite values at a position that moves through
// the vector lanes and the tail: flagged exactly when its exponent is all ones.
TEST_P(FiniteIsa, EverySixteenBitPatternIsClassifiedExactly) {
  constexpr int64_t kLen = 37;  // two AVX-512 vectors and a tail
  for (ValueKind kind : {ValueKind::BFloat16, ValueKind::Float16}) {
    const uint16_t exponent = kind == ValueKind::BFloat16 ? 0x7F80 : 0x7C00;
    const uint16_t one = kind == ValueKind::BFloat16 ? 0x3F80 : 0x3C00;
    std::vector<uint16_t> buf(kLen + 1, one);
    int wrong = 0;
    for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
      const int64_t pos = bits % kLen;
      uint16_t* data = buf.data() + (bits / kLen) % 2;  // aligned and unaligned starts
      for (int64_t i = 0; i < kLen; ++i) data[i] = one;
      data[pos] = static_cast<uint16_t>(bits);
      const bool expect = (bits & exponent) == exponent;
      if (check(isa(), kind, data, kLen).non_finite != expect && ++wrong <= 5) {
        ADD_FAILURE() << "kind " << static_cast<int>(kind) << ": pattern 0x" << std::hex << bits
                      << " at " << std::dec << pos;
      }
    }
    EXPECT_EQ(wrong, 0);
  }
}

// fp32: NaNs (quiet, signalling, negative, payloads), both infinities, and no false alarm on
// the largest, smallest and subnormal finite values (whose sum would overflow).
TEST_P(FiniteIsa, Fp32EdgeValuesAtEveryPosition) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> bad = {std::numeric_limits<float>::quiet_NaN(),
                                  std::numeric_limits<float>::signaling_NaN(),
                                  -std::numeric_limits<float>::quiet_NaN(),
                                  from_bits(0x7F800001u),
                                  from_bits(0xFFFFFFFFu),
                                  inf,
                                  -inf};
  const float big = std::numeric_limits<float>::max();
  for (int64_t n : {1, 7, 8, 9, 16, 17, 33, 64, 65, 100}) {
    for (int64_t offset : {0, 1, 5}) {
      Buffer b(n, offset);
      std::vector<float> values(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        values[i] = i % 3 == 0 ? big : i % 3 == 1 ? -big : from_bits(1u + static_cast<uint32_t>(i));
      }
      b.fill(values);
      EXPECT_FALSE(check(isa(), ValueKind::Float32, b.data(), n).non_finite) << "n " << n;
      for (int64_t pos = 0; pos < n; ++pos) {
        for (float v : bad) {
          b.data()[pos] = v;
          ASSERT_TRUE(check(isa(), ValueKind::Float32, b.data(), n).non_finite)
              << "n " << n << " offset " << offset << " at " << pos << " value " << v;
        }
        b.data()[pos] = values[pos];
      }
    }
  }
}

// The scaling pass writes torch's own product (float tensor mul_ by a double Scalar), flags a
// product that overflows, and sums the squares of the products.
TEST_P(FiniteIsa, ScalingEqualsTorchMulAndSquaresEqualReference) {
  for (int64_t n : {0, 1, 15, 16, 17, 100, 4099}) {
    for (double scale : {0.5, 1.0 / 3.0, 1.0 / 6144.0, 3.0}) {
      at::Tensor t = at::randn({n + 1}, at::TensorOptions().dtype(at::kFloat)).narrow(0, 1, n);
      at::Tensor expect = t.clone().mul_(scale);
      const auto r = check(isa(), ValueKind::Float32, t.data_ptr(), n, static_cast<float>(scale),
                           /*sq=*/true);
      EXPECT_SAME_BITS(t.data_ptr<float>(), expect.data_ptr<float>(), n, "scaled");
      EXPECT_FALSE(r.non_finite);
      double ref = 0;
      const float* e = expect.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) ref += static_cast<double>(e[i]) * e[i];
      EXPECT_NEAR(r.sum_sq, ref, 1e-12 * ref) << "n " << n << " scale " << scale;
    }
  }
  std::vector<float> huge(20, std::numeric_limits<float>::max() / 2);
  EXPECT_TRUE(check(isa(), ValueKind::Float32, huge.data(), 20, 4.0f).non_finite)
      << "a product that overflows is non-finite";
}

TEST_P(FiniteIsa, ThreadedCheckEqualsOnePass) {
  const int64_t n = 9 * kChunkNumel + 123;  // side-by-side groups, single chunks, a tail
  at::Tensor t = at::randn({n});
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  CheckOptions o;
  o.sum_squares = true;
  const auto one = raw::check_finite(isa(), {ValueKind::Float32, t.data_ptr(), n}, o);
  const auto all = check_finite({ValueKind::Float32, t.data_ptr(), n}, o, isa());
  EXPECT_FALSE(all.non_finite);
  double ref = 0;
  for (int64_t i = 0; i < n; ++i) ref += static_cast<double>(t.data_ptr<float>()[i]) * t.data_ptr<float>()[i];
  EXPECT_NEAR(all.sum_sq, ref, 1e-12 * ref);
  EXPECT_NEAR(all.sum_sq, one.sum_sq, 1e-12 * one.sum_sq);
  // The chunks' sums are added in chunk order: the same bits at any thread count.
  for (int threads_now : {1, 3}) {
    at::set_num_threads(threads_now);
    EXPECT_EQ(check_finite({ValueKind::Float32, t.data_ptr(), n}, o, isa()).sum_sq, all.sum_sq)
        << threads_now << " threads";
  }
  at::set_num_threads(2);
  for (int64_t pos : {int64_t{0}, kChunkNumel - 1, 3 * kChunkNumel, 6 * kChunkNumel + 5,
                      8 * kChunkNumel, n - 1}) {
    at::Tensor u = t.clone();
    u[pos] = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(check_finite({ValueKind::Float32, u.data_ptr(), n}, {}, isa()).non_finite) << pos;
    at::Tensor h = t.to(at::kHalf);
    h[pos] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(check_finite({ValueKind::Float16, h.data_ptr(), n}, {}, isa()).non_finite) << pos;
  }
  at::set_num_threads(threads);
}

INSTANTIATE_TEST_SUITE_P(Finite, FiniteIsa,
                         ::testing::Values(CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(FiniteCheck, BadSegmentsAreNamed) {
  uint16_t h[4] = {0, 0, 0, 0};
  CheckOptions scaled;
  scaled.scale = 0.5f;
  EXPECT_THROW(check_finite({ValueKind::BFloat16, h, 4}, scaled), Error);
  EXPECT_THROW(check_finite({ValueKind::Float32, nullptr, 4}), Error);
  EXPECT_THROW(check_finite({ValueKind::Float32, h, -1}), Error);
  EXPECT_FALSE(check_finite({ValueKind::Float32, nullptr, 0}).non_finite);
}

}  // namespace
}  // namespace shardopt::detail::kernels
