// The engine's place in the model-parallel grid, wired once at construction: the tensor group
// and its replicated parameters (GridNorm), the sequence-parallel sums and the tied parameters'
// sums (FinalizeGrads), and the tied copies' starting values. Split out of engine.cpp, which
// keeps the engine's life cycle.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "engine/engine.hpp"
#include "engine/grid_norm.hpp"
#include "parallel/sequence_sums.hpp"
#include "shardopt/error.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace shardopt::detail {

void Engine::wire_grid(const Rule& rule) {
  // Note [Split records] (shardopt/tensor_parallel.hpp): the parameters say how they are split.
  const ParallelGroups& grid = options_.grid;
  if (auto tensors = tensor_grid_of(params(), grid.tp && grid.tp->size() > 1 ? grid.tp : nullptr);
      tensors.group) {
    // Adafactor's row and column statistics and Muon's Newton-Schulz span whole matrices; over a
    // split one they would cover only this rank's part.
    const char* whole = std::holds_alternative<Adafactor>(rule) ? "adafactor"
                        : std::holds_alternative<Muon>(rule)    ? "muon"
                                                                : nullptr;
    for (size_t i = 0; whole && i < tensors.replicated.size(); ++i) {
      SHARDOPT_CHECK(tensors.replicated[i] != 0, Unsupported,
                     "optimizer: {} does not step parameters split by tensor parallelism yet: "
                     "'{}' is split over {} ranks, and its update needs the whole matrix; use "
                     "adamw or lamb with tensor parallelism",
                     whole, params()[i].name, tensors.group->size());
    }
    update_->grid().set_tensor_group(std::move(tensors.group), std::move(tensors.replicated));
  }
  claim_sequence_sums();
  if (grid.pp && grid.pp->size() > 1) update_->grid().set_pipeline(grid.pp);
  if (grid.embedding) {
    // The tied parameters' sum (Note [Finalizing gradients over the grid] in finalize_grads.cpp).
    update_->finalize().set_pipeline_shared(
        grid.embedding, pipeline_shared_slots(),
        ranks_.replica == 0 && (plan_.sharded() || comm_->rank() == 0), grid.pp->rank() == 0);
  }
}

// The parameters marked with mark_sequence_parallel over more than one rank: the optimizer sums
// their gradients once a step (Note [Sequence-parallel sums] in src/parallel/split_record.cpp).
void Engine::claim_sequence_sums() {
  std::vector<char> slots(params().size(), 0);
  CommunicatorPtr group;
  for (size_t i = 0; i < params().size(); ++i) {
    const auto record = tp::record_of(params()[i].tensor);
    if (!record || !record->sequence_parallel || record->group->size() == 1) continue;
    SHARDOPT_CHECK(!group || group->size() == record->group->size(), InvalidArgument,
                   "optimizer: parameter '{}' is marked sequence parallel over {} ranks, the "
                   "others over {}: one optimizer sums over one tensor group",
                   params()[i].name, record->group->size(), group ? group->size() : 0);
    group = record->group;
    slots[i] = 1;
  }
  if (!group) return;
  update_->finalize().set_sequence_parallel(group, slots);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i]) claim_sequence_sum(params()[i].tensor);
  }
  claimed_sequence_sums_ = true;
}

// The parameters marked with mark_pipeline_shared, as a flag per layout slot. Marks mean nothing
// without a pipeline (one stage holds the tied tensor once); on a middle stage, which holds no
// tied copy, a mark is an error (the model placed it wrongly, or the grid is not the model's).
std::vector<char> Engine::pipeline_shared_slots() const {
  std::vector<char> flags(params().size(), 0);
  const ParallelGroups& grid = options_.grid;
  if (!grid.pp || grid.pp->size() == 1) return flags;
  for (size_t i = 0; i < params().size(); ++i) {
    if (!is_pipeline_shared(params()[i].tensor)) continue;
    SHARDOPT_CHECK(grid.embedding != nullptr, InvalidArgument,
                   "optimizer: parameter '{}' is marked with mark_pipeline_shared, but this rank "
                   "is on pipeline stage {} of {}, which holds no tied copy (ZeroOptions::grid "
                   "has no embedding group): only the first and the last stage may hold it",
                   params()[i].name, grid.pp->rank(), grid.pp->size());
    flags[i] = 1;
  }
  return flags;
}

// Both copies of a tied parameter start as the first stage's (Note [Finalizing gradients over the
// grid] in finalize_grads.cpp).
void Engine::copy_shared_from_first_stage() {
  const auto shared = pipeline_shared_slots();
  const CommunicatorPtr& group = options_.grid.embedding;
  if (!group) return;
  // Both stages must hold the same shapes, or the sum would mix parameters (or never meet).
  std::vector<int64_t> shapes;
  std::vector<std::string> names;
  for (size_t i = 0; i < params().size(); ++i) {
    if (!shared[i]) continue;
    const auto sizes = params()[i].tensor.sizes();
    shapes.push_back(static_cast<int64_t>(sizes.size()));
    shapes.insert(shapes.end(), sizes.begin(), sizes.end());
    names.push_back(params()[i].name);
  }
  const std::string mine = fmt::format("{}", fmt::join(shapes, ","));
  const int64_t digest = static_cast<int64_t>(std::hash<std::string>{}(mine) >> 12);
  at::Tensor range = at::tensor({digest, -digest}, at::kLong);
  group->all_reduce(range, ReduceOp::Max);
  SHARDOPT_CHECK(range[0].item<int64_t>() == -range[1].item<int64_t>(), InvalidArgument,
                 "optimizer: the parameters marked with mark_pipeline_shared differ between the "
                 "first and the last pipeline stage (here: [{}] of shapes [{}]); mark the same "
                 "tied parameters, in the same order, on both",
                 fmt::join(names, ", "), mine);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params().size(); ++i) {
    if (!shared[i]) continue;
    const at::Tensor& t = params()[i].tensor;
    at::Tensor buffer = t.contiguous();
    group->broadcast(buffer, 0);
    if (!buffer.is_same(t)) t.copy_(buffer);
  }
}

}  // namespace shardopt::detail
