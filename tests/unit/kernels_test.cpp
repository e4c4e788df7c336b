// The fused CPU kernels (src/kernels): every instruction set this CPU has, forced explicitly,
// against an independent scalar reference (bit for bit: tails, odd lengths, unaligned pointers,
// bf16/fp16 copies), against torch::optim::AdamW/Adam/SGD and the engine's LAMB over several
// steps (<= 1e-6), plus the multi-threaded drivers and the argument checks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/fused.hpp"
#include "shardopt/error.hpp"

// The reference must not fuse a*b + c either (it would on a target with FMA by default).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace shardopt::detail::kernels {
namespace {

// ---- data -------------------------------------------------------------------------------------

std::vector<float> normal(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = scale * dist(rng);
  return out;
}

// A float buffer of n elements that starts `offset` floats into its allocation (offsets 1..15
// make the pointer unaligned for 32- and 64-byte vectors).
struct Buffer {
  Buffer(int64_t n, int64_t offset) : storage(static_cast<size_t>(n + offset + 1)), off(offset) {}
  float* data() { return storage.data() + off; }
  void fill(const std::vector<float>& values) {
    for (size_t i = 0; i < values.size(); ++i) data()[i] = values[i];
  }
  std::vector<float> storage;
  int64_t off;
};
struct Buffer16 {
  Buffer16(int64_t n, int64_t offset) : storage(static_cast<size_t>(n + offset + 1)), off(offset) {}
  uint16_t* data() { return storage.data() + off; }
  std::vector<uint16_t> storage;
  int64_t off;
};

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// First index where a and b differ in bits, or -1.
template <class T>
int64_t first_difference(const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0) return i;
  }
  return -1;
}

#define EXPECT_SAME_BITS(a, b, n, what)                                                            \
  do {                                                                                             \
    const int64_t _i = first_difference((a), (b), (n));                                            \
    EXPECT_EQ(_i, -1) << (what) << " differs at " << _i << ": " << +(a)[_i < 0 ? 0 : _i] << " vs " \
                      << +(b)[_i < 0 ? 0 : _i];                                                    \
  } while (false)

uint16_t to_low(float x, LowPrecision kind) {
  if (kind == LowPrecision::BFloat16) return c10::BFloat16(x).x;
  return c10::Half(x).x;
}

// ---- the independent scalar references (torch 1.13's op sequence, written out) ---------------

void ref_adam(const AdamHyper& h, float* p, const float* g, float* m, float* v, float* vmax,
              LowPrecisionOut low, int64_t n) {
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
  const float b1 = static_cast<float>(h.beta1), ob1 = static_cast<float>(1 - h.beta1);
  const float b2 = static_cast<float>(h.beta2), ob2 = static_cast<float>(1 - h.beta2);
  const float sqrt_bc2 = static_cast<float>(std::sqrt(bc2)), eps = static_cast<float>(h.eps);
  const float neg_step = static_cast<float>(-(h.lr / bc1));
  const float keep = static_cast<float>(1 - h.lr * h.weight_decay);
  const float wd = static_cast<float>(h.weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i], gi = g[i];
    if (h.weight_decay != 0 && h.decoupled) pi = pi * keep;
    if (h.weight_decay != 0 && !h.decoupled) gi = std::fma(pi, wd, gi);  // g.add(p, wd)
    m[i] = std::fma(gi, ob1, m[i] * b1);                                 // add_(g, 1-b1)
    v[i] = std::fma(ob2 * gi, gi, v[i] * b2);                            // addcmul_(g, g, 1-b2)
    float s = v[i];
    if (h.amsgrad) s = vmax[i] = v[i] > vmax[i] ? v[i] : vmax[i];
    const float denom = std::sqrt(s) / sqrt_bc2 + eps;
    p[i] = pi + (neg_step * m[i]) / denom;  // addcdiv_
    if (low.kind != LowPrecision::None) low.data[i] = to_low(p[i], low.kind);
  }
}

void ref_sgd(const SgdHyper& h, float* p, const float* g, float* buf, LowPrecisionOut low,
             int64_t n) {
  const float wd = static_cast<float>(h.weight_decay), mom = static_cast<float>(h.momentum);
  const float omd = static_cast<float>(1 - h.dampening), neg_lr = static_cast<float>(-h.lr);
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (h.weight_decay != 0) d = std::fma(p[i], wd, d);
    if (h.momentum != 0) {
      buf[i] = h.step == 1 ? d : std::fma(d, omd, buf[i] * mom);
      d = h.nesterov ? std::fma(buf[i], mom, d) : buf[i];
    }
    p[i] = std::fma(d, neg_lr, p[i]);
    if (low.kind != LowPrecision::None) low.data[i] = to_low(p[i], low.kind);
  }
}

