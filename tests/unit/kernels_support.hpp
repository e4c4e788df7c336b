// Shared by the fused-kernel tests: deterministic data, the independent scalar references
// (torch 1.13's op sequence, written out) and the fixture that runs a test per instruction set.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

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


}  // namespace
}  // namespace shardopt::detail::kernels
