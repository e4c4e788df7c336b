// The split records of tensor-parallel parameters (Note [Split records] in
// shardopt/tensor_parallel.hpp), kept in a TensorRegistry (parallel/tensor_registry.hpp).
#include <fmt/format.h>

#include "parallel/sequence_sums.hpp"
#include "parallel/tensor_registry.hpp"
#include "shardopt/error.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace shardopt::tp {
namespace {

detail::TensorRegistry<SplitRecord>& registry() {
  // Never destroyed: parameters may outlive static teardown.
  static auto* r = new detail::TensorRegistry<SplitRecord>();
  return *r;
}

// Sequence-parallel parameters whose sum an optimizer owns (Note [Sequence-parallel sums]).
detail::TensorRegistry<bool>& claims() {
  static auto* r = new detail::TensorRegistry<bool>();
  return *r;
}

void check_marked(const at::Tensor& param, const CommunicatorPtr& group, const char* what) {
  SHARDOPT_CHECK(param.defined(), InvalidArgument, "tensor parallel: {}: the tensor is undefined",
                 what);
  SHARDOPT_CHECK(group != nullptr, InvalidArgument,
                 "tensor parallel: {}: the group is null (ParallelGroups::tp)", what);
}

}  // namespace

void mark_split(const at::Tensor& param, const CommunicatorPtr& group, int64_t dim,
                int64_t full_size, int64_t padded_size) {
  check_marked(param, group, "mark_split");
  SHARDOPT_CHECK(dim >= 0 && dim < param.dim(), InvalidArgument,
                 "tensor parallel: mark_split: dim must be in [0, {}) for a tensor of shape {}, "
                 "got {}",
                 param.dim(), describe(param), dim);
  const int64_t t = group->size();
  SHARDOPT_CHECK(param.size(dim) * t == padded_size, InvalidArgument,
                 "tensor parallel: mark_split: padded_size must be the tensor's size along dim {} "
                 "times the group's {} ranks, expected {}, got {}",
                 dim, t, param.size(dim) * t, padded_size);
  SHARDOPT_CHECK(full_size > 0 && full_size <= padded_size, InvalidArgument,
                 "tensor parallel: mark_split: full_size must be in [1, padded_size = {}], got {}",
                 padded_size, full_size);
  registry().put(param, SplitRecord{group, Split{dim, full_size, padded_size}, false});
}

void mark_replicated(const at::Tensor& param, const CommunicatorPtr& group) {
  check_marked(param, group, "mark_replicated");
  registry().put(param, SplitRecord{group, std::nullopt, false});
}

void mark_sequence_parallel(const at::Tensor& param, const CommunicatorPtr& group) {
  check_marked(param, group, "mark_sequence_parallel");
  const auto before = registry().get(param);
  SHARDOPT_CHECK(!before || !before->split, InvalidArgument,
                 "tensor parallel: mark_sequence_parallel: the tensor {} is split along dim {}; "
                 "only a replicated parameter is used on sequence shards",
                 describe(param), before ? before->split->dim : 0);
  // Twice would sum the gradient twice.
  if (before && before->sequence_parallel) return;
  registry().put(param, SplitRecord{group, std::nullopt, true});
  if (group->size() == 1) return;
  // The hook holds the tensor weakly: it is stored on the tensor itself.
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weak(
      param.getIntrusivePtr());
  param.register_hook([group, weak](const at::Tensor& grad) {
    auto strong = weak.lock();
    if (strong && claims().get(at::Tensor(std::move(strong))).value_or(false)) {
      return at::Tensor();  // DistributedOptimizer sums it once a step (FinalizeGrads)
    }
    at::Tensor out = grad.contiguous().clone();
    group->all_reduce(out);
    return out;
  });
}

// Note [Sequence-parallel sums]
// A parameter used on sequence shards (Note [Split regions]) gets only its shard's part of the
// gradient on each tensor rank; the parts must be summed over the tensor group. On its own, the
// hook mark_sequence_parallel registers does it as autograd produces each gradient: a blocking
// all-reduce per parameter and backward pass (per micro-batch). A DistributedOptimizer holding the
// parameter claims it instead (Engine::build) and sums once a step, after the data-parallel
// reduction, in FinalizeGrads (Megatron's finalize_model_grads does the same for its LayerNorms):
// one all-reduce of this rank's pieces of all such parameters, whose layout is the same on every
// rank of the tensor group. The sum is linear, so summing after the micro-batches and the
// data-parallel reduction gives the same gradient; before step() the parameters' .grad hold the
// unsummed parts. Destroying the optimizer hands the sum back to the hook.
}  // namespace shardopt::tp

namespace shardopt::detail {

void claim_sequence_sum(const at::Tensor& param) { tp::claims().put(param, true); }
void release_sequence_sum(const at::Tensor& param) { tp::claims().put(param, false); }

}  // namespace shardopt::detail

namespace shardopt::tp {

std::optional<SplitRecord> record_of(const at::Tensor& param) {
  return registry().get(param);
}

std::optional<Split> split_of(const at::Tensor& param) {
  auto r = record_of(param);
  return r ? r->split : std::nullopt;
}

}  // namespace shardopt::tp
