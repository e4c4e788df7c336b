// Analytic memory/communication model of ZeRO stages 0-3 (DESIGN.md "Memory model"), in the spirit
// of DeepSpeed's estimate_zero2_model_states_mem_needs. Torch-free and header-only: the
// `shardopt-estimate` tool compiles it without libtorch.
//
//   shardopt::estimate::Options o;
//   o.params = shardopt::estimate::bert_parameter_count("base");   // 110,106,428
//   o.world = 8; o.stage = 2;
//   const auto e = shardopt::estimate::model_states(o);
//   e.device.total(); e.host.total(); e.comm_elements;
//
// Bytes of model state per rank, Ψ = parameters (padded to a multiple of N·align), N = ranks,
// P/G = bytes per compute parameter/gradient (fp32: 4/4, fp16/bf16: 2/2), K = bytes of optimizer
// state per parameter (Adam/AdamW 8, SGD with momentum 4, +4 for the fp32 master copy under mixed
// precision):
//
//   stage 0  (P + G + K)·Ψ      stage 1  (P + G)·Ψ + K·Ψ/N
//   stage 2  P·Ψ + (G + K)·Ψ/N  stage 3  (P + G + K)·Ψ/N
//
// plus bounded buffers: stage 2 keeps at most two bucket buffers of bucket_bytes (buckets split
// parameters, so no buffer is sized by the largest one; never more than the whole gradient;
// bucket_bytes 0 sizes them as the optimizer does, Note [Default bucket size] in
// shardopt/detail/partition.hpp, so that stage 2 never holds more than stage 1);
// stage 3 holds the two largest gathered units with their full gradients,
// (P + G)·(U1 + U2). Stages 0-1 reduce in place in the flat gradient buffer (no extra buffer),
// as shardopt's optimizer does (tests/dist/stages_dist_test.cpp, StageMemory).
//
// Offload::CPU moves the optimizer state (K part) to the host and, for stage >= 2, the gradient
// shard as fp32 (4·Ψ/N on the host, none kept on the device besides the bucket buffers).
//
// Communication per step and rank: 2Ψ elements for stages 0-2 (reduce-scatter + all-gather, or an
// all-reduce), 3Ψ for stage 3 (an extra all-gather in backward); bytes: gradients travel with G
// bytes, parameters with P. With ring/pairwise algorithms each rank actually sends (N-1)/N of it
// (`wire_bytes`).
//
// Units: every quantity is in bytes; "MB" in the tool and in the tests is 10^6 bytes, the
// convention of DeepSpeed's estimator and of /work/shared/peers/torch_zero_bert.py (its 134/112/90
// MB for the 11.2M-parameter peer BERT at N = 2 are 12Ψ, 10Ψ, 8Ψ over 10^6; over 2^20 they would
// be 128/107/85).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardopt/detail/partition.hpp"

namespace shardopt::estimate {

// Mirrors shardopt::Precision / shardopt::Offload of options.hpp, which is not torch-free.
enum class Precision { FP32, FP16, BF16 };
enum class Offload { None, CPU };
// Optimizer state per parameter (fp32 bytes, without the master copy):
// Adam/AdamW/Lamb 8 (m, v), SGD with momentum 4, Adagrad 4, SGD without momentum 0.
enum class Optimizer { Adam, AdamW, Lamb, SGD, Adagrad, SGDNoMomentum };

inline const char* to_string(Precision p) {
  switch (p) {
    case Precision::FP32: return "fp32";
    case Precision::FP16: return "fp16";
    case Precision::BF16: return "bf16";
  }
  return "?";
}
inline const char* to_string(Offload o) { return o == Offload::CPU ? "cpu" : "none"; }
inline const char* to_string(Optimizer o) {
  switch (o) {
    case Optimizer::Adam: return "adam";
    case Optimizer::AdamW: return "adamw";
    case Optimizer::Lamb: return "lamb";
    case Optimizer::SGD: return "sgd";
    case Optimizer::Adagrad: return "adagrad";
    case Optimizer::SGDNoMomentum: return "sgd-nomomentum";
  }
  return "?";
}

inline Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "fp16") return Precision::FP16;
  if (s == "bf16") return Precision::BF16;
  throw std::invalid_argument("estimate: unknown precision '" + s + "', expected fp32, fp16 or bf16");
}
inline Offload parse_offload(const std::string& s) {
  if (s == "none") return Offload::None;
  if (s == "cpu") return Offload::CPU;
  throw std::invalid_argument("estimate: unknown offload '" + s + "', expected none or cpu");
}
inline Optimizer parse_optimizer(const std::string& s) {
  for (Optimizer o : {Optimizer::Adam, Optimizer::AdamW, Optimizer::Lamb, Optimizer::SGD,
                      Optimizer::Adagrad, Optimizer::SGDNoMomentum}) {
    if (s == to_string(o)) return o;
  }
  throw std::invalid_argument("estimate: unknown optimizer '" + s +
                              "', expected adam, adamw, lamb, sgd, adagrad or sgd-nomomentum");
}