struct RefLamb {
  float b1, ob1, b2, ob2, bc1, bc2, eps, wd;
  explicit RefLamb(const LambHyper& h)
      : b1(static_cast<float>(h.beta1)),
        ob1(static_cast<float>(1 - h.beta1)),
        b2(static_cast<float>(h.beta2)),
        ob2(static_cast<float>(1 - h.beta2)),
        bc1(static_cast<float>(1 - std::pow(h.beta1, static_cast<double>(h.step)))),
        bc2(static_cast<float>(1 - std::pow(h.beta2, static_cast<double>(h.step)))),
        eps(static_cast<float>(h.eps)),
        wd(static_cast<float>(h.weight_decay)) {}
  float update(float p, float m, float v) const {
    float u = (m / bc1) / (std::sqrt(v / bc2) + eps);
    if (wd != 0) u = std::fma(p, wd, u);
    return u;
  }
};

LambNorms ref_lamb1(const LambHyper& h, const float* p, const float* g, float* m, float* v,
                    int64_t n) {
  const RefLamb r(h);
  LambNorms norms;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = std::fma(g[i], r.ob1, m[i] * r.b1);
    v[i] = std::fma(r.ob2 * g[i], g[i], v[i] * r.b2);
    const double u = r.update(p[i], m[i], v[i]);
    norms.param_sq += static_cast<double>(p[i]) * p[i];
    norms.update_sq += u * u;
  }
  return norms;
}

void ref_lamb2(const LambHyper& h, double trust, float* p, const float* m, const float* v,
               LowPrecisionOut low, int64_t n) {
  const RefLamb r(h);
  const float alpha = static_cast<float>(-h.lr * trust);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::fma(r.update(p[i], m[i], v[i]), alpha, p[i]);
    if (low.kind != LowPrecision::None) low.data[i] = to_low(p[i], low.kind);
  }
}

// ---- every instruction set, forced ----------------------------------------------------------

class KernelIsa : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!cpu_isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU (or build) has no " << to_string(GetParam());
    }
  }
  CpuIsa isa() const { return GetParam(); }
};

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

// ---- against torch::optim over several steps -------------------------------------------------

struct TorchCase {
  at::Tensor param;                  // the torch optimizer's parameter
  std::vector<float> p, m, v, vmax;  // the kernel's copies
};

double max_abs_diff(const at::Tensor& t, const std::vector<float>& values) {
  const at::Tensor other = at::from_blob(const_cast<float*>(values.data()), {t.numel()});
  return (t.detach().reshape({-1}) - other).abs().max().item<double>();
}
int64_t bit_differences(const at::Tensor& t, const std::vector<float>& values) {
  const float* a = t.data_ptr<float>();
  int64_t count = 0;
  for (int64_t i = 0; i < t.numel(); ++i) count += bits(a[i]) != bits(values[i]);
  return count;
}

class KernelTorch : public KernelIsa {};

constexpr int64_t kTorchNumel = 1003;  // one partial vector at the end for every ISA
constexpr int kTorchSteps = 10;

// Runs `steps` steps of a torch optimizer `opt` on `param` and of `kernel_step(step, grad)`.
template <class Opt, class KernelStep>
void run_against_torch(Opt& opt, at::Tensor& param, KernelStep&& kernel_step) {
  for (int step = 1; step <= kTorchSteps; ++step) {
    const auto grad = normal(kTorchNumel, 0.3f, 100 + step);
    param.mutable_grad() = at::from_blob(const_cast<float*>(grad.data()), {kTorchNumel}).clone();
    opt.step();
    kernel_step(step, grad);
  }
}

TEST_P(KernelTorch, AdamWAndAdamMatchTorchOptim) {
  struct Config {
    bool decoupled;
    double wd;
    bool amsgrad;
  };
  for (const Config cfg :
       {Config{true, 0.01, false}, Config{true, 0.0, false}, Config{true, 0.1, true},
        Config{false, 0.0, false}, Config{false, 0.05, false}, Config{false, 0.05, true}}) {
    const auto init = normal(kTorchNumel, 1.0f, 42);
    at::Tensor param = at::from_blob(const_cast<float*>(init.data()), {kTorchNumel}).clone();
    param.set_requires_grad(true);
    std::vector<float> p = init, m(kTorchNumel), v(kTorchNumel), vmax(kTorchNumel);
    std::vector<uint16_t> low(kTorchNumel);
    const double lr = 2e-3, b1 = 0.85, b2 = 0.995, eps = 1e-7;
    auto kernel_step = [&](int step, const std::vector<float>& grad) {
      AdamHyper h;
      h.lr = lr, h.beta1 = b1, h.beta2 = b2, h.eps = eps, h.weight_decay = cfg.wd;
      h.decoupled = cfg.decoupled, h.amsgrad = cfg.amsgrad, h.step = step;
      fused_adam(h,
                 {p.data(),
                  grad.data(),
                  m.data(),
                  v.data(),
                  vmax.data(),
                  {LowPrecision::Float16, low.data()},
                  kTorchNumel},
                 isa());
    };
    if (cfg.decoupled) {
      torch::optim::AdamW opt(
          {param},
          torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(cfg.wd).amsgrad(
              cfg.amsgrad));
      run_against_torch(opt, param, kernel_step);
    } else {
      torch::optim::Adam opt(
          {param},
          torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps).weight_decay(cfg.wd).amsgrad(
              cfg.amsgrad));
      run_against_torch(opt, param, kernel_step);
    }
    const std::string name = std::string(cfg.decoupled ? "adamw" : "adam") + "_wd" +
                             std::to_string(cfg.wd) + (cfg.amsgrad ? "_amsgrad" : "");
    SCOPED_TRACE(name);
    EXPECT_LE(max_abs_diff(param, p), 1e-6);
    // Informational: 0 where torch runs its AVX2/AVX-512 kernels (the same FMAs as ours).
    RecordProperty("bit_differences_" + name,
                   static_cast<int>(bit_differences(param.detach(), p)));
    // The fp16 copy is the cast of the fp32 result.
    const at::Tensor want = at::from_blob(p.data(), {kTorchNumel}).to(at::kHalf);
    EXPECT_SAME_BITS(low.data(), static_cast<const uint16_t*>(want.data_ptr()), kTorchNumel,
                     "fp16 copy");
  }
}

