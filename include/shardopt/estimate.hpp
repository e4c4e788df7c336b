/// \file
/// Analytic memory/communication model of ZeRO stages 0-3 (docs/stages.md), in the spirit
/// of DeepSpeed's estimate_zero2_model_states_mem_needs. Torch-free and header-only: the
/// `shardopt-estimate` tool compiles it without libtorch.
///
///   shardopt::estimate::Options o;
///   o.params = shardopt::estimate::bert_parameter_count("base");   // 110,106,428
///   o.world = 8; o.stage = 2;
///   const auto e = shardopt::estimate::model_states(o);
///   e.device.total(); e.host.total(); e.comm_elements;
///
/// Two accountings of the bytes of model state per rank (Ψ = parameters, padded to a multiple of
/// N·align; N = ranks; P/G = bytes per compute parameter/gradient; K = bytes of optimizer state per
/// parameter, Adam/AdamW 8, SGD with momentum 4, plus the master copy where there is one):
///
/// Accounting::Engine (the default): what shardopt's optimizer allocates, from the same StagePlan
/// and Placement the engine builds (shardopt/detail/plan.hpp), so opt.memory() equals it
/// (tests/dist/estimate_memory_dist_test.cpp: params, gradients and optimizer state exactly;
/// buffers are an upper bound). Parameters are assumed given in fp32, as the engine lays them out.
/// Where the plan buckets gradients (stages 2-3, and every stage under fp16/bf16, offload or a
/// reduce_dtype) the kept gradients are the reduced ones, in the master dtype (fp32) over this
/// rank's update range (Ψ/N sharded, Ψ at stage 0), plus the bucket pool,
/// detail::kBucketPoolBuffers buffers of one bucket each in the reduce dtype (Note [Bucket pool
/// bound] in shardopt/detail/plan.hpp); otherwise (stages 0-1 in fp32) a full flat gradient buffer.
/// Offload puts the master, the state and the reduced gradients on the host.
///
/// Accounting::ZeroPaper: docs/stages.md's table, the ZeRO paper's and DeepSpeed's estimator's
/// model, with gradients in the compute dtype (K includes the master copy under mixed precision):
///
///   stage 0  (P + G + K)·Ψ      stage 1  (P + G)·Ψ + K·Ψ/N
///   stage 2  P·Ψ + (G + K)·Ψ/N  stage 3  (P + G + K)·Ψ/N
///
/// plus bounded buffers: stage 2 the bucket pool (Note [Bucket pool bound]), stage 3 the two
/// largest gathered units with their full gradients, (P + G)·(U1 + U2); Offload::CPU moves the
/// optimizer state (K part) to the host and, for stage >= 2, the gradient shard as fp32. In fp32
/// without offload the two agree. Stage 3 with persistent_params = Ψ_p elements held whole for good
/// (UnitPolicy's persistent groups): parameters P·(Ψ_p + (Ψ - Ψ_p)/N) instead of P·Ψ/N, in both
/// accountings.
///
/// Bucket size: bucket_bytes when > 0; 0 (the default, as ZeroOptions') sizes a bucket as the
/// optimizer does, at most 16 MiB and at most a quarter of the gradient elements sharding frees,
/// Ψ·(N-1)/(4N) (Note [Default bucket size] in shardopt/detail/plan.hpp, the one place the rule
/// lives): the pool's two buffers then cost at most half of what stage 2 saves over stage 1, so in
/// fp32 with default options stage 3 <= stage 2 < stage 1 < stage 0 at N >= 2, stage 3 counted with
/// two gathered units of one bucket each (tests/unit/estimate_test.cpp,
/// DefaultBucketsKeepHigherStagesSmaller). An explicit bucket_bytes is honoured even where it
/// breaks that order.
///
/// Communication per step and rank: 2Ψ elements for stages 0-2 (reduce-scatter + all-gather, or an
/// all-reduce), 3Ψ for stage 3 (an extra all-gather in backward); bytes: gradients travel with G
/// bytes, parameters with P. With ring/pairwise algorithms each rank actually sends (N-1)/N of it
/// (`wire_bytes`).
///
/// Units: every quantity is in bytes; "MB" in the tool and in the tests is 10^6 bytes, the
/// convention of DeepSpeed's estimator and of bench/peers/baseline/torch_zero_bert.py (its
/// 134/112/90 MB for the 11.2M-parameter peer BERT at N = 2 are 12Ψ, 10Ψ, 8Ψ over 10^6; over 2^20
/// they would be 128/107/85).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardopt/detail/names.hpp"
#include "shardopt/detail/partition.hpp"
#include "shardopt/detail/plan.hpp"
#include "shardopt/precision.hpp"
#include "shardopt/sharding.hpp"

