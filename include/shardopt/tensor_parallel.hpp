/// \file
/// Tensor parallelism (Megatron-LM's split layers, Shoeybi et al. 2019) for libtorch: linear layers
/// and an embedding whose weights are split over a tensor-parallel group, the collectives between
/// them as autograd functions (ours: libtorch 1.13 has none, 2.x no differentiable all-reduce),
/// the cross entropy over a vocabulary split across ranks, optional sequence parallelism
/// (Korthikanti et al. 2022) and the dropout streams of split regions.
///
/// Note [Split regions]
/// A transformer layer is two pairs: a ColumnParallelLinear (QKV; the first MLP matrix), whose
/// output features are split, so each rank holds a/t whole heads or f/t intermediate features, and
/// a RowParallelLinear (attention output; second MLP matrix), whose input features are split and
/// whose partial sums are all-reduced. Between them everything is local. At the region's entry the
/// replicated input's gradient is all-reduced in backward (copy_to_region), at its exit the output
/// is all-reduced in forward (reduce_from_region): 2 all-reduces of b*s*h per layer forward, 2 in
/// backward. With sequence parallelism the replicated parts (LayerNorm, dropout, residuals) are
/// split along the sequence instead; the entry becomes an all-gather along the sequence (its
/// backward a reduce-scatter) and the exit a reduce-scatter (its backward an all-gather): the same
/// bytes, and activations outside the regions cut by t. A parameter used on sequence shards (a
/// LayerNorm's, a RowParallelLinear's bias) then gets only its shard's gradient: mark it with
/// mark_sequence_parallel. A DistributedOptimizer holding it sums the parts over the group once a
/// step, before the norm and the update; without one, a hook sums them as autograd produces each
/// gradient (Note [Sequence-parallel sums] in src/parallel/split_record.cpp).
///
/// Note [Split records]
/// Each parameter under tensor parallelism carries a record of how it is split, kept by the library
/// and looked up from the tensor itself (Megatron's tensor_model_parallel / partition_dim
/// attributes; at::Tensor has no attribute slot, so a registry keyed by the tensor, which does
/// not keep it alive). The split layers mark their parameters when they are built; a parameter
/// made elsewhere is marked with mark_split (a slice of an unsplit tensor), mark_replicated (every
/// tensor rank holds it whole) or mark_sequence_parallel. Everything downstream reads the record
/// instead of a list of names: DistributedOptimizer (which parameters the clipping norm counts
/// once over the tensor group: those with no split, marked or not, as Megatron counts every
/// parameter without tensor_model_parallel) and checkpoints (each split parameter's split is in
/// the manifest and checked against the model's when loading). A record follows the tensor
/// through module.to() (which keeps the TensorImpl), not through detach() or clone().
///
/// Every layer's weight is drawn whole on every rank (the same generator state gives the same
/// numbers: torch::nn's own initialisation) and the rank keeps its slice, so a model built at any
/// t starts from the unsplit model's values; load_full() copies the slice of given unsplit values.
/// Layouts are [batch, sequence, features] (sequence_dim 1); the vocabulary and the split feature
/// dimensions must divide by t.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::tp {

/// ---- Collectives autograd differentiates (Megatron's mappings) --------------------------------
/// Forward identity, backward all-reduce: a replicated input enters a split region.
at::Tensor copy_to_region(const at::Tensor& x, const CommunicatorPtr& group);
/// Forward all-reduce (sum), backward identity: partial sums leave a split region.
at::Tensor reduce_from_region(const at::Tensor& x, const CommunicatorPtr& group);
/// Forward: this rank's chunk of `dim`; backward: the gradient all-gathered along `dim`.
at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, const CommunicatorPtr& group);
/// Forward: all-gathered along `dim`; backward: this rank's chunk of the gradient.
at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, const CommunicatorPtr& group);
/// Sequence parallelism. Forward all-gather along `dim`, backward reduce-scatter along `dim`.
at::Tensor gather_from_sequence_region(const at::Tensor& x, int64_t dim,
                                       const CommunicatorPtr& group);
/// Forward reduce-scatter along `dim` (sum), backward all-gather along `dim`.
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, int64_t dim,
                                             const CommunicatorPtr& group);

/// ---- What a parameter knows about its split (Note [Split records]) ---------------------------
/// How a parameter is split over its tensor group: this rank holds rows
/// [rank * padded_size / t, (rank + 1) * padded_size / t) of the unsplit tensor along `dim`, of
/// which those at full_size and beyond are padding (a vocabulary padded with padded_vocab()).
struct Split {
  int64_t dim = 0;          ///< the split dimension of the parameter
  int64_t full_size = 0;    ///< the unsplit size along dim, without padding
  int64_t padded_size = 0;  ///< the unsplit size along dim with padding: t x this rank's size
  /// Equal in dimension, unsplit size and padded size.
  bool operator==(const Split& o) const {
    return dim == o.dim && full_size == o.full_size && padded_size == o.padded_size;
  }
  /// Not operator==.
  bool operator!=(const Split& o) const { return !(*this == o); }
};