// Bytes per parameter of the compute copy (P) and of a gradient (G).
inline int param_bytes(Precision p) { return p == Precision::FP32 ? 4 : 2; }
inline int grad_bytes(Precision p) { return param_bytes(p); }
// K: optimizer state bytes per parameter, with the fp32 master copy under mixed precision.
inline int state_bytes(Optimizer o, Precision p) {
  int k = 0;
  switch (o) {
    case Optimizer::Adam: case Optimizer::AdamW: case Optimizer::Lamb: k = 8; break;
    case Optimizer::SGD: case Optimizer::Adagrad: k = 4; break;
    case Optimizer::SGDNoMomentum: k = 0; break;
  }
  return k + (p == Precision::FP32 ? 0 : 4);
}

struct Options {
  int64_t params = 0;  // Ψ: trainable parameters (tied ones once)
  int world = 1;       // N
  int stage = 2;       // 0..3
  Precision precision = Precision::FP32;
  Offload offload = Offload::None;
  Optimizer optimizer = Optimizer::AdamW;
  int state_bytes = -1;  // overrides K when >= 0 (master copy included)
  int64_t bucket_bytes = 0;  // 0: ZeroOptions' default rule (Note [Default bucket size])
  // Shard boundaries aligned to this many bytes (ZeroOptions::align_bytes); Ψ is padded to a
  // multiple of N·align/P elements. 0: no padding (the DESIGN.md formulas verbatim).
  int64_t align_bytes = 0;
  // Stage 3: elements of the two largest units gathered at once (the current one and the
  // prefetched one). 0: two units of one bucket each.
  int64_t gathered_units_params = 0;
  // Elements of the largest parameter. Buckets split parameters, so it no longer sizes the
  // bucket buffers (bucket_bytes does); kept so that callers setting it still compile.
  int64_t largest_param = 0;
};

// Bytes of one kind of memory (device or host) per rank.
struct Breakdown {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer_state = 0;
  int64_t buffers = 0;
  int64_t model_state() const { return params + grads + optimizer_state; }
  int64_t total() const { return model_state() + buffers; }
};

struct Estimate {
  Options options;
  int64_t padded_params = 0;  // Ψ after padding
  int p = 4, g = 4, k = 8;    // the bytes per parameter used
  Breakdown device;           // the accelerator (the compute device; on a CPU build: the process)
  Breakdown host;             // CPU memory for offloaded state (zero without offload)
  int64_t comm_elements = 0;  // per step and rank: 2Ψ (stages 0-2), 3Ψ (stage 3)
  int64_t comm_bytes = 0;     // those elements at their dtype's size
  int64_t wire_bytes = 0;     // what a rank actually sends with ring/pairwise algorithms
  int64_t gathered_units_params = 0;  // stage 3: the unit elements assumed gathered at once
  int64_t total() const { return device.total() + host.total(); }
  int64_t model_state() const { return device.model_state() + host.model_state(); }
};

inline Estimate model_states(const Options& o) {
  if (o.params < 0) throw std::invalid_argument("estimate: params must be >= 0");
  if (o.world < 1) throw std::invalid_argument("estimate: world must be >= 1");
  if (o.stage < 0 || o.stage > 3) throw std::invalid_argument("estimate: stage must be 0..3");
  if (o.bucket_bytes < 0 || o.align_bytes < 0 || o.gathered_units_params < 0 ||
      o.largest_param < 0) {
    throw std::invalid_argument(
        "estimate: bucket_bytes, align_bytes, gathered_units_params, largest_param >= 0");
  }
  Estimate e;
  e.options = o;
  e.p = param_bytes(o.precision);
  e.g = grad_bytes(o.precision);
  e.k = o.state_bytes >= 0 ? o.state_bytes : state_bytes(o.optimizer, o.precision);
  const int64_t n = o.world;
  const int64_t align_numel = std::max<int64_t>(1, o.align_bytes / e.p);
  const int64_t psi = o.align_bytes > 0 ? detail::round_up(o.params, n * align_numel) : o.params;
  e.padded_params = psi;
  // Exact 1/N for the padded case; otherwise the exact rational value rounded up (uneven shards:
  // the largest rank holds ceil(Ψ/N)).
  const int64_t shard = (psi + n - 1) / n;
  const int64_t p = e.p, g = e.g, k = e.k;

  Breakdown dev, host;
  switch (o.stage) {
    case 0: dev.params = p * psi; dev.grads = g * psi; dev.optimizer_state = k * psi; break;
    case 1: dev.params = p * psi; dev.grads = g * psi; dev.optimizer_state = k * shard; break;
    case 2: dev.params = p * psi; dev.grads = g * shard; dev.optimizer_state = k * shard; break;
    case 3: dev.params = p * shard; dev.grads = g * shard; dev.optimizer_state = k * shard; break;
  }
  // Bounded buffers, in buckets of the optimizer's size.
  const int64_t bucket = p * detail::bucket_numel_for(o.bucket_bytes, psi, o.world, p);
  if (o.stage == 2) {
    // Two pooled bucket buffers, never more than the whole gradient (a parameter may span
    // buckets, so no buffer is sized by the largest parameter).
    dev.buffers = std::min<int64_t>(2 * bucket, g * psi);
  } else if (o.stage == 3) {
    int64_t units = o.gathered_units_params;
    if (units == 0) units = 2 * std::max<int64_t>(1, bucket / p);
    units = std::min(units, psi);
    e.gathered_units_params = units;
    dev.buffers = (p + g) * units;
  }
  if (o.offload == Offload::CPU) {
    host.optimizer_state = dev.optimizer_state;
    dev.optimizer_state = 0;
    if (o.stage >= 2) {
      host.grads = 4 * shard;  // fp32 gradient shard for the host optimizer
      dev.grads = 0;
    }
  }
  e.device = dev;
  e.host = host;

  e.comm_elements = (o.stage == 3 ? 3 : 2) * psi;
  // Gradients: one reduce-scatter (or all-reduce) in G bytes; parameters: all-gathers in P bytes.
  e.comm_bytes = g * psi + (o.stage == 3 ? 2 : 1) * p * psi;
  e.wire_bytes = n == 1 ? 0 : e.comm_bytes / n * (n - 1);
  return e;
}