TEST_P(KernelTorch, SgdMatchesTorchOptim) {
  struct Config {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const Config cfg :
       {Config{0, 0, 0, false}, Config{0, 0, 1e-2, false}, Config{0.9, 0, 0, false},
        Config{0.9, 0.1, 1e-3, false}, Config{0.9, 0, 1e-3, true}}) {
    const auto init = normal(kTorchNumel, 1.0f, 43);
    at::Tensor param = at::from_blob(const_cast<float*>(init.data()), {kTorchNumel}).clone();
    param.set_requires_grad(true);
    std::vector<float> p = init, buf(kTorchNumel);
    std::vector<uint16_t> low(kTorchNumel);
    const double lr = 0.05;
    torch::optim::SGD opt({param}, torch::optim::SGDOptions(lr)
                                       .momentum(cfg.momentum)
                                       .dampening(cfg.dampening)
                                       .weight_decay(cfg.wd)
                                       .nesterov(cfg.nesterov));
    run_against_torch(opt, param, [&](int step, const std::vector<float>& grad) {
      SgdHyper h;
      h.lr = lr, h.momentum = cfg.momentum, h.dampening = cfg.dampening;
      h.weight_decay = cfg.wd, h.nesterov = cfg.nesterov, h.step = step;
      fused_sgd(
          h, {p.data(), grad.data(), buf.data(), {LowPrecision::BFloat16, low.data()}, kTorchNumel},
          isa());
    });
    SCOPED_TRACE("momentum " + std::to_string(cfg.momentum) + " nesterov " +
                 std::to_string(cfg.nesterov));
    EXPECT_LE(max_abs_diff(param, p), 1e-6);
    const at::Tensor want = at::from_blob(p.data(), {kTorchNumel}).to(at::kBFloat16);
    EXPECT_SAME_BITS(low.data(), static_cast<const uint16_t*>(want.data_ptr()), kTorchNumel,
                     "bf16 copy");
  }
}

// LAMB has no torch::optim class: the reference is the engine's own op sequence
// (src/optimizer.cpp, lamb_update) on one whole parameter.
TEST_P(KernelTorch, LambMatchesEngineOpSequence) {
  for (double wd : {0.0, 0.01}) {
    const auto init = normal(kTorchNumel, 1.0f, 44);
    at::Tensor tp = at::from_blob(const_cast<float*>(init.data()), {kTorchNumel}).clone();
    at::Tensor tm = at::zeros_like(tp), tv = at::zeros_like(tp);
    std::vector<float> p = init, m(kTorchNumel), v(kTorchNumel);
    LambHyper h;
    h.lr = 1e-2, h.weight_decay = wd;
    for (int step = 1; step <= kTorchSteps; ++step) {
      const auto grad = normal(kTorchNumel, 0.3f, 200 + step);
      const at::Tensor g = at::from_blob(const_cast<float*>(grad.data()), {kTorchNumel});
      tm.mul_(h.beta1).add_(g, 1 - h.beta1);
      tv.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
      const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
      const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
      at::Tensor u = (tm / bc1) / ((tv / bc2).sqrt() + h.eps);
      if (wd != 0) u.add_(tp, wd);
      const double wn = tp.norm().item<double>(), un = u.norm().item<double>();
      tp.add_(u, -h.lr * ((wn > 0 && un > 0) ? wn / un : 1.0));

      h.step = step;
      const LambSegment s{p.data(), grad.data(), m.data(), v.data(), {}, kTorchNumel};
      const LambNorms norms = fused_lamb_phase1(h, s, isa());
      EXPECT_NEAR(std::sqrt(norms.param_sq), wn, 1e-5 * wn);
      EXPECT_NEAR(std::sqrt(norms.update_sq), un, 1e-5 * un);
      const double w = std::sqrt(norms.param_sq), uu = std::sqrt(norms.update_sq);
      fused_lamb_phase2(h, (w > 0 && uu > 0) ? w / uu : 1.0, s, isa());
    }
    SCOPED_TRACE("wd " + std::to_string(wd));
    EXPECT_LE(max_abs_diff(tp, p), 1e-6);
    EXPECT_LE(max_abs_diff(tm, m), 1e-6);
    EXPECT_LE(max_abs_diff(tv, v), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelTorch,
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
  try {
    call();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
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
