// The fused CPU kernel of 8-bit AdamW (rules.hpp: AdamW8bit): one pass per 256-element block that
// reads the one-byte codes of both moments, dequantises them with the block's absolute maxima,
// steps the parameter, and writes the moments back quantised with the block's new maxima.
// Torch-free apart from the thread pool; the engine calls it per parameter piece.
//
// Note [Dynamic 8-bit map]
// The moments are stored as bytes indexing bitsandbytes' dynamic maps (create_dynamic_map): seven
// decades i = 0..6 of equally spaced codes 10^(i-6) * (0.1 + (k + 0.5) * 0.9 / n_i), k < n_i,
// with n_i = 2^i for the signed map (first moment, plus zero and 1.0: 256 values) and 2^(i+1) for
// the unsigned one (second moment, plus zero and 1.0). A code's value is computed in float as
// (0.1 + (k + 0.5) * float(0.9 / n_i)) * float(10^(i-6)), so the AVX-512 kernel derives it from
// the byte without a table and the VBMI one reads these floats (bitsandbytes rounds its float32
// linspace instead: values may differ in the last bits). Bytes:
// unsigned 0 = 0, 1 + base_i + k = code (base_i = 2^(i+1) - 2), 255 = 1.0; signed sign bit | 
// magnitude index (0 = zero, 1 + 2^i - 1 + k = code), with 0x80 (negative zero) holding +1.0, as
// bitsandbytes' signed map has +1.0 and no -1.0. A value x of a block with maximum |x| = a is
// stored as the code nearest x / a, found arithmetically (no table search): the decade from six
// threshold comparisons, the code inside it as floor((|y| * 10^(6-d) - 0.1) * n_d / 0.9), one
// comparison with the midpoint to the decade below, one with the midpoint to 1.0. These are a
// fixed sequence of float operations, the same in the scalar and AVX-512 code, so the result does
// not depend on the ISA (in the last bit near a midpoint it may pick the second nearest code).
//
// Note [Fast 8-bit kernel]
// On AVX-512 VBMI (Zen 4, Ice Lake and later) the kernel computes the same bytes and floats as
// block_scalar with fewer instructions (the first AVX-512 kernel spent ~130 vector operations per
// 16 elements and ran at half the fp32 AdamW's speed). Dequantisation is a table lookup: the
// four bytes of each code's float come from four 256-byte planes with vpermi2b, 64 codes per
// instruction, and are interleaved back into floats. Quantisation replaces the decade search,
// the "- 1" below a decade's first midpoint and the top test with regions: region 0 is below the
// first midpoint, region 1 + d starts at decade d's below_mid (so the "- 1" never applies inside
// it) and the last starts above top_mid; inside a region the byte is base + min(floor(t), last)
// with quantize_scalar's own t = (|y| * scale_d - 0.1) * per_unit_d, so the same rounding. The
// region is read from a 32-entry table by the float's exponent (each binade holds at most one
// region boundary; checked when the table is built) plus one comparison of the float's bits
// with that boundary. This equals quantize_scalar for every float of (-2, 2) (all of them were
// checked when it was written; tests/unit/adam8bit_kernel_test.cpp checks both sides of every
// code boundary and of every power of two). quantize_scalar is not monotone beyond |y| ~ 1.5e7
// (its int conversion overflows): such y, and NaN, come only from a non-finite moment or a
// subnormal maximum, and a block with one goes through quantize_scalar, so the kernel equals
// block_scalar on every input (NaN included; the arithmetic AVX-512 kernel, still used where
// VBMI is missing, takes its maxima in another order and differs from it when a moment is NaN).
#pragma once

#include <cstdint>

#include "kernels/fused.hpp"  // CpuIsa

namespace shardopt::detail::kernels {

constexpr int64_t kQuantBlock = 256;  // elements per block (one absmax per moment)

struct Adam8bitHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled: p *= 1 - lr*wd
  int64_t step = 1;           // 1-based, already incremented
};

// `numel` elements in blocks of kQuantBlock from `param`'s first (the last one may be short);
// absmax1/absmax2 hold one float per block. Step 1 expects zero codes and maxima (zero moments).
struct Adam8bitSegment {
  float* param = nullptr;
  const float* grad = nullptr;
  uint8_t* state1 = nullptr;  // first moment's codes (signed map)
  uint8_t* state2 = nullptr;  // second moment's codes (unsigned map)
  float* absmax1 = nullptr;
  float* absmax2 = nullptr;
  int64_t numel = 0;
};

// The 256 values of the signed (first moment) or unsigned (second moment) map, by byte.
const float* dynamic_map(bool is_signed);
// The byte the kernels store for y (|y| <= 1: a value divided by its block's maximum).
uint8_t quantize_dynamic(float y, bool is_signed);
// quantize_dynamic over n values with the kernel's quantiser for `isa` (tests: the AVX-512 VBMI
// one takes y of (-2, 2) for the signed map and of [+0, 2) for the unsigned one, the values its
// blocks meet, and throws InvalidArgument on others).
void quantize_dynamic_n(const float* y, uint8_t* out, int64_t n, bool is_signed,
                        CpuIsa isa = CpuIsa::Auto);

// The per-element update both the kernels and the fp32 path of small parameters perform, on
// floats, in this order: p *= decay; m = m*b1 + g*(1-b1); v = v*b2 + (g*g)*(1-b2);
// p += (neg_step_size * m) / (sqrt(v) * inv_sqrt_bc2 + eps), inv_sqrt_bc2 = float(1/sqrt(bc2)).
struct Adam8bitCoeffs {
  float decay = 1, beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float inv_sqrt_bc2 = 1, eps = 0, neg_step_size = 0;
};
Adam8bitCoeffs adam8bit_coeffs(const Adam8bitHyper& h);

// Tests: whether the AVX-512 VBMI kernel runs where the CPU has it (the default); false runs the
// arithmetic AVX-512 kernel there instead. Not for use while a step runs.
void allow_adam8bit_vbmi(bool allowed);

// Multi-threaded over blocks (results do not depend on the thread count or the ISA).
void fused_adam8bit(const Adam8bitHyper& hyper, const Adam8bitSegment& segment,
                    CpuIsa isa = CpuIsa::Auto);
// fp32 moments (parameters under min_8bit_size), the same arithmetic without quantisation.
void adam8bit_fp32(const Adam8bitHyper& hyper, float* param, const float* grad, float* exp_avg,
                   float* exp_avg_sq, int64_t numel);

}  // namespace shardopt::detail::kernels
