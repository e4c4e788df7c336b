// 8-bit AdamW (rules.hpp: AdamW8bit) at stages 0-3 against a plain C++ reimplementation of the
// same blockwise quantised update on whole tensors in one process (below): bitwise equal after 100
// steps at every N, which is the acceptance's N-independence. The gradients are dyadic and the
// same on every rank, so the averaged gradient is exact whatever the number of ranks. Parameters
// over and under the 4096-element threshold, last blocks that are short, parameters split across
// buckets and shards, two groups. Also: the kernels (scalar and AVX-512) agree bit for bit, the
// quantiser picks the nearest code, and memory() counts 2 + 8/256 bytes per element.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kernels/adam8bit.hpp"
#include "shardopt/estimate.hpp"
#include "shardopt/optimizer.hpp"
#include "support/adam8bit_model.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

constexpr int64_t kSteps = 100;

// ---- the reference: whole tensors, one process --------------------------------------------------

// bitsandbytes' dynamic maps, written out again (Note [Dynamic 8-bit map] in
// src/kernels/adam8bit.hpp): byte -> value, and the nearest-code rule as the kernels compute it.
struct RefMap {
  bool is_signed;
  std::vector<float> value = std::vector<float>(256, 0.0f);
  float lower[7], scale[7], per_unit[7], below_mid[7], top_mid;
  int base[7], last[7];
  explicit RefMap(bool s) : is_signed(s) {
    int b = 1;
    double prev = 0.0;
    auto code = [](int d, int k, int n) {
      return std::pow(10.0, d - 6) * (0.1 + (k + 0.5) * 0.9 / n);
    };
    for (int d = 0; d < 7; ++d) {
      const int n = s ? 1 << d : 2 << d;
      lower[d] = static_cast<float>(std::pow(10.0, d - 7));
      scale[d] = static_cast<float>(std::pow(10.0, 6 - d));
      per_unit[d] = static_cast<float>(n / 0.9);
      below_mid[d] = static_cast<float>((prev + code(d, 0, n)) / 2);
      base[d] = b;
      last[d] = n - 1;
      const float width = static_cast<float>(0.9 / n);
      const float ten = static_cast<float>(std::pow(10.0, d - 6));
      for (int k = 0; k < n; ++k) {
        value[b + k] = (0.1f + (static_cast<float>(k) + 0.5f) * width) * ten;
        if (s) value[0x80 | (b + k)] = -value[b + k];
      }
      prev = code(d, n - 1, n);
      b += n;
    }
    top_mid = static_cast<float>((prev + 1.0) / 2);
    value[s ? 0x80 : 255] = 1.0f;
  }
  uint8_t quantize(float y) const {
    const float a = std::fabs(y);
    int d = 0;
    while (d < 6 && a >= lower[d + 1]) ++d;
    const float t = (a * scale[d] - 0.1f) * per_unit[d];
    const int k = std::clamp(static_cast<int>(std::floor(t)), 0, last[d]);
    const int mag = base[d] + k - (a < below_mid[d] ? 1 : 0);
    if (!is_signed) return static_cast<uint8_t>(mag + (a > top_mid ? 1 : 0));
    if (y < 0) return static_cast<uint8_t>(mag > 0 ? 0x80 | mag : 0);
    return static_cast<uint8_t>(a > top_mid ? 0x80 : mag);
  }
};

const RefMap& ref_map(bool s) {
  static const RefMap m1(true), m2(false);
  return s ? m1 : m2;
}

struct RefState {
  std::vector<uint8_t> q1, q2;
  std::vector<float> a1, a2, m, v;  // a1, a2 per block; m, v for small tensors
};

struct RefCoeffs {
  float decay, b1, omb1, b2, omb2, isbc2, eps, nss;
  RefCoeffs(const AdamW8bit& r, int64_t step) {
    const double s = static_cast<double>(step);
    decay = static_cast<float>(1.0 - r.lr() * r.weight_decay());
    b1 = static_cast<float>(r.beta1()), omb1 = static_cast<float>(1.0 - r.beta1());
    b2 = static_cast<float>(r.beta2()), omb2 = static_cast<float>(1.0 - r.beta2());
    isbc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(r.beta2(), s)));
    eps = static_cast<float>(r.eps());
    nss = static_cast<float>(-r.lr() / (1.0 - std::pow(r.beta1(), s)));
  }
  void apply(float& p, float m, float v) const {
    p = p * decay + nss * m / (std::sqrt(v) * isbc2 + eps);
  }
};