// ---- BERT parameter count ------------------------------------------------------------------------

struct BertConfig {
  int64_t vocab = 30522;
  int64_t hidden = 768;
  int64_t layers = 12;
  int64_t heads = 12;  // does not change the count (Q, K, V are h x h whatever the split)
  int64_t intermediate = 3072;
  int64_t max_positions = 512;
  int64_t type_vocab = 2;
  bool pooler = true;    // dense h x h + tanh on [CLS]
  bool nsp_head = true;  // next-sentence classifier h x 2
  bool tied_decoder = true;  // MLM decoder weight shared with the word embeddings
};

// tiny 2/128/2/512, mini 4/256/4/1024, small 4/512/8/2048, base 12/768/12/3072,
// large 24/1024/16/4096 (layers/hidden/heads/intermediate); vocab 30522, 512 positions, 2 types.
// peer: the PyTorch peer baseline's model, mini's shape without pooler and NSP head (MLM only).
inline BertConfig bert_preset(const std::string& name) {
  BertConfig c;
  auto set = [&](int64_t l, int64_t h, int64_t a, int64_t i) {
    c.layers = l, c.hidden = h, c.heads = a, c.intermediate = i;
  };
  if (name == "tiny") set(2, 128, 2, 512);
  else if (name == "mini") set(4, 256, 4, 1024);
  else if (name == "small") set(4, 512, 8, 2048);
  else if (name == "base") set(12, 768, 12, 3072);
  else if (name == "large") set(24, 1024, 16, 4096);
  else if (name == "peer") {
    set(4, 256, 4, 1024);
    c.pooler = false;
    c.nsp_head = false;
  }
  else throw std::invalid_argument("estimate: unknown BERT preset '" + name +
                                   "', expected tiny, mini, small, base, large or peer");
  return c;
}

// Parameters of each part of BERT for pretraining (HF BertForPreTraining):
//   embeddings   V·h + pos·h + types·h + 2h (LayerNorm)
//   layer        4(h² + h) (Q, K, V, output) + 2h (LayerNorm) + (h·I + I) + (I·h + h) + 2h (LayerNorm)
//                = 4h² + 2hI + 9h + I
//   pooler       h² + h
//   MLM head     h² + h (transform) + 2h (LayerNorm) + V (decoder bias) [+ V·h when not tied]
//   NSP head     2h + 2
struct BertCounts {
  int64_t embeddings = 0;
  int64_t layer = 0;  // one encoder layer
  int64_t layers = 0;
  int64_t pooler = 0;
  int64_t mlm_head = 0;
  int64_t nsp_head = 0;
  int64_t total() const { return embeddings + layers + pooler + mlm_head + nsp_head; }
  // Stage 3 units (embeddings, each layer, the heads together): elements of the two largest.
  int64_t two_largest_units(int64_t num_layers) const {
    std::vector<int64_t> u{embeddings, pooler + mlm_head + nsp_head};
    for (int64_t i = 0; i < std::min<int64_t>(num_layers, 2); ++i) u.push_back(layer);
    std::sort(u.rbegin(), u.rend());
    return u.size() >= 2 ? u[0] + u[1] : u[0];
  }
};

inline BertCounts bert_counts(const BertConfig& c) {
  const int64_t h = c.hidden, v = c.vocab, i = c.intermediate;
  BertCounts n;
  n.embeddings = v * h + c.max_positions * h + c.type_vocab * h + 2 * h;
  n.layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h;
  n.layers = c.layers * n.layer;
  n.pooler = c.pooler ? h * h + h : 0;
  n.mlm_head = h * h + h + 2 * h + v + (c.tied_decoder ? 0 : v * h);
  n.nsp_head = c.nsp_head ? 2 * h + 2 : 0;
  return n;
}

inline int64_t bert_parameter_count(const BertConfig& c) { return bert_counts(c).total(); }
inline int64_t bert_parameter_count(const std::string& preset) {
  return bert_parameter_count(bert_preset(preset));
}

}  // namespace shardopt::estimate