namespace shardopt::estimate {

using shardopt::Offload;
using shardopt::Precision;
/// The name of an offload kind: "none" or "cpu".
inline const char* to_string(Offload o) { return shardopt::detail::offload_name(o); }
/// Optimizer state per parameter (fp32 bytes, without the master copy):
/// Adam/AdamW/Lamb 8 (m, v), SGD with momentum 4, Adagrad 4, SGD without momentum 0, Adafactor 4
/// (its factors packed into one element per parameter: Note [Factored state in flat shards] in
/// src/engine/adafactor_update.hpp), AdamW8bit 2 (one byte per moment) plus two fp32 block
/// maxima per 256 parameters (kBlockBytes below; the fp32 moments of parameters under its
/// min_8bit_size, 8 bytes each, are not counted: Note [Blockwise 8-bit state]), Muon 8 (a
/// momentum per element, and AdamW's second moment for the parameters AdamW steps, both held in
/// flat buffers of one element per parameter: Note [Muon over flat shards] in
/// src/engine/muon_update.hpp).
enum class Optimizer { Adam, AdamW, Lamb, SGD, Adagrad, SGDNoMomentum, Adafactor, AdamW8bit, Muon };

/// The name of an optimizer as the CLI spells it ("adamw", "sgd-nomomentum", ...).
inline const char* to_string(Optimizer o) {
  switch (o) {
    case Optimizer::Adam: return "adam";
    case Optimizer::AdamW: return "adamw";
    case Optimizer::Lamb: return "lamb";
    case Optimizer::SGD: return "sgd";
    case Optimizer::Adagrad: return "adagrad";
    case Optimizer::SGDNoMomentum: return "sgd-nomomentum";
    case Optimizer::Adafactor: return "adafactor";
    case Optimizer::AdamW8bit: return "adamw8bit";
    case Optimizer::Muon: return "muon";
  }
  return "?";
}

/// Parses "fp32", "fp16" or "bf16"; throws std::invalid_argument naming them otherwise.
inline Precision parse_precision(const std::string& s) {
  if (const auto p = shardopt::detail::precision_named(s)) return *p;
  throw std::invalid_argument("estimate: unknown precision '" + s + "', expected fp32, fp16 or bf16");
}
/// Parses "none" or "cpu"; throws std::invalid_argument naming them otherwise.
inline Offload parse_offload(const std::string& s) {
  if (const auto o = shardopt::detail::offload_named(s)) return *o;
  throw std::invalid_argument("estimate: unknown offload '" + s + "', expected none or cpu");
}
/// Parses an optimizer name (to_string(Optimizer)); throws std::invalid_argument naming them
/// otherwise.
inline Optimizer parse_optimizer(const std::string& s) {
  for (Optimizer o : {Optimizer::Adam, Optimizer::AdamW, Optimizer::Lamb, Optimizer::SGD,
                      Optimizer::Adagrad, Optimizer::SGDNoMomentum, Optimizer::Adafactor,
                      Optimizer::AdamW8bit, Optimizer::Muon}) {
    if (s == to_string(o)) return o;
  }
  throw std::invalid_argument("estimate: unknown optimizer '" + s +
                              "', expected adam, adamw, lamb, sgd, adagrad, sgd-nomomentum, "
                              "adafactor, adamw8bit or muon");
}

/// Bytes per parameter of the compute copy (P) and of a gradient (G).
inline int param_bytes(Precision p) { return p == Precision::FP32 ? 4 : 2; }
/// G: bytes per gradient element (the compute dtype's).
inline int grad_bytes(Precision p) { return param_bytes(p); }
/// K: optimizer state bytes per parameter, with the fp32 master copy under mixed precision.
inline int state_bytes(Optimizer o, Precision p) {
  int k = 0;
  switch (o) {
    case Optimizer::Adam: case Optimizer::AdamW: case Optimizer::Lamb: case Optimizer::Muon:
      k = 8;
      break;
    case Optimizer::SGD: case Optimizer::Adagrad: case Optimizer::Adafactor: k = 4; break;
    case Optimizer::SGDNoMomentum: k = 0; break;
    case Optimizer::AdamW8bit: k = 2; break;
  }
  return k + (p == Precision::FP32 ? 0 : 4);
}
/// AdamW8bit's fp32 maxima of m and v per 256-parameter block (on top of K); 0 for the others.
inline int64_t block_bytes(Optimizer o, int64_t elements) {
  return o == Optimizer::AdamW8bit ? 8 * ((elements + 255) / 256) : 0;
}

/// Which model to count: the engine's (padding, the bucket pool, gathered units: what
/// DistributedOptimizer::memory() reports) or the ZeRO paper's table verbatim.
enum class Accounting { Engine, ZeroPaper };

/// What to estimate: the model's size, the ranks, the stage, precision, optimizer and buffers.
struct Options {
  Accounting accounting = Accounting::Engine;  ///< Engine (what memory() reports) or ZeroPaper
  int64_t params = 0;  ///< Ψ: trainable parameters (tied ones once)
  int world = 1;       ///< N
  int stage = 2;       ///< 0..3
  /// The compute dtype (fp16/bf16: mixed precision with an fp32 master).
  Precision precision = Precision::FP32;
  Offload offload = Offload::None;  ///< where the optimizer state and fp32 gradient shard live
  /// Engine accounting: ZeroOptions::reduce_dtype and reduce_in_fp32, and whether the model trains
  /// in host memory (a CPU run: offload then moves nothing and needs no separate master).
  Precision reduce_dtype = Precision::FP32;
  /// Mixed precision: reduce gradients in fp32 (ZeroOptions::reduce_in_fp32).
  bool reduce_in_fp32 = true;
  bool params_on_host = false;  ///< the model trains in host memory (a CPU run)
  Optimizer optimizer = Optimizer::AdamW;  ///< the rule, which sets K
  int state_bytes = -1;  ///< overrides K when >= 0 (master copy included)
  int64_t bucket_bytes = 0;  ///< 0: sized from the model (Note [Default bucket size])
  /// ZeroOptions::defer_reduction: bucketed gradients kept in every bucket for the step (the pool
  /// grows to Ψ in the reduce dtype, Note [Deferred reduction]).
  bool defer_reduction = false;
  /// Shard boundaries aligned to this many bytes (ZeroOptions::align_bytes); Ψ is padded to a
  /// multiple of N·align/P elements. 0: no padding (the formulas of docs/stages.md verbatim).
  int64_t align_bytes = 0;
  /// Stage 3: elements of the two largest units gathered at once (the current one and the
  /// prefetched one). 0: two units of one bucket each.
  int64_t gathered_units_params = 0;
  /// Stage 3: elements kept gathered for good (the persistent groups of UnitPolicy: their shard a
  /// view into the whole copy, Note [Persistent parameters] in src/engine/part_store.cpp);
  /// they cost P bytes each, the rest P/N.
  int64_t persistent_params = 0;
  /// Elements of the largest parameter. Buckets split parameters, so it no longer sizes the
  /// bucket buffers (bucket_bytes does); kept so that callers setting it still compile.
  int64_t largest_param = 0;
  /// Count an AsyncCheckpoint's host snapshot (Estimate::checkpoint_snapshot).
  bool async_checkpoint = false;
  /// Count MemorySnapshots' slots (Estimate::snapshot_slots).
  bool memory_snapshots = false;
  bool snapshot_buddy = true;  ///< false: one host, no copies kept for a buddy
  /// The grid's pipeline size (ZeroOptions::grid.pp; `params` are then one rank's stage): above 1,
  /// stages 2-3 defer their reduction and stage 3 holds every unit of the stage gathered through
  /// the step (Note [Pipelines decide two defaults] in shardopt/detail/plan.hpp).
  int pipeline_ranks = 1;
  /// ZeroOptions::reshard_between_uses; unset: the pipeline's default.
  std::optional<bool> reshard_between_uses;
};

/// Bytes of one kind of memory (device or host) per rank.
struct Breakdown {
  int64_t params = 0;  ///< parameters (the compute copy)
  int64_t grads = 0;  ///< gradients kept between backward and step
  int64_t optimizer_state = 0;  ///< optimizer state, with the master copy under mixed precision
  int64_t buffers = 0;  ///< bounded communication buffers: the bucket pool, gathered units
  /// Params + grads + optimizer_state (ZeRO's model state).
  int64_t model_state() const { return params + grads + optimizer_state; }
  int64_t total() const { return model_state() + buffers; }  ///< model state + buffers
};

/// Bytes per rank, where they live, and the communication per step, for one configuration.
struct Estimate {
  Options options;  ///< what was estimated
  int64_t padded_params = 0;  ///< Ψ after padding
  ///@{
  /// P, G and K: the bytes per parameter used.
  int p = 4, g = 4, k = 8;
  ///@}
  Breakdown device;           ///< the accelerator (the compute device; on a CPU build: the process)
  Breakdown host;             ///< CPU memory for offloaded state (zero without offload)
  int64_t comm_elements = 0;  ///< per step and rank: 2Ψ (stages 0-2), 3Ψ (stage 3)
  int64_t comm_bytes = 0;     ///< those elements at their dtype's size
  int64_t wire_bytes = 0;     ///< what a rank actually sends with ring/pairwise algorithms
  int64_t gathered_units_params = 0;  ///< stage 3: the unit elements assumed gathered at once
  int64_t persistent_params = 0;      ///< stage 3: the elements held whole for good
  /// Options::async_checkpoint: host bytes of AsyncCheckpoint's snapshot, this rank's slice of
  /// the master parameters and of every optimizer state buffer (Note [Asynchronous saves]),
  /// allocated by the first save and kept; what AsyncCheckpoint::snapshot_bytes() reports.
  int64_t checkpoint_snapshot = 0;
  /// Options::memory_snapshots: host memory (tmpfs) of MemorySnapshots' slots for this rank: two
  /// of its own and two it keeps for another rank (none without a buddy), each this rank's slice
  /// of the master parameters and of every optimizer state buffer plus a 64-byte prefix (Note
  /// [Snapshots in memory]); what MemorySnapshots::host_bytes() reports.
  int64_t snapshot_slots = 0;
  /// Device and host, everything (the checkpoint snapshot and the snapshot slots included).
  int64_t total() const {
    return device.total() + host.total() + checkpoint_snapshot + snapshot_slots;
  }
  /// Device and host, model state only.
  int64_t model_state() const { return device.model_state() + host.model_state(); }
};

namespace detail_estimate {

/// Elements of an n-way shard of `numel` (the largest rank's when uneven).
inline int64_t shard_of(int64_t numel, int64_t n) { return (numel + n - 1) / n; }

/// docs/stages.md's table (Accounting::ZeroPaper).
inline void zero_paper(const Options& o, Estimate& e, int64_t psi, int64_t shard) {
  const int64_t p = e.p, g = e.g, k = e.k;
  Breakdown dev, host;
  switch (o.stage) {
    case 0: dev.params = p * psi; dev.grads = g * psi; dev.optimizer_state = k * psi; break;
    case 1: dev.params = p * psi; dev.grads = g * psi; dev.optimizer_state = k * shard; break;
    case 2: dev.params = p * psi; dev.grads = g * shard; dev.optimizer_state = k * shard; break;
    case 3:
      dev.params = p * (e.persistent_params + shard_of(psi - e.persistent_params, o.world));
      dev.grads = g * shard; dev.optimizer_state = k * shard; break;
  }
  if (o.state_bytes < 0) dev.optimizer_state += block_bytes(o.optimizer, o.stage == 0 ? psi : shard);
  // Bounded buffers.
  if (o.stage == 2) {
    // The bucket pool (Note [Bucket pool bound]), never more than the whole gradient (a parameter
    // may span buckets, so no buffer is sized by the largest parameter).
    const int64_t bucket = detail::bucket_numel(o.bucket_bytes, o.params, o.world, g);
    dev.buffers = g * std::min(detail::kBucketPoolBuffers * bucket, psi);
  } else if (o.stage == 3) {
    dev.buffers = (p + g) * e.gathered_units_params;
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
}

/// What the engine allocates (Accounting::Engine), from its StagePlan and Placement.
inline void engine(const Options& o, const shardopt::detail::StagePlan& plan,
                   const shardopt::detail::Placement& place, int given, Estimate& e, int64_t psi,
                   int64_t shard) {
  const int64_t p = e.p, master = bytes_of(place.master, given);
  const int64_t reduce = bytes_of(place.reduce, given);
  const int64_t update = plan.sharded() ? shard : psi;  // elements this rank updates
  Breakdown dev, host;
  Breakdown& on_master = place.master_on_host ? host : dev;
  dev.params = p * (plan.per_part()
                        ? e.persistent_params + shard_of(psi - e.persistent_params, o.world)
                        : psi);
  on_master.optimizer_state =
      e.k * update + (o.state_bytes < 0 ? block_bytes(o.optimizer, update) : 0);
  if (plan.bucketed()) {
    on_master.grads = master * update;  // reduced gradients
    const int64_t bucket = detail::bucket_numel(o.bucket_bytes, o.params, o.world, given);
    // The bucket pool; deferred, every bucket (padded like the flat layout: Ψ).
    dev.buffers = reduce * (plan.accumulates_in_buckets()
                                ? psi
                                : std::min(detail::kBucketPoolBuffers * bucket, psi));
    if (place.pinned) host.buffers = reduce * std::min(bucket, psi);  // offload's staging
  } else {
    dev.grads = reduce * psi;  // the flat gradient buffer, reduced in place
  }
  // Stage 3: the gathered units and their gradients in the compute dtype.
  if (plan.per_part()) dev.buffers += 2 * p * e.gathered_units_params;
  e.device = dev;
  e.host = host;
}

}  // namespace detail_estimate

/// Estimates one configuration; throws std::invalid_argument on invalid options.
inline Estimate model_states(const Options& o) {
  if (o.params < 0) throw std::invalid_argument("estimate: params must be >= 0");
  if (o.world < 1) throw std::invalid_argument("estimate: world must be >= 1");
  if (o.pipeline_ranks < 1) throw std::invalid_argument("estimate: pipeline_ranks must be >= 1");
  if (o.stage < 0 || o.stage > 3) throw std::invalid_argument("estimate: stage must be 0..3");
  if (o.bucket_bytes < 0 || o.align_bytes < 0 || o.gathered_units_params < 0 ||
      o.largest_param < 0 || o.persistent_params < 0 || o.persistent_params > o.params) {
    throw std::invalid_argument(
        "estimate: bucket_bytes, align_bytes, gathered_units_params, largest_param >= 0, "
        "0 <= persistent_params <= params");
  }
  using shardopt::detail::Placement;
  using shardopt::detail::StagePlan;
  const bool paper = o.accounting == Accounting::ZeroPaper;
  StagePlan plan = StagePlan::make(static_cast<Stage>(o.stage), o.precision, o.offload,
                                   o.params_on_host, o.reduce_dtype != Precision::FP32);
  plan.defer_reduction = detail::defers_reduction(o.defer_reduction, o.pipeline_ranks);
  const Placement place =
      Placement::make(plan, o.precision, o.reduce_dtype, o.reduce_in_fp32, o.params_on_host);
  const int given = 4;  // the engine's layout counts in the parameters' own (fp32) elements
  Estimate e;
  e.options = o;
  e.p = bytes_of(place.model, given);
  e.g = paper ? e.p : bytes_of(plan.bucketed() ? place.master : place.reduce, given);
  if (o.state_bytes >= 0) {
    e.k = o.state_bytes;
  } else if (paper) {
    e.k = state_bytes(o.optimizer, o.precision);
  } else {
    e.k = state_bytes(o.optimizer, Precision::FP32) +
          (plan.separate_master() ? bytes_of(place.master, given) : 0);
  }
  const int64_t n = o.world;
  const int64_t align_numel = std::max<int64_t>(1, o.align_bytes / (paper ? e.p : given));
  const int64_t psi = o.align_bytes > 0 ? detail::round_up(o.params, n * align_numel) : o.params;
  e.padded_params = psi;
  // Exact 1/N for the padded case; otherwise the exact rational value rounded up (uneven shards:
  // the largest rank holds ceil(Ψ/N)).
  const int64_t shard = (psi + n - 1) / n;
  if (o.stage == 3) {
    int64_t units = o.gathered_units_params;
    if (units == 0) units = 2 * detail::bucket_numel(o.bucket_bytes, o.params, o.world, e.p);
    // Held through the step, every unit this rank runs is whole at once.
    if (detail::holds_parts_through_step(o.reshard_between_uses, o.pipeline_ranks)) {
      units = psi - o.persistent_params;
    }
    e.gathered_units_params = std::min(units, psi);
    e.persistent_params = o.persistent_params;
  }
  if (paper) {
    detail_estimate::zero_paper(o, e, psi, shard);
  } else {
    detail_estimate::engine(o, plan, place, given, e, psi, shard);
  }

  if (o.async_checkpoint || o.memory_snapshots) {
    // Every rank snapshots its 1/N of the flat layout at every stage (a checkpoint is sharded
    // where the step is not), for the master copy and each state buffer in the master's dtype.
    const int64_t master = bytes_of(place.master, given);
    const int64_t state = o.state_bytes >= 0 ? e.k - (plan.separate_master() ? master : 0)
                                             : state_bytes(o.optimizer, Precision::FP32);
    const int64_t slice = (master + state) * shard;
    if (o.async_checkpoint) e.checkpoint_snapshot = slice;
    // MemorySnapshots: two slots of its own and two for a buddy, each with a 64-byte prefix.
    if (o.memory_snapshots) e.snapshot_slots = (o.snapshot_buddy ? 4 : 2) * (slice + 64);
  }
  e.comm_elements = (o.stage == 3 ? 3 : 2) * psi;
  // Gradients: one reduce-scatter (or all-reduce) in the reduce dtype; parameters: all-gathers
  // in P bytes.
  const int64_t wire_g = paper ? e.g : bytes_of(place.reduce, given);
  e.comm_bytes = wire_g * psi + (o.stage == 3 ? 2 : 1) * e.p * psi;
  e.wire_bytes = n == 1 ? 0 : e.comm_bytes / n * (n - 1);
  return e;
}

// ---- BERT parameter count ------------------------------------------------------------------------

/// A BERT shape, enough to count its parameters (Hugging Face's BertConfig names).
struct BertConfig {
  int64_t vocab = 30522;  ///< vocabulary size V
  int64_t hidden = 768;  ///< hidden size h
  int64_t layers = 12;  ///< encoder layers
  int64_t heads = 12;  ///< does not change the count (Q, K, V are h x h whatever the split)
  int64_t intermediate = 3072;  ///< feed-forward size I
  int64_t max_positions = 512;  ///< position embeddings
  int64_t type_vocab = 2;  ///< token types (segments)
  bool pooler = true;    ///< dense h x h + tanh on [CLS]
  bool nsp_head = true;  ///< next-sentence classifier h x 2
  bool tied_decoder = true;  ///< MLM decoder weight shared with the word embeddings
};

/// The BERT presets, the one table the estimator and examples/bert share: layers, hidden size,
/// heads, intermediate size; vocab 30522, 512 positions, 2 types. `heads_for_pretraining`: the
/// pooler and NSP head (peer: the PyTorch peer baseline's model, mini's shape, MLM only).
struct BertPreset {
  const char* name;  ///< the preset's name (`--preset`)
  ///@{
  /// Layers, hidden size, heads and intermediate size.
  int64_t layers, hidden, heads, intermediate;
  ///@}
  bool heads_for_pretraining;  ///< with the pooler and NSP head
};
/// The presets: tiny, mini, small, base, large and peer.
inline constexpr BertPreset kBertPresets[] = {
    {"tiny", 2, 128, 2, 512, true},       {"mini", 4, 256, 4, 1024, true},
    {"small", 4, 512, 8, 2048, true},     {"base", 12, 768, 12, 3072, true},
    {"large", 24, 1024, 16, 4096, true},  {"peer", 4, 256, 4, 1024, false},
};

/// The preset called `name`; throws std::invalid_argument naming the presets otherwise.
inline const BertPreset& find_bert_preset(const std::string& name) {
  for (const auto& p : kBertPresets) {
    if (name == p.name) return p;
  }
  std::string names;
  for (const auto& p : kBertPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  throw std::invalid_argument("unknown BERT preset '" + name + "', expected one of " + names);
}

/// The BertConfig of a preset; throws std::invalid_argument naming the presets otherwise.
inline BertConfig bert_preset(const std::string& name) {
  const BertPreset& p = find_bert_preset(name);
  BertConfig c;
  c.layers = p.layers, c.hidden = p.hidden, c.heads = p.heads, c.intermediate = p.intermediate;
  c.pooler = c.nsp_head = p.heads_for_pretraining;
  return c;
}

/// Parameters of each part of BERT for pretraining (HF BertForPreTraining):
///   embeddings   V·h + pos·h + types·h + 2h (LayerNorm)
///   layer        4(h² + h) (Q, K, V, output) + 2h (LayerNorm) + (h·I + I) + (I·h + h)
///                + 2h (LayerNorm)
///                = 4h² + 2hI + 9h + I
///   pooler       h² + h
///   MLM head     h² + h (transform) + 2h (LayerNorm) + V (decoder bias) [+ V·h when not tied]
///   NSP head     2h + 2
struct BertCounts {
  int64_t embeddings = 0;  ///< word, position and type embeddings with their LayerNorm
  int64_t layer = 0;  ///< one encoder layer
  int64_t layers = 0;  ///< all encoder layers
  int64_t pooler = 0;  ///< the pooler (0 without it)
  /// The MLM head (transform, LayerNorm, decoder bias; decoder weight when untied).
  int64_t mlm_head = 0;
  int64_t nsp_head = 0;  ///< the NSP head (0 without it)
  /// Every parameter, tied decoder once.
  int64_t total() const { return embeddings + layers + pooler + mlm_head + nsp_head; }
  /// Stage 3 units (embeddings, each layer, the heads together): elements of the two largest.
  int64_t two_largest_units(int64_t num_layers) const {
    std::vector<int64_t> u{embeddings, pooler + mlm_head + nsp_head};
    for (int64_t i = 0; i < std::min<int64_t>(num_layers, 2); ++i) u.push_back(layer);
    std::sort(u.rbegin(), u.rend());
    return u.size() >= 2 ? u[0] + u[1] : u[0];
  }
};

/// Parameters of each part of a BERT of this shape.
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

/// Ψ of a BERT of this shape.
inline int64_t bert_parameter_count(const BertConfig& c) { return bert_counts(c).total(); }
/// Ψ of a preset.
inline int64_t bert_parameter_count(const std::string& preset) {
  return bert_parameter_count(bert_preset(preset));
}

}  // namespace shardopt::estimate