/// What the library knows about one parameter under tensor parallelism.
struct SplitRecord {
  CommunicatorPtr group;       ///< its tensor-parallel group
  std::optional<Split> split;  ///< none: every rank of the group holds it whole (replicated)
  /// Used on sequence shards: its gradient's parts are summed over the group
  /// (mark_sequence_parallel).
  bool sequence_parallel = false;
};

/// Records that `param` is this rank's slice of an unsplit tensor split along `dim` over `group`:
/// param.size(dim) * t must equal padded_size, and 0 < full_size <= padded_size. Marking again
/// replaces the record (a model that pads a split layer's rows marks its true full_size). Throws
/// Error{InvalidArgument} naming what does not fit. Local: no communication.
void mark_split(const at::Tensor& param, const CommunicatorPtr& group, int64_t dim,
                int64_t full_size, int64_t padded_size);
/// Records that every rank of `group` holds `param` whole with the same gradient (the clipping
/// norm counts it once). Parameters without a record are taken as replicated already; marking
/// says so explicitly and names the group. Local.
void mark_replicated(const at::Tensor& param, const CommunicatorPtr& group);
/// Records `param` as replicated and used on sequence shards: its gradient is summed over `group`
/// by the DistributedOptimizer holding it, once a step, or else by a hook as autograd produces it
/// (Note [Split regions]).
void mark_sequence_parallel(const at::Tensor& param, const CommunicatorPtr& group);
/// The record of `param`, if it has one. Thread-safe, as are the mark functions.
std::optional<SplitRecord> record_of(const at::Tensor& param);
/// The split of `param`, if it is split.
std::optional<Split> split_of(const at::Tensor& param);

/// What every split layer is given.
///
/// Note [Drawing only the slice]
/// By default (init_unsplit) a split layer draws torch's initialisation of the whole matrix
/// (torch::nn::Linear's, torch::nn::Embedding's) on every rank from the same generator state and
/// keeps its slice: any t starts from the values one process would, at the cost of one whole
/// matrix per layer on every rank while it is built. A model that draws its own values slice by
/// slice (examples/gpt, Note [Weights by name]) sets init_unsplit = false: the layers start at
/// zero and no rank ever holds more than its share of a split tensor.
struct TensorParallel {
  CommunicatorPtr group;           ///< the tensor-parallel group (ParallelGroups::tp)
  bool sequence_parallel = false;  ///< Note [Split regions]
  int64_t sequence_dim = 1;        ///< of [batch, sequence, features]
  bool init_unsplit = true;        ///< Note [Drawing only the slice]
};

/// y = x A^T + b with A's rows (output features) split: weight [out/t, in], bias [out/t]. The
/// output stays split unless gather_output.
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  /// Splits `out_features` over the group's t ranks (it must divide by t); the weight and the bias
  /// are recorded as split along dim 0 (Note [Split records]).
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, TensorParallel tp,
                           bool bias = true, bool gather_output = false);
  /// X [..., in] -> [..., out/t], or [..., out] with gather_output.
  at::Tensor forward(const at::Tensor& x);
  /// Copies this rank's rows of the unsplit weight [out, in] and bias [out] (undefined: none).
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});

  ///@{
  /// Weight [out/t, in], bias [out/t] (undefined without bias).
  at::Tensor weight, bias;
  ///@}
  const TensorParallel& tensor_parallel() const { return tp_; }  ///< what it was given
  bool gathers_output() const { return gather_output_; }         ///< built with gather_output

 private:
  TensorParallel tp_;
  bool gather_output_;
};
TORCH_MODULE(ColumnParallelLinear);

/// Several column-parallel layers over one input (attention's q, k and v) as one product of their
/// concatenated weights, outputs [..., out_i/t] in the layers' order: the backward makes one
/// input-gradient all-reduce (under sequence parallelism one all-gather and one reduce-scatter)
/// where separate layers make one each, as Megatron's fused QKV, while each layer keeps its own
/// parameters (names, checkpoints and unsplit loads unchanged). The layers must share the group,
/// sequence parallelism, the input width and having a bias, and not gather their outputs.
///
/// Note [Overlapped input gradients]
/// A column-parallel product's backward starts the all-reduce of its input gradient, computes the
/// weight and bias gradients while it runs and waits for it only then (Megatron's asynchronous
/// input-gradient all-reduce); an engine that overlaps its caller (Capabilities::overlaps_caller)
/// hides the all-reduce behind the weight-gradient GEMM.
std::vector<at::Tensor> fused_column_forward(const at::Tensor& x,
                                             const std::vector<ColumnParallelLinear>& layers);