void reference_step(const AdamW8bit& r, int64_t step, float* p, const float* g, int64_t n,
                    RefState& st) {
  const RefCoeffs c(r, step);
  if (static_cast<double>(n) < r.min_8bit_size()) {
    st.m.resize(n, 0.0f), st.v.resize(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      st.m[i] = st.m[i] * c.b1 + g[i] * c.omb1;
      st.v[i] = st.v[i] * c.b2 + g[i] * g[i] * c.omb2;
      c.apply(p[i], st.m[i], st.v[i]);
    }
    return;
  }
  const int64_t blocks = (n + 255) / 256;
  st.q1.resize(n, 0), st.q2.resize(n, 0), st.a1.resize(blocks, 0.0f), st.a2.resize(blocks, 0.0f);
  const RefMap &s1 = ref_map(true), &s2 = ref_map(false);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * 256, hi = std::min(n, lo + 256);
    std::vector<float> m(hi - lo), v(hi - lo);
    float max1 = 0, max2 = 0;
    for (int64_t i = lo; i < hi; ++i) {
      m[i - lo] = s1.value[st.q1[i]] * st.a1[b] * c.b1 + g[i] * c.omb1;
      v[i - lo] = s2.value[st.q2[i]] * st.a2[b] * c.b2 + g[i] * g[i] * c.omb2;
      c.apply(p[i], m[i - lo], v[i - lo]);
      max1 = std::max(max1, std::fabs(m[i - lo]));
      max2 = std::max(max2, v[i - lo]);
    }
    const float r1 = max1 > 0 ? 1.0f / max1 : 0.0f, r2 = max2 > 0 ? 1.0f / max2 : 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      st.q1[i] = s1.quantize(m[i - lo] * r1);
      st.q2[i] = s2.quantize(v[i - lo] * r2);
    }
    st.a1[b] = max1, st.a2[b] = max2;
  }
}

// ---- the model: tests/support/adam8bit_model.hpp ------------------------------------------

using test::adam8bit::gradient;
using test::adam8bit::kShapes;
using test::adam8bit::Net;
using test::adam8bit::rule;

std::vector<at::Tensor> reference(int64_t steps) {
  Net net;
  std::vector<at::Tensor> out;
  std::vector<RefState> states(kShapes.size());
  for (auto& p : net.params) out.push_back(p.detach().clone().reshape(-1).contiguous());
  for (int64_t s = 0; s < steps; ++s) {
    for (size_t p = 0; p < out.size(); ++p) {
      AdamW8bit r = rule();
      if (kShapes[p].group == 1) r.lr(3e-3).weight_decay(0.0);
      const at::Tensor g = gradient(static_cast<int64_t>(p), s, out[p].numel());
      reference_step(r, s + 1, out[p].data_ptr<float>(), g.data_ptr<float>(), out[p].numel(),
                     states[p]);
    }
  }
  return out;
}

ZeroOptions options(int stage) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 4 * 3000;  // the large parameters split across buckets
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

class Adam8bitParity : public ::testing::TestWithParam<int> {};

DIST_TEST_P(Adam8bitParity, BitwiseAtEveryN) {
  const int stage = param;
  static const auto expected = reference(kSteps);  // once for all ranks and stages
  Net net;
  DistributedOptimizer opt(net.groups(), rule(), test::world(), options(stage));
  for (int64_t s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    opt.backward(net.loss(s));
    opt.step();
  }
  opt.gather_full_parameters();
  bool same = true;
  const Net initial;
  for (size_t p = 0; p < kShapes.size(); ++p) {
    const at::Tensor got = net.params[p].detach().reshape(-1);
    // Moved, by about what fp32 AdamW moves them (at most lr * 100 steps = 1; about 0.15 here).
    const double moved = (got - initial.params[p].detach().reshape(-1)).abs().max().item<double>();
    EXPECT_GT(moved, 1e-3) << kShapes[p].name;
    EXPECT_LT(moved, 0.5) << kShapes[p].name;
    const bool eq = at::equal(got, expected[p]);
    EXPECT_TRUE(eq) << kShapes[p].name << ": max diff "
                    << (got - expected[p]).abs().max().item<double>();
    same = same && eq;
  }
  // Bytes: codes 2 per element, two fp32 maxima per 256, fp32 m and v of the small parameters
  // (each rank's share of them: all of them when the plan keeps whole buffers).
  const int64_t n = test::world()->size();
  const int64_t elems = stage == 0 ? opt.padded_numel() : opt.padded_numel() / n;
  const int64_t bytes = opt.memory().optimizer_state_bytes;
  EXPECT_GE(bytes, 2 * elems + 8 * (elems / 256));
  const int64_t small = 70 + 300 + 4095;
  EXPECT_LE(bytes, 2 * elems + 8 * (elems / 256) + 8 * small);
  if (stage == 0) EXPECT_EQ(bytes, 2 * elems + 8 * (elems / 256) + 8 * small);
  EXPECT_TRUE(test::all_ranks(same));
}

