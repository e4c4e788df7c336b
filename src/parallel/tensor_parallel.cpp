// Tensor parallelism: the differentiable collectives, the split layers, the vocabulary-parallel
// cross entropy and the dropout streams (shardopt/tensor_parallel.hpp, Note [Split regions]).
#include "shardopt/tensor_parallel.hpp"
#include "shardopt/threads.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <mutex>
#include <utility>

#include "shardopt/error.hpp"

namespace shardopt::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t wrap(int64_t dim, const at::Tensor& x) { return dim < 0 ? dim + x.dim() : dim; }

void check_divides(const char* what, int64_t n, int t) {
  SHARDOPT_CHECK(n % t == 0, InvalidArgument,
                 "tensor parallel: {} ({}) must divide by the tensor-parallel size {}", what, n, t);
}

// The plain collectives along a dimension, on the group's flat, rank-major layout.
at::Tensor all_reduce(const at::Tensor& x, Communicator& group) {
  at::Tensor out = x.contiguous().clone();
  if (group.size() > 1) group.all_reduce(out);
  return out;
}

at::Tensor chunk(const at::Tensor& x, int64_t dim, Communicator& group) {
  dim = wrap(dim, x);
  check_divides("the split dimension", x.size(dim), group.size());
  // A copy, never a view of x: an autograd function must not return a view of its input.
  return x.chunk(group.size(), dim)[group.rank()].clone(at::MemoryFormat::Contiguous);
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, Communicator& group) {
  if (group.size() == 1) return x;
  dim = wrap(dim, x);
  const at::Tensor moved = x.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  at::Tensor out = at::empty({group.size() * moved.numel()}, moved.options());
  group.all_gather(moved.reshape(-1), out);
  sizes[0] *= group.size();
  return out.view(sizes).movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, Communicator& group) {
  if (group.size() == 1) return x;
  dim = wrap(dim, x);
  check_divides("the sequence dimension", x.size(dim), group.size());
  const at::Tensor moved = x.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  at::Tensor out = at::empty({moved.numel() / group.size()}, moved.options());
  group.reduce_scatter(moved.reshape(-1), out);
  sizes[0] /= group.size();
  return out.view(sizes).movedim(0, dim).contiguous();
}

enum Op : int64_t { kIdentity, kAllReduce, kChunk, kAllGather, kReduceScatter };

at::Tensor run(int64_t op, const at::Tensor& x, int64_t dim, Communicator& group) {
  switch (op) {
    case kIdentity: return x;
    case kAllReduce: return all_reduce(x, group);
    case kChunk: return chunk(x, dim, group);
    case kAllGather: return all_gather(x, dim, group);
    case kReduceScatter: return reduce_scatter(x, dim, group);
  }
  SHARDOPT_INTERNAL_ASSERT(false, "tensor parallel: unknown collective {}", op);
  return {};
}

// The group travels to backward in the context as a capsule (it is no IValue type of its own).
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(CommunicatorPtr g) : group(std::move(g)) {}
  CommunicatorPtr group;
};

CommunicatorPtr group_in(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())
      ->group;
}