/// y = x A^T + b with A's columns (input features) split: weight [out, in/t]; bias [out] is
/// replicated and added after the reduction. The input is split already unless !input_is_parallel.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  /// Splits `in_features` over the group's t ranks (it must divide by t); the weight is recorded as
  /// split along dim 1, the bias as replicated (or sequence parallel).
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, TensorParallel tp,
                        bool bias = true, bool input_is_parallel = true);
  /// X [..., in/t] (or [..., in] unless input_is_parallel) -> [..., out], summed over the group.
  at::Tensor forward(const at::Tensor& x);
  /// Copies this rank's columns of the unsplit weight [out, in], and the bias [out] (undefined:
  /// none).
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});

  ///@{
  /// Weight [out, in/t], bias [out] (replicated; undefined without bias).
  at::Tensor weight, bias;
  ///@}

 private:
  TensorParallel tp_;
  bool input_is_parallel_;
};
TORCH_MODULE(RowParallelLinear);

/// An embedding whose rows (the vocabulary) are split: weight [vocab/t, dim]; ids outside this
/// rank's rows give zeros, and the sum over the group is the full lookup (under sequence
/// parallelism, reduce-scattered along the sequence). Its weight doubles as the tied decoder:
/// a ColumnParallelLinear's matrix (logits split over the vocabulary,
/// vocab_parallel_cross_entropy).
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  /// Splits `vocab` rows over the group's t ranks (pad it with padded_vocab()); the weight is
  /// recorded as split along dim 0 with full_size `vocab` (a model that padded marks its own
  /// vocabulary size with mark_split).
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, TensorParallel tp);
  /// Ids [...] -> [..., dim], the full lookup (zeros summed in from other ranks' rows).
  at::Tensor forward(const at::Tensor& ids);
  /// Copies this rank's rows of the unsplit weight [vocab, dim].
  void load_full(const at::Tensor& weight);
  int64_t vocab_begin() const { return begin_; }  ///< this rank's first row

  at::Tensor weight;  ///< weight [vocab/t, dim]

 private:
  TensorParallel tp_;
  int64_t begin_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Cross entropy per position from logits split over the vocabulary (logits [..., vocab/t], this
/// rank's columns vocab_begin = rank * vocab/t onward; target [...]): three small all-reduces (max,
/// sum of exponentials, the target's logit), so no rank holds full-vocabulary logits. Positions
/// whose target is ignore_index give 0 and no gradient. Differentiable in the logits.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const CommunicatorPtr& group,
                                        int64_t ignore_index = -100);

/// The smallest multiple of 128 * t at least `vocab` (Megatron's padding: 30522 -> 30720 at t=2).
int64_t padded_vocab(int64_t vocab, int tp);

/// Dropout streams (Megatron's RNG tracker). Outside split regions every tensor rank must draw the
/// same numbers (the activations are replicated); inside (this rank's heads) each its own. The
/// default generator serves the first; fork() switches it to this rank's stream, seeded with seed +
/// 2718 + tp_rank, for the lifetime of the returned guard, and the stream continues at the next
/// fork. Per device: CPU, or CUDA's current device.
class RngTracker {
 public:
  /// This rank's stream is seeded with seed + 2718 + tp_rank on `device`.
  RngTracker(uint64_t seed, int tp_rank, c10::Device device = c10::kCPU);
  /// A scope on this rank's stream: the default generator's state is swapped in for its lifetime.
  class Fork {
   public:
    /// Switches the default generator to the tracker's stream.
    explicit Fork(RngTracker& tracker);
    ~Fork();
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;

   private:
    RngTracker& tracker_;
    at::Tensor caller_;  ///< the default stream's state, put back on exit
  };
  /// Switches to this rank's stream until the returned guard is destroyed.
  Fork fork() { return Fork(*this); }
  /// This rank's stream between forks, as a generator state (a byte tensor): what a checkpoint
  /// keeps (TrainerState::tensors) so a resumed run draws the same dropout masks.
  at::Tensor state() const { return state_.clone(); }
  /// Continues from a state() of a tracker on the same device. Throws Error{InvalidArgument}
  /// when `state` is no generator state of that device.
  void set_state(const at::Tensor& state);

 private:
  c10::Device device_;
  at::Tensor state_;  ///< this rank's stream between forks
};

}  // namespace shardopt::tp