INSTANTIATE_TEST_SUITE_P(Stages, Adam8bitParity, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return fmt::format("stage{}", info.param); });

// memory() is what the estimator predicts (every parameter 8-bit here: min_8bit_size 0), at most
// the 2.05 bytes per parameter of the rank's shard: 2 + 8/256.
DIST_TEST(Adam8bitMemory, MatchesEstimator) {
  Net net;
  DistributedOptimizer opt(net.groups(), rule().min_8bit_size(0), test::world(), options(2));
  const int64_t shard = opt.padded_numel() / test::world()->size();
  const int64_t want =
      estimate::state_bytes(estimate::Optimizer::AdamW8bit, Precision::FP32) * shard +
      estimate::block_bytes(estimate::Optimizer::AdamW8bit, shard);
  EXPECT_EQ(want, 2 * shard + 8 * (shard / 256));
  EXPECT_LE(static_cast<double>(want), 2.05 * static_cast<double>(shard));
  EXPECT_EQ(opt.memory().optimizer_state_bytes, want);
  EXPECT_TRUE(test::all_ranks(opt.memory().optimizer_state_bytes == want));
}

// ---- the kernels ------------------------------------------------------------------------------

// The AVX-512 kernel equals the scalar one bit for bit (random moments, gradients of many
// magnitudes, a short last block), and both equal the reference above.
TEST(Adam8bitKernels, ScalarAvx512AndReferenceAgree) {
  using namespace detail::kernels;
  const int64_t n = 256 * 9 + 77;
  const at::Tensor p0 = at::randn({n}, at::kFloat);
  std::vector<CpuIsa> isas{CpuIsa::Scalar};
  if (cpu_isa_supported(CpuIsa::Avx512)) isas.push_back(CpuIsa::Avx512);
  std::vector<at::Tensor> results;
  for (CpuIsa isa : isas) {
    at::Tensor p = p0.clone();
    at::Tensor q1 = at::zeros({n}, at::kByte), q2 = at::zeros({n}, at::kByte);
    at::Tensor a1 = at::zeros({(n + 255) / 256}), a2 = at::zeros({(n + 255) / 256});
    for (int64_t s = 0; s < 5; ++s) {
      const at::Tensor g = gradient(7, s, n);
      Adam8bitHyper h;
      h.lr = 1e-2, h.weight_decay = 0.1, h.step = s + 1;
      fused_adam8bit(h, {p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                         q2.data_ptr<uint8_t>(), a1.data_ptr<float>(), a2.data_ptr<float>(), n},
                     isa);
    }
    results.push_back(at::cat({p, q1.to(at::kFloat), q2.to(at::kFloat), a1, a2}));
  }
  if (results.size() == 2) EXPECT_TRUE(at::equal(results[0], results[1]));
  at::Tensor p = p0.clone();
  RefState st;
  for (int64_t s = 0; s < 5; ++s) {
    const at::Tensor g = gradient(7, s, n);
    reference_step(AdamW8bit(1e-2).weight_decay(0.1).min_8bit_size(0), s + 1, p.data_ptr<float>(),
                   g.data_ptr<float>(), n, st);
  }
  EXPECT_TRUE(at::equal(results[0].narrow(0, 0, n), p));
}

// The maps are bitsandbytes' (255 distinct codes plus zero), and the quantiser picks the nearest
// code, up to the rounding of its arithmetic near a midpoint.
TEST(Adam8bitKernels, QuantiserPicksNearestCode) {
  using namespace detail::kernels;
  for (bool s : {true, false}) {
    const float* map = dynamic_map(s);
    std::vector<float> sorted(map, map + 256);
    for (int b = 0; b < 256; ++b) EXPECT_EQ(map[b], ref_map(s).value[b]) << b;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::unique(sorted.begin(), sorted.end()) - sorted.begin(), s ? 256 : 256);
    EXPECT_EQ(sorted.back(), 1.0f);
    EXPECT_EQ(sorted.front(), s ? map[0xFF] : 0.0f);
    auto gen = at::randn({20000}, at::kDouble);
    for (int64_t i = 0; i < gen.numel(); ++i) {
      // magnitudes spread over 1e-8 .. 1
      const double z = gen[i].item<double>();
      float y = static_cast<float>(std::pow(10.0, -8.0 * std::fabs(std::sin(3.0 * z))));
      if (s && z < 0) y = -y;
      const uint8_t q = quantize_dynamic(y, s);
      EXPECT_EQ(q, ref_map(s).quantize(y));
      float best = 2;
      for (float c : sorted) best = std::min(best, std::fabs(c - y));
      EXPECT_LE(std::fabs(map[q] - y), best + 4e-7f * std::fabs(y) + 1e-12f) << y;
    }
  }
}

}  // namespace
}  // namespace shardopt