// One autograd function for every pair (forward op, backward op) of Note [Split regions].
struct Mapping : torch::autograd::Function<Mapping> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t forward_op,
                            int64_t backward_op, int64_t dim, const CommunicatorPtr& group) {
    ctx->saved_data["backward_op"] = backward_op;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    return run(forward_op, x, dim, *group);  // identity: x itself (autograd makes it a view)
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor g = run(ctx->saved_data["backward_op"].toInt(), grads[0],
                       ctx->saved_data["dim"].toInt(), *group_in(ctx));
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Sequence parallelism's column-parallel product (as Megatron's linear with its all-gather
// inside): gathers the sequence shards, multiplies, and keeps only the shard for backward, where
// it is gathered again. The whole sequence is never held from forward to backward; a gather
// before a plain linear would keep one whole copy per product (q, k and v each).
struct SequenceGatheredLinear : torch::autograd::Function<SequenceGatheredLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t dim, const CommunicatorPtr& group) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["bias"] = bias.defined();
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    return at::linear(all_gather(x, dim, *group), weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    Communicator& group = *group_in(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const at::Tensor full = all_gather(x, dim, group);
    const at::Tensor rows = grads[0].reshape({-1, weight.size(0)});
    const at::Tensor grad_weight = rows.t().mm(full.reshape({-1, weight.size(1)}));
    const at::Tensor grad_bias = ctx->saved_data["bias"].toBool() ? rows.sum(0) : at::Tensor();
    const at::Tensor grad_x = reduce_scatter(grads[0].matmul(weight), dim, group);
    return {grad_x, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

// The column-parallel product y = x W^T + b entering the split region (as copy_to_region then a
// linear), with the backward's input-gradient all-reduce started before the weight gradient is
// computed and waited for after it (Note [Overlapped input gradients]).
struct RegionLinear : torch::autograd::Function<RegionLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const CommunicatorPtr& group) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bias.defined();
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    return at::linear(x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor grad_x = grads[0].matmul(weight).contiguous();
    const WorkPtr sum = group_in(ctx)->all_reduce(grad_x, ReduceOp::Sum, /*async=*/true);
    const at::Tensor rows = grads[0].reshape({-1, weight.size(0)});
    const at::Tensor grad_weight = rows.t().mm(x.reshape({-1, weight.size(1)}));
    const at::Tensor grad_bias = ctx->saved_data["bias"].toBool() ? rows.sum(0) : at::Tensor();
    sum->wait();
    return {grad_x, grad_weight, grad_bias, at::Tensor()};
  }
};

at::Tensor map(const at::Tensor& x, Op forward_op, Op backward_op, int64_t dim,
               const CommunicatorPtr& group) {
  SHARDOPT_CHECK(group != nullptr, InvalidArgument, "tensor parallel: the group is null");
  if (group->size() == 1) return x;
  return Mapping::apply(x, static_cast<int64_t>(forward_op), static_cast<int64_t>(backward_op),
                        dim, group);
}

// torch::nn::Linear's initialisation of the whole [out, in] matrix and [out] bias, drawn on every
// rank from the same generator state; zeros of this rank's slice (split along `dim`, the bias
// along 0 when dim is 0) where the model draws its own (Note [Drawing only the slice]).
std::pair<at::Tensor, at::Tensor> linear_init(int64_t in, int64_t out, bool bias,
                                              const TensorParallel& tp, int64_t dim) {
  at::NoGradGuard no_grad;
  if (!tp.init_unsplit) {
    const int64_t t = tp.group->size();
    return {at::zeros({dim == 0 ? out / t : out, dim == 1 ? in / t : in}),
            bias ? at::zeros({dim == 0 ? out / t : out}) : at::Tensor()};
  }
  at::Tensor w = at::empty({out, in});
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  at::Tensor b;
  if (bias) {
    const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
    b = at::empty({out}).uniform_(-bound, bound);
  }
  return {w, b};
}

void copy_slice(at::Tensor& param, const at::Tensor& full, int64_t dim, Communicator& group,
                const char* what) {
  at::NoGradGuard no_grad;
  auto expected = param.sizes().vec();
  if (dim >= 0) expected[dim] *= group.size();
  SHARDOPT_CHECK(full.sizes().vec() == expected, InvalidArgument,
                 "tensor parallel: load_full: the unsplit {} must be {}, got {}", what,
                 fmt::format("[{}]", fmt::join(expected, ", ")), describe(full));
  param.copy_(dim >= 0 ? full.chunk(group.size(), dim)[group.rank()] : full);
}

Communicator& group_of(const TensorParallel& tp) {
  SHARDOPT_CHECK(tp.group != nullptr, InvalidArgument,
                 "tensor parallel: TensorParallel::group is null (ParallelGroups::tp)");
  return *tp.group;
}

}  // namespace

