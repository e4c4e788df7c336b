// The fused CPU kernels (src/kernels): every instruction set this CPU has, forced explicitly,
// against an independent scalar reference (bit for bit: tails, odd lengths, unaligned pointers,
// bf16/fp16 copies), plus the multi-threaded drivers, the dispatch and the argument checks.
// Against torch::optim: kernels_torch_test.cpp.
#include "support/expect_error.hpp"
#include "unit/kernels_support.hpp"

namespace shardopt::detail::kernels {
namespace {

const std::vector<int64_t> kSizes = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 100, 1000, 4099};
// Offsets (in floats) of param, grad, state 1, state 2, state 3, low copy.
const std::vector<std::vector<int64_t>> kOffsets = {
    {0, 0, 0, 0, 0, 0}, {1, 3, 5, 7, 2, 1}, {15, 2, 9, 4, 11, 3}};
const LowPrecision kLows[] = {LowPrecision::None, LowPrecision::BFloat16, LowPrecision::Float16};

std::string describe(int64_t n, size_t offsets, LowPrecision low, int64_t step) {
  return "numel " + std::to_string(n) + ", offsets #" + std::to_string(offsets) + ", low " +
         std::to_string(static_cast<int>(low)) + ", step " + std::to_string(step);
}

TEST_P(KernelIsa, AdamMatchesScalarReferenceBitwise) {
  std::vector<AdamHyper> hypers(5);
  hypers[0].weight_decay = 0.01;                                     // AdamW
  hypers[1].weight_decay = 0.1, hypers[1].decoupled = false;         // Adam with L2
  hypers[2].lr = 3e-2, hypers[2].beta1 = 0.8, hypers[2].eps = 1e-6;  // no decay
  hypers[3].weight_decay = 0.01, hypers[3].amsgrad = true;
  hypers[4].weight_decay = 0.05, hypers[4].decoupled = false, hypers[4].amsgrad = true;
  int configs = 0;
  for (size_t hi = 0; hi < hypers.size(); ++hi) {
    for (int64_t n : kSizes) {
      for (size_t oi = 0; oi < kOffsets.size(); ++oi) {
        for (LowPrecision lk : kLows) {
          const auto& o = kOffsets[oi];
          const uint32_t seed = static_cast<uint32_t>(hi * 1000 + n + oi * 7);
          Buffer p(n, o[0]), g(n, o[1]), m(n, o[2]), v(n, o[3]), vmax(n, o[4]);
          Buffer16 low(n, o[5]);
          p.fill(normal(n, 1.0f, seed));
          m.fill(normal(n, 0.1f, seed + 1));
          auto v0 = normal(n, 0.1f, seed + 2);
          for (auto& x : v0) x *= x;
          v.fill(v0);
          vmax.fill(v0);
          Buffer rp = p, rm = m, rv = v, rvmax = vmax;
          Buffer16 rlow = low;
          for (int64_t step = 1; step <= 3; ++step) {
            auto grad = normal(n, 0.5f, seed + 10 + step);
            if (n > 2) grad[n / 2] = 0.0f, grad[1] = -0.0f;
            g.fill(grad);
            AdamHyper h = hypers[hi];
            h.step = step;
            AdamSegment s{p.data(), g.data(), m.data(), v.data(), vmax.data(), {lk, low.data()}, n};
            if (!h.amsgrad) s.max_exp_avg_sq = nullptr;
            if (lk == LowPrecision::None) s.low.data = nullptr;
            raw::adam(isa(), h, s);
            ref_adam(h, rp.data(), g.data(), rm.data(), rv.data(), rvmax.data(), {lk, rlow.data()},
                     n);
            SCOPED_TRACE("hyper #" + std::to_string(hi) + ", " + describe(n, oi, lk, step));
            EXPECT_SAME_BITS(p.data(), rp.data(), n, "param");
            EXPECT_SAME_BITS(m.data(), rm.data(), n, "exp_avg");
            EXPECT_SAME_BITS(v.data(), rv.data(), n, "exp_avg_sq");
            if (h.amsgrad) EXPECT_SAME_BITS(vmax.data(), rvmax.data(), n, "max_exp_avg_sq");
            if (lk != LowPrecision::None) EXPECT_SAME_BITS(low.data(), rlow.data(), n, "low");
            if (HasFailure()) return;
            ++configs;
          }
          // Nothing outside [0, n) was written (the staging of the last partial vector).
          EXPECT_EQ(p.storage[o[0] + n], 0.0f);
          EXPECT_EQ(m.storage[o[2] + n], 0.0f);
        }
      }
    }
  }
  EXPECT_EQ(configs, 5 * 16 * 3 * 3 * 3);
}

// The vector kernels divide by sqrt(bias_correction2) through a double reciprocal (Note [Division
// by a constant] in cpu_kernels.hpp): second moments spread over the whole float range, for
// several betas and steps, must still give the scalar reference's bits.
TEST_P(KernelIsa, AdamDenominatorOverTheWholeFloatRange) {
  const int64_t n = 1 << 18;
  std::mt19937 rng(11);
  std::vector<float> v0(n), m0 = normal(n, 1.0f, 12), p0 = normal(n, 1.0f, 13);
  for (auto& x : v0) {
    const uint32_t u = rng() % 0x7F800000u;  // every finite non-negative float, 0 included
    std::memcpy(&x, &u, sizeof x);
  }
  const std::vector<float> g(n, 0.0f);  // v' = v * beta2: the spread survives the update
  for (double beta2 : {0.999, 0.95, 0.9999}) {
    for (int64_t step : {1, 2, 10, 1000, 100000}) {
      AdamHyper h;
      h.beta2 = beta2, h.step = step, h.weight_decay = 0.01;
      std::vector<float> p = p0, m = m0, v = v0, rp = p0, rm = m0, rv = v0;
      raw::adam(isa(), h, {p.data(), g.data(), m.data(), v.data(), nullptr, {}, n});
      ref_adam(h, rp.data(), g.data(), rm.data(), rv.data(), nullptr, {}, n);
      SCOPED_TRACE("beta2 " + std::to_string(beta2) + " step " + std::to_string(step));
      EXPECT_SAME_BITS(p.data(), rp.data(), n, "param");
      if (HasFailure()) return;
    }
  }
}

TEST_P(KernelIsa, SgdMatchesScalarReferenceBitwise) {
  std::vector<SgdHyper> hypers(5);
  hypers[0].lr = 0.1;
  hypers[1].lr = 0.05, hypers[1].weight_decay = 1e-2;
  hypers[2].lr = 0.1, hypers[2].momentum = 0.9;
  hypers[3].lr = 0.1, hypers[3].momentum = 0.9, hypers[3].dampening = 0.3;
  hypers[4].lr = 0.2, hypers[4].momentum = 0.8, hypers[4].nesterov = true,
  hypers[4].weight_decay = 1e-3;
  for (size_t hi = 0; hi < hypers.size(); ++hi) {
    for (int64_t n : kSizes) {
      for (size_t oi = 0; oi < kOffsets.size(); ++oi) {
        for (LowPrecision lk : kLows) {
          const auto& o = kOffsets[oi];
          const uint32_t seed = static_cast<uint32_t>(hi * 1000 + n + oi * 7 + 5);
          Buffer p(n, o[0]), g(n, o[1]), buf(n, o[2]);
          Buffer16 low(n, o[5]);
          p.fill(normal(n, 1.0f, seed));
          Buffer rp = p, rbuf = buf;
          Buffer16 rlow = low;
          const bool momentum = hypers[hi].momentum != 0;
          for (int64_t step = 1; step <= 3; ++step) {
            g.fill(normal(n, 0.5f, seed + 10 + step));
            SgdHyper h = hypers[hi];
            h.step = step;
            raw::sgd(isa(), h,
                     {p.data(),
                      g.data(),
                      momentum ? buf.data() : nullptr,
                      {lk, lk == LowPrecision::None ? nullptr : low.data()},
                      n});
            ref_sgd(h, rp.data(), g.data(), rbuf.data(), {lk, rlow.data()}, n);
            SCOPED_TRACE("hyper #" + std::to_string(hi) + ", " + describe(n, oi, lk, step));
            EXPECT_SAME_BITS(p.data(), rp.data(), n, "param");
            if (momentum) EXPECT_SAME_BITS(buf.data(), rbuf.data(), n, "momentum_buffer");
            if (lk != LowPrecision::None) EXPECT_SAME_BITS(low.data(), rlow.data(), n, "low");
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST_P(KernelIsa, LambPhasesMatchScalarReference) {
  for (double wd : {0.0, 0.01}) {
    for (int64_t n : kSizes) {
      for (size_t oi = 0; oi < kOffsets.size(); ++oi) {
        for (LowPrecision lk : kLows) {
          const auto& o = kOffsets[oi];
          const uint32_t seed = static_cast<uint32_t>(n + oi * 7 + (wd != 0 ? 77 : 0));
          Buffer p(n, o[0]), g(n, o[1]), m(n, o[2]), v(n, o[3]);
          Buffer16 low(n, o[5]);
          p.fill(normal(n, 1.0f, seed));
          Buffer rp = p, rm = m, rv = v;
          Buffer16 rlow = low;
          for (int64_t step = 1; step <= 3; ++step) {
            g.fill(normal(n, 0.5f, seed + 10 + step));
            LambHyper h;
            h.lr = 1e-2, h.weight_decay = wd, h.step = step;
            LambSegment s{p.data(), g.data(), m.data(), v.data(), {}, n};
            const LambNorms got = raw::lamb_phase1(isa(), h, s);
            const LambNorms want = ref_lamb1(h, rp.data(), g.data(), rm.data(), rv.data(), n);
            SCOPED_TRACE("wd " + std::to_string(wd) + ", " + describe(n, oi, lk, step));
            EXPECT_SAME_BITS(m.data(), rm.data(), n, "exp_avg");
            EXPECT_SAME_BITS(v.data(), rv.data(), n, "exp_avg_sq");
            // Sums of exact double squares; only the order of the additions differs.
            EXPECT_NEAR(got.param_sq, want.param_sq, 1e-12 * want.param_sq);
            EXPECT_NEAR(got.update_sq, want.update_sq, 1e-12 * want.update_sq);
            const double trust = 0.5 + 0.1 * static_cast<double>(step);
            s.low = {lk, lk == LowPrecision::None ? nullptr : low.data()};
            raw::lamb_phase2(isa(), h, trust, s);
            ref_lamb2(h, trust, rp.data(), rm.data(), rv.data(), {lk, rlow.data()}, n);
            EXPECT_SAME_BITS(p.data(), rp.data(), n, "param");
            if (lk != LowPrecision::None) EXPECT_SAME_BITS(low.data(), rlow.data(), n, "low");
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// Values at the rounding edges of bf16 and fp16 pass through an SGD step with lr = 0 (p stays
// bitwise the same), so the low copy must equal torch's cast of those exact values.
TEST_P(KernelIsa, LowPrecisionCopyEqualsTorchCast) {
  std::vector<float> values = {0.0f,     -0.0f,    1.0f,      -1.0f,         65504.0f,
                               65519.0f, 65520.0f, -65520.0f, 1e-5f,         6e-8f,
                               3e-8f,    2.98e-8f, -5.96e-8f, 1e-40f,        -1e-45f,
                               3.4e38f,  INFINITY, -INFINITY, 1.0009765625f, 1.00048828125f};
  for (uint32_t u : {0x3F808000u, 0x3F818000u, 0x3F80C000u, 0x7F7FFFFFu, 0x00800000u, 0x3F800001u,
                     0xC0FF8000u, 0x387FE000u, 0x33800000u, 0x33000001u}) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    values.push_back(x);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 3000; ++i) {  // random bits over the whole finite range
    uint32_t u = rng();
    if (((u >> 23) & 0xFF) == 0xFF) u &= ~(1u << 30);
    float x;
    std::memcpy(&x, &u, sizeof x);
    values.push_back(x);
  }
  const int64_t n = static_cast<int64_t>(values.size());
  const at::Tensor fp32 = at::from_blob(values.data(), {n}).clone();
  for (LowPrecision lk : {LowPrecision::BFloat16, LowPrecision::Float16}) {
    Buffer p(n, 3), g(n, 1);
    p.fill(values);
    g.fill(std::vector<float>(values.size(), 1.0f));
    Buffer16 low(n, 5);
    SgdHyper h;
    raw::sgd(isa(), h, {p.data(), g.data(), nullptr, {lk, low.data()}, n});
    EXPECT_SAME_BITS(p.data(), values.data(), n, "param (lr 0)");
    const at::Tensor want = fp32.to(lk == LowPrecision::BFloat16 ? at::kBFloat16 : at::kHalf);
    const auto* w = static_cast<const uint16_t*>(want.data_ptr());
    EXPECT_SAME_BITS(low.data(), w, n, lk == LowPrecision::BFloat16 ? "bf16" : "fp16");
  }
  // NaN: one canonical pattern per format (c10's), sign kept for fp16.
  std::vector<float> nans = {NAN, -NAN};
  for (uint32_t u : {0x7F800001u, 0xFFC01234u, 0x7FBFFFFFu}) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    nans.push_back(x);
  }
  for (LowPrecision lk : {LowPrecision::BFloat16, LowPrecision::Float16}) {
    const int64_t m = static_cast<int64_t>(nans.size());
    std::vector<float> p = nans, g(nans.size(), 1.0f);
    std::vector<uint16_t> low(nans.size());
    raw::sgd(isa(), SgdHyper{}, {p.data(), g.data(), nullptr, {lk, low.data()}, m});
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t sign = (bits(nans[i]) >> 16) & 0x8000;
      EXPECT_EQ(low[i], lk == LowPrecision::BFloat16 ? 0x7FC0 : (sign | 0x7E00)) << i;
    }
  }
}

TEST_P(KernelIsa, ThreadedDriverEqualsSingleThread) {
  const int threads = at::get_num_threads();
  const int64_t n = 5 * kChunkNumel + 123;
  LambNorms first;
  for (int t : {1, 2, 3}) {
    at::set_num_threads(t);
    std::vector<float> p = normal(n, 1.0f, 1), g = normal(n, 0.5f, 2), m(n), v(n);
    std::vector<float> p1 = p, m1 = m, v1 = v;
    std::vector<uint16_t> low(n), low1(n);
    AdamHyper h;
    h.step = 1;
    fused_adam(
        h,
        {p.data(), g.data(), m.data(), v.data(), nullptr, {LowPrecision::BFloat16, low.data()}, n},
        isa());
    raw::adam(isa(), h,
              {p1.data(),
               g.data(),
               m1.data(),
               v1.data(),
               nullptr,
               {LowPrecision::BFloat16, low1.data()},
               n});
    SCOPED_TRACE("threads " + std::to_string(t));
    EXPECT_SAME_BITS(p.data(), p1.data(), n, "param");
    EXPECT_SAME_BITS(v.data(), v1.data(), n, "exp_avg_sq");
    EXPECT_SAME_BITS(low.data(), low1.data(), n, "low");

    std::vector<float> q = normal(n, 1.0f, 3), qm(n), qv(n);
    std::vector<float> q1 = q, qm1 = qm, qv1 = qv;
    SgdHyper sh;
    sh.lr = 0.1, sh.momentum = 0.9, sh.step = 1;
    fused_sgd(sh, {q.data(), g.data(), qm.data(), {}, n}, isa());
    raw::sgd(isa(), sh, {q1.data(), g.data(), qm1.data(), {}, n});
    EXPECT_SAME_BITS(q.data(), q1.data(), n, "sgd param");

    // LAMB norms are summed per chunk in chunk order: the same for every thread count.
    std::vector<float> lp = normal(n, 1.0f, 4), lm(n), lv(n);
    LambHyper lh;
    const LambNorms norms =
        fused_lamb_phase1(lh, {lp.data(), g.data(), lm.data(), lv.data(), {}, n}, isa());
    if (t == 1) first = norms;
    EXPECT_EQ(norms.param_sq, first.param_sq);
    EXPECT_EQ(norms.update_sq, first.update_sq);
    fused_lamb_phase2(lh, 0.7, {lp.data(), nullptr, lm.data(), lv.data(), {}, n}, isa());
  }
  at::set_num_threads(threads);
}

TEST_P(KernelIsa, ZeroLengthTouchesNothing) {
  AdamHyper ah;
  ah.amsgrad = true;
  EXPECT_NO_THROW(fused_adam(ah, {}, isa()));
  EXPECT_NO_THROW(raw::adam(isa(), ah, {}));
  EXPECT_NO_THROW(fused_sgd(SgdHyper{}, {}, isa()));
  const LambNorms norms = fused_lamb_phase1(LambHyper{}, {}, isa());
  EXPECT_EQ(norms.param_sq, 0.0);
  EXPECT_EQ(norms.update_sq, 0.0);
  EXPECT_NO_THROW(fused_lamb_phase2(LambHyper{}, 1.0, {}, isa()));
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelIsa,
                         ::testing::Values(CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// ---- dispatch and argument checks -------------------------------------------------------------

TEST(KernelDispatch, AutoIsASupportedSet) {
  const CpuIsa isa = resolve_cpu_isa(CpuIsa::Auto);
  EXPECT_NE(isa, CpuIsa::Auto);
  EXPECT_TRUE(cpu_isa_supported(isa)) << to_string(isa);
  if (std::getenv("SHARDOPT_CPU_KERNEL") == nullptr) {  // otherwise the variable decides
    if (cpu_isa_supported(CpuIsa::Avx512)) EXPECT_EQ(isa, CpuIsa::Avx512);
  }
  for (CpuIsa other : {CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (cpu_isa_supported(other)) continue;
    try {
      resolve_cpu_isa(other);
      ADD_FAILURE() << "expected Unsupported for " << to_string(other);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    }
  }
}

// CTest runs this once more with SHARDOPT_CPU_KERNEL=scalar (unit_kernels_env_scalar).
TEST(KernelDispatch, EnvironmentVariableChoosesTheSet) {
  const char* env = std::getenv("SHARDOPT_CPU_KERNEL");
  if (env == nullptr) GTEST_SKIP() << "SHARDOPT_CPU_KERNEL is not set";
  EXPECT_STREQ(to_string(resolve_cpu_isa(CpuIsa::Auto)), env);
}

void expect_invalid(const std::function<void()>& call, const std::string& needle) {
  test::expect_error(call, ErrorKind::InvalidArgument, {needle});
}

TEST(KernelDispatch, BadSegmentsAreNamed) {
  float x[4] = {};
  AdamHyper h;
  expect_invalid(
      [&] {
        fused_adam(h, {x, nullptr, x + 1, x + 2, nullptr, {}, 1});
      },
      "fused_adam: segment.grad is null, expected 1 elements");
  h.amsgrad = true;
  expect_invalid(
      [&] {
        fused_adam(h, {x, x + 1, x + 2, x + 3, nullptr, {}, 1});
      },
      "segment.max_exp_avg_sq (amsgrad) is null");
  h.amsgrad = false;
  h.step = 0;
  expect_invalid(
      [&] {
        fused_adam(h, {x, x + 1, x + 2, x + 3, nullptr, {}, 1});
      },
      "hyper.step is 1-based");
  h.step = 1;
  expect_invalid(
      [&] {
        fused_adam(h, {x, x + 1, x + 2, x + 3, nullptr, {}, -3});
      },
      "segment.numel must be >= 0, got -3");
  expect_invalid(
      [&] {
        fused_adam(h, {x, x + 1, x + 2, x + 3, nullptr, {LowPrecision::BFloat16, nullptr}, 1});
      },
      "segment.low.data is null");
  SgdHyper sh;
  sh.momentum = 0.9;
  expect_invalid(
      [&] {
        fused_sgd(sh, {x, x + 1, nullptr, {}, 1});
      },
      "fused_sgd: segment.momentum_buffer is null");
  expect_invalid(
      [&] {
        fused_lamb_phase1(LambHyper{}, {x, x + 1, nullptr, x + 3, {}, 1});
      },
      "fused_lamb_phase1: segment.exp_avg is null");
}

}  // namespace
}  // namespace shardopt::detail::kernels
