// The torch state-dict contract of DistributedOptimizer (shardopt/state_dict.hpp): the full
// optimizer state gathered onto one rank, and a full state loaded back into every rank's shard.
// torch::save / torch::load of it are in torch_archive.cpp.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "checkpoint/format.hpp"
#include "checkpoint/staging.hpp"
#include "comm/agreement.hpp"
#include "engine/adafactor_update.hpp"
#include "engine/muon_update.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"

namespace shardopt {

using detail::ShardAccess;

namespace detail {
void check_has_torch_state(ShardAccess& a, const char* what) {
  SHARDOPT_CHECK(!a.has_factory_optimizer(), Unsupported,
                 "optimizer: {}: a factory-built optimizer keeps its state inside its own torch "
                 "optimizer, which shardopt cannot map to torch's state-dict format; use a native "
                 "rule ({}) for state dicts and sharded checkpoints (save_checkpoint)",
                 what, fmt::join(rule_names(), ", "));
}
}  // namespace detail

namespace {

// torch keeps no state before the first step, except Adagrad's accumulators (made at
// construction).
bool has_state(ShardAccess& a) {
  return a.step_count() > 0 || std::holds_alternative<Adagrad>(a.group_rule(0));
}

}  // namespace

// Every bucket of every state buffer is all-gathered within the shard group holding rank `to` (a
// bucket at a time, so other ranks hold one bucket more at most) and rank `to` copies each
// parameter's pieces out of it.
void DistributedOptimizer::consolidate_state_dict(int to) {
  ShardAccess& a = detail::shard_access(*this);
  const int world = a.world_comm()->size();
  SHARDOPT_CHECK(to >= 0 && to < world, InvalidArgument,
                 "optimizer: consolidate_state_dict(to={}): `to` must be a rank in [0, {})", to,
                 world);
  detail::check_has_torch_state(a, "consolidate_state_dict");
  if (has_state(a)) {
    detail::check_elementwise_state(rule_name(a.group_rule(0)), "consolidate_state_dict");
  }
  at::NoGradGuard no_grad;
  consolidated_.reset();
  const auto& layout = a.layout();
  const std::vector<std::string> names = has_state(a) ? detail::optimizer_state_names(a)
                                                      : std::vector<std::string>{};
  const bool holder = a.world_comm()->rank() == to;
  const Duration timeout = a.zero_options().timeout;
  // [state buffer][layout slot]: the full tensors (holder only).
  std::vector<std::vector<at::Tensor>> full(names.size());
  if (to / a.comm()->size() == a.replica()) {
    for (size_t k = 0; k < names.size(); ++k) {
      for (size_t b = 0; b < layout.buckets.size(); ++b) {
        const auto& bl = layout.buckets[b];
        const at::Tensor slice =
            a.owned_state_slice(static_cast<int>(k), static_cast<int>(b)).contiguous();
        if (full[k].empty() && holder) {
          for (size_t i = 0; i < layout.slots.size(); ++i) {
            full[k].push_back(at::empty(a.param_shape(static_cast<int>(i)), slice.options()));
          }
        }
        at::Tensor bucket = at::empty({bl.padded}, slice.options());
        a.comm()->all_gather(slice, bucket, true)->wait(timeout);
        if (!holder) continue;
        for (int piece : bl.pieces) {
          const auto& p = layout.pieces[piece];
          full[k][p.param].view({-1}).narrow(0, p.param_offset, p.numel).copy_(
              bucket.narrow(0, p.offset, p.numel));
        }
      }
    }
  }
  consolidated_step_ = a.step_count();
  if (!holder) return;
  auto out = std::make_unique<OptimizerStateDict>();
  out->step = a.step_count();
  for (size_t g = 0; g < given_.size(); ++g) {
    OptimizerStateDict::Group group{a.group_rule(static_cast<int>(g)), {}};
    for (const auto& p : given_[g]) {
      OptimizerStateDict::Param param{p.name, {}};
      for (size_t k = 0; k < names.size() && p.index >= 0; ++k) {
        param.state[names[k]] = full[k][p.index];
      }
      // Adafactor: torch's row_var, col_var or variance out of the packed buffer (Note
      // [Factored state in flat shards] in src/engine/adafactor_update.hpp).
      if (std::holds_alternative<Adafactor>(group.rule) && !param.state.empty()) {
        param.state = detail::adafactor_torch_state(param.state.begin()->second);
      }
      // Muon: torch.optim.Muon's momentum_buffer or torch.optim.AdamW's exp_avg, exp_avg_sq.
      if (const auto* m = std::get_if<Muon>(&group.rule); m && p.index >= 0) {
        param.state = detail::muon_torch_state(
            std::move(param.state), m->use_muon() && a.param_shape(p.index).size() == 2);
      }
      group.params.push_back(std::move(param));
    }
    out->groups.push_back(std::move(group));
  }
  consolidated_ = std::move(out);
}

const OptimizerStateDict& DistributedOptimizer::state_dict() const {
  const int rank = communicator()->rank();
  SHARDOPT_CHECK(consolidated_ != nullptr, Unsupported,
                 "optimizer: rank {} holds no consolidated state: the optimizer state is sharded; "
                 "call consolidate_state_dict(to) on every rank first and read state_dict() on "
                 "rank `to`, or save a sharded checkpoint with save_checkpoint(dir)",
                 rank);
  SHARDOPT_CHECK(consolidated_step_ == last_step().step, Unsupported,
                 "optimizer: the state consolidated at step {} is stale, the optimizer has taken "
                 "step {} since; call consolidate_state_dict(to) on every rank again (or save a "
                 "sharded checkpoint with save_checkpoint(dir))",
                 consolidated_step_, last_step().step);
  return *consolidated_;
}

void DistributedOptimizer::load_state_dict(const OptimizerStateDict& state) {
  ShardAccess& a = detail::shard_access(*this);
  at::NoGradGuard no_grad;
  detail::Staging staging;
  std::vector<std::string> names;
  bool fresh = true;
  detail::agree(
      *a.world_comm(), a.zero_options().timeout, "loading an optimizer state dict",
      "no rank changed its optimizer", [&] {
        detail::check_has_torch_state(a, "load_state_dict");
        detail::checked_step_count(state.step, "the optimizer state dict's step");
        names = detail::optimizer_state_names(a);
        for (const auto& group : state.groups) {
          for (const auto& param : group.params) {
            if (!param.state.empty()) {
              detail::check_elementwise_state(rule_name(a.group_rule(0)), "load_state_dict");
            }
          }
        }
        SHARDOPT_CHECK(state.groups.size() == given_.size(), Mismatch,
                       "optimizer: the state dict has {} parameter groups, this optimizer {}",
                       state.groups.size(), given_.size());
        // Positional, as torch maps state dicts: the i-th parameter of each group.
        std::vector<const std::map<std::string, at::Tensor>*> by_slot(a.layout().slots.size());
        // Adafactor: torch's per-parameter buffers packed into the flat buffer's form.
        std::vector<std::map<std::string, at::Tensor>> packed(a.layout().slots.size());
        std::string with_state, without_state;
        for (size_t g = 0; g < given_.size(); ++g) {
          const auto& saved = state.groups[g];
          SHARDOPT_CHECK(saved.params.size() == given_[g].size(), Mismatch,
                         "optimizer: parameter group {} has {} parameters in the state dict, "
                         "{} in this optimizer",
                         g, saved.params.size(), given_[g].size());
          const Rule& current = a.group_rule(static_cast<int>(g));
          SHARDOPT_CHECK(saved.rule.index() == current.index() &&
                             detail::state_names(saved.rule) == detail::state_names(current),
                         Mismatch,
                         "optimizer: parameter group {} of the state dict is {} keeping [{}], "
                         "this optimizer runs {} keeping [{}]",
                         g, rule_name(saved.rule), fmt::join(detail::state_names(saved.rule), ", "),
                         rule_name(current), fmt::join(names, ", "));
          for (size_t j = 0; j < given_[g].size(); ++j) {
            const int slot = given_[g][j].index;
            if (slot < 0 || by_slot[slot] != nullptr) continue;  // frozen, or tied (seen)
            const std::string& name = a.param_name(slot);
            if (std::holds_alternative<Adafactor>(current) && !saved.params[j].state.empty()) {
              packed[slot][names.at(0)] = detail::adafactor_packed_state(
                  saved.params[j].state, a.param_shape(slot), name,
                  at::TensorOptions().dtype(a.master_dtype()));
            }
            const auto* muon = std::get_if<Muon>(&current);
            if (muon) {  // torch's Muon / AdamW buffers into the two flat buffers
              packed[slot] = detail::muon_flat_state(
                  saved.params[j].state, muon->use_muon() && a.param_shape(slot).size() == 2,
                  a.param_shape(slot), name, at::TensorOptions().dtype(a.master_dtype()));
            }
            const auto& buffers = std::holds_alternative<Adafactor>(current) || muon
                                      ? packed[slot] : saved.params[j].state;
            by_slot[slot] = &buffers;
            (buffers.empty() ? without_state : with_state) = name;
            for (const auto& [key, tensor] : buffers) {
              SHARDOPT_CHECK(std::find(names.begin(), names.end(), key) != names.end(), Mismatch,
                             "optimizer: the state dict holds '{}' for parameter '{}', but {} "
                             "keeps [{}]",
                             key, name, rule_name(current), fmt::join(names, ", "));
              SHARDOPT_CHECK(tensor.defined() && tensor.sizes().vec() == a.param_shape(slot),
                             Mismatch,
                             "optimizer: the state dict's '{}' of parameter '{}' has shape {}, "
                             "the parameter {}",
                             key, name,
                             tensor.defined() ? detail::shape_text(tensor.sizes().vec())
                                              : std::string("(undefined)"),
                             detail::shape_text(a.param_shape(slot)));
            }
            for (const auto& key : names) {
              SHARDOPT_CHECK(buffers.empty() || buffers.count(key) > 0, Mismatch,
                             "optimizer: the state dict has no '{}' for parameter '{}' ({} keeps "
                             "[{}])",
                             key, name, rule_name(current), fmt::join(names, ", "));
            }
          }
        }
        SHARDOPT_CHECK(with_state.empty() || without_state.empty(), Unsupported,
                       "optimizer: the state dict holds state for '{}' but none for '{}' (it got "
                       "no gradient in the run that saved it?); shardopt steps every trainable "
                       "parameter together and cannot resume such a state",
                       with_state, without_state);
        fresh = with_state.empty();
        staging = detail::stage_current(a, static_cast<int>(names.size()));
        for (size_t k = 0; k < names.size(); ++k) {
          if (fresh) {
            // torch's state before the first step: zeros, Adagrad's initial accumulator.
            const Adagrad* ada = std::get_if<Adagrad>(&state.groups[0].rule);
            staging.state[k].fill_(ada ? ada->initial_accumulator_value() : 0.0);
            continue;
          }
          std::vector<at::Tensor> full;
          for (const auto* buffers : by_slot) full.push_back(buffers->at(names[k]));
          detail::stage_from_full(a, staging.state[k], full);
        }
        return detail::json();
      });
  detail::commit(a, staging);
  // SGD keeps no step in torch: momentum buffers mean at least one step was taken.
  a.set_step_count(names.empty() ? state.step : fresh ? 0 : std::max<int64_t>(state.step, 1));
  for (size_t g = 0; g < state.groups.size(); ++g) set_group_rule(g, state.groups[g].rule);
  consolidated_.reset();
  a.after_load();
}

}  // namespace shardopt