at::Tensor copy_to_region(const at::Tensor& x, const CommunicatorPtr& group) {
  return map(x, kIdentity, kAllReduce, 0, group);
}
at::Tensor reduce_from_region(const at::Tensor& x, const CommunicatorPtr& group) {
  return map(x, kAllReduce, kIdentity, 0, group);
}
at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, const CommunicatorPtr& group) {
  return map(x, kChunk, kAllGather, dim, group);
}
at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, const CommunicatorPtr& group) {
  return map(x, kAllGather, kChunk, dim, group);
}
at::Tensor gather_from_sequence_region(const at::Tensor& x, int64_t dim,
                                       const CommunicatorPtr& group) {
  return map(x, kAllGather, kReduceScatter, dim, group);
}
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, int64_t dim,
                                             const CommunicatorPtr& group) {
  return map(x, kReduceScatter, kAllGather, dim, group);
}

// ---- layers -----------------------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   TensorParallel tp, bool with_bias,
                                                   bool gather_output)
    : tp_(std::move(tp)), gather_output_(gather_output) {
  Communicator& group = group_of(tp_);
  check_divides("ColumnParallelLinear's out_features", out_features, group.size());
  SHARDOPT_CHECK(!(gather_output && tp_.sequence_parallel), InvalidArgument,
                 "tensor parallel: ColumnParallelLinear cannot gather its output under sequence "
                 "parallelism");
  auto [w, b] = linear_init(in_features, out_features, with_bias, tp_, 0);
  weight = register_parameter("weight", tp_.init_unsplit ? chunk(w, 0, group) : w);
  mark_split(weight, tp_.group, 0, out_features, out_features);
  if (with_bias) {
    bias = register_parameter("bias", tp_.init_unsplit ? chunk(b, 0, group) : b);
    mark_split(bias, tp_.group, 0, out_features, out_features);
  }
}

namespace {

// x times a column-parallel weight (one layer's, or several layers' concatenated), into the split
// region: sequence shards gathered under sequence parallelism.
at::Tensor column_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          const TensorParallel& tp) {
  if (tp.group->size() == 1) return at::linear(x, weight, bias);
  if (tp.sequence_parallel) {
    return SequenceGatheredLinear::apply(x, weight, bias, tp.sequence_dim, tp.group);
  }
  return RegionLinear::apply(x, weight, bias, tp.group);
}

}  // namespace

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = column_product(x, weight, bias, tp_);
  return gather_output_ ? gather_from_region(y, -1, tp_.group) : y;
}

std::vector<at::Tensor> fused_column_forward(const at::Tensor& x,
                                             const std::vector<ColumnParallelLinear>& layers) {
  SHARDOPT_CHECK(!layers.empty(), InvalidArgument, "tensor parallel: fused_column_forward: no layers");
  const ColumnParallelLinearImpl& first = *layers.front();
  std::vector<at::Tensor> weights, biases;
  std::vector<int64_t> widths;
  for (const auto& layer : layers) {
    const TensorParallel& tp = layer->tensor_parallel();
    SHARDOPT_CHECK(tp.group == first.tensor_parallel().group &&
                       tp.sequence_parallel == first.tensor_parallel().sequence_parallel &&
                       !layer->gathers_output() && layer->bias.defined() == first.bias.defined() &&
                       layer->weight.size(1) == first.weight.size(1),
                   InvalidArgument,
                   "tensor parallel: fused_column_forward: the layers must share the group, "
                   "sequence parallelism, the input width and having a bias, and not gather their "
                   "outputs");
    weights.push_back(layer->weight);
    if (layer->bias.defined()) biases.push_back(layer->bias);
    widths.push_back(layer->weight.size(0));
  }
  const at::Tensor bias = biases.empty() ? at::Tensor() : at::cat(biases);
  return column_product(x, at::cat(weights), bias, first.tensor_parallel())
      .split_with_sizes(widths, -1);
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& w, const at::Tensor& b) {
  copy_slice(weight, w, 0, *tp_.group, "weight");
  if (bias.defined()) copy_slice(bias, b, 0, *tp_.group, "bias");
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             TensorParallel tp, bool with_bias,
                                             bool input_is_parallel)
    : tp_(std::move(tp)), input_is_parallel_(input_is_parallel) {
  Communicator& group = group_of(tp_);
  check_divides("RowParallelLinear's in_features", in_features, group.size());
  SHARDOPT_CHECK(input_is_parallel || !tp_.sequence_parallel, InvalidArgument,
                 "tensor parallel: RowParallelLinear needs a split input under sequence "
                 "parallelism");
  auto [w, b] = linear_init(in_features, out_features, with_bias, tp_, 1);
  weight = register_parameter("weight", tp_.init_unsplit ? chunk(w, 1, group) : w);
  mark_split(weight, tp_.group, 1, in_features, in_features);
  if (with_bias) {
    bias = register_parameter("bias", b);
    if (tp_.sequence_parallel) {
      mark_sequence_parallel(bias, tp_.group);
    } else {
      mark_replicated(bias, tp_.group);
    }
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor input = input_is_parallel_ ? x : scatter_to_region(x, -1, tp_.group);
  const at::Tensor partial = at::matmul(input, weight.t());
  at::Tensor y = tp_.sequence_parallel
                     ? reduce_scatter_to_sequence_region(partial, tp_.sequence_dim, tp_.group)
                     : reduce_from_region(partial, tp_.group);
  return bias.defined() ? y + bias : y;
}

void RowParallelLinearImpl::load_full(const at::Tensor& w, const at::Tensor& b) {
  copy_slice(weight, w, 1, *tp_.group, "weight");
  if (bias.defined()) copy_slice(bias, b, -1, *tp_.group, "bias");
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim,
                                                       TensorParallel tp)
    : tp_(std::move(tp)) {
  Communicator& group = group_of(tp_);
  check_divides("the vocabulary (pad it: padded_vocab)", vocab, group.size());
  at::Tensor w;
  {
    at::NoGradGuard no_grad;
    w = tp_.init_unsplit ? at::empty({vocab, dim}).normal_()  // torch::nn::Embedding's
                         : at::zeros({vocab / group.size(), dim});  // Note [Drawing only the slice]
  }
  weight = register_parameter("weight", tp_.init_unsplit ? chunk(w, 0, group) : w);
  mark_split(weight, tp_.group, 0, vocab, vocab);  // the model marks its unpadded vocabulary
  begin_ = group.rank() * (vocab / group.size());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const int64_t rows = weight.size(0);
  const at::Tensor outside = (ids < begin_).logical_or(ids >= begin_ + rows);
  const at::Tensor local = (ids - begin_).masked_fill(outside, 0);
  const at::Tensor partial = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  return tp_.sequence_parallel
             ? reduce_scatter_to_sequence_region(partial, tp_.sequence_dim, tp_.group)
             : reduce_from_region(partial, tp_.group);
}

void VocabParallelEmbeddingImpl::load_full(const at::Tensor& w) {
  copy_slice(weight, w, 0, *tp_.group, "weight");
}

// ---- cross entropy over a split vocabulary ------------------------------------------------------

namespace {

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, const CommunicatorPtr& group,
                            int64_t ignore_index) {
    at::NoGradGuard no_grad;
    Communicator& g = *group;
    const int64_t rows = logits.size(-1);
    const int64_t begin = g.rank() * rows;
    // Softmax over the whole vocabulary, stabilised by the global maximum.
    at::Tensor max = std::get<0>(logits.max(-1)).contiguous();
    if (g.size() > 1) g.all_reduce(max, ReduceOp::Max);
    const at::Tensor shifted = logits - max.unsqueeze(-1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum = exp.sum(-1).contiguous();
    if (g.size() > 1) g.all_reduce(sum);
    // The target's logit lives on one rank; the others contribute 0.
    const at::Tensor ignored = target.eq(ignore_index);
    const at::Tensor outside = (target < begin).logical_or(target >= begin + rows);
    const at::Tensor local = (target - begin).masked_fill(outside, 0);
    at::Tensor picked = shifted.gather(-1, local.unsqueeze(-1))
                            .squeeze(-1)
                            .masked_fill(outside, 0)
                            .contiguous();
    if (g.size() > 1) g.all_reduce(picked);
    at::Tensor loss = (sum.log() - picked).masked_fill(ignored, 0);
    exp.div_(sum.unsqueeze(-1));  // this rank's columns of the softmax
    ctx->save_for_backward({exp, local, outside.logical_or(ignored), ignored});
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], local = saved[1], not_here = saved[2], ignored = saved[3];
    // d loss / d logits = softmax - one_hot(target), on this rank's columns.
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(-1, local.unsqueeze(-1),
                      not_here.logical_not().to(grad.scalar_type()).unsqueeze(-1).neg());
    grad.mul_(grads[0].masked_fill(ignored, 0).unsqueeze(-1));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const CommunicatorPtr& group, int64_t ignore_index) {
  SHARDOPT_CHECK(group != nullptr, InvalidArgument, "tensor parallel: the group is null");
  SHARDOPT_CHECK(target.dim() + 1 == logits.dim() &&
                     target.sizes() == logits.sizes().slice(0, target.dim()),
                 InvalidArgument,
                 "vocab_parallel_cross_entropy: target {} must be logits {} without the last "
                 "dimension", describe(target), describe(logits));
  return VocabParallelCrossEntropy::apply(logits, target, group, ignore_index);
}

int64_t padded_vocab(int64_t vocab, int tp) {
  const int64_t multiple = 128 * static_cast<int64_t>(tp);
  return (vocab + multiple - 1) / multiple * multiple;
}

// ---- dropout streams ----------------------------------------------------------------------------

RngTracker::RngTracker(uint64_t seed, int tp_rank, c10::Device device) : device_(device) {
  // Note [Ranks that are threads] (src/error.cpp): the streams are states of torch's default
  // generator, which the thread engine's ranks share; one rank's fork would reseed the others'.
  SHARDOPT_CHECK(thread_rank() < 0, Unsupported,
                 "tp::RngTracker: the dropout streams are states of torch's default generator, "
                 "which every thread-rank of the thread engine (run_ranks) shares; train with "
                 "dropout under tensor parallelism with one process per rank (mpirun)");
  auto gen = at::globalContext().defaultGenerator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const at::Tensor caller = gen.get_state();
  gen.set_current_seed(seed + 2718 + static_cast<uint64_t>(tp_rank));  // Megatron's offset
  state_ = gen.get_state();
  gen.set_state(caller);
}

void RngTracker::set_state(const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const at::Tensor caller = gen.get_state();
  try {
    gen.set_state(state);  // the generator validates the state's size and type
  } catch (const c10::Error& e) {
    gen.set_state(caller);
    SHARDOPT_FAIL(InvalidArgument, "tp::RngTracker::set_state: not a generator state of {}: {}",
                  device_.str(), e.what_without_backtrace());
  }
  state_ = gen.get_state();
  gen.set_state(caller);
}

RngTracker::Fork::Fork(RngTracker& tracker) : tracker_(tracker) {
  auto gen = at::globalContext().defaultGenerator(tracker_.device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  caller_ = gen.get_state();
  gen.set_state(tracker_.state_);
}

RngTracker::Fork::~Fork() {
  auto gen = at::globalContext().defaultGenerator(tracker_.device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  tracker_.state_ = gen.get_state();
  gen.set_state(caller_);
}

}  // namespace shardopt::tp
