/// \file
/// DistributedOptimizer: the drop-in ZeRO optimizer (stages 0-3) for libtorch trainers.
///
///   auto comm = shardopt::init_from_env();
///   shardopt::ZeroOptions zo;  zo.stage = shardopt::Stage::Gradients;
///   shardopt::DistributedOptimizer opt(model->named_parameters(),
///                                      shardopt::AdamW(1e-4).weight_decay(0.01), comm, zo);
///   for (...) { opt.zero_grad(); auto loss = model->forward(x); opt.backward(loss); opt.step(); }
///
/// Every rank feeds its own slice of the global batch (loss = mean over that slice); after step()
/// every rank holds what one process training on the whole batch with the same torch optimizer
/// would hold. Model parameters become views into flat buffers owned by the optimizer, so the
/// optimizer must outlive the training loop's use of them. All methods are collective unless noted.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/optimizer_types.hpp"
#include "shardopt/options.hpp"
#include "shardopt/pipeline_optimizer.hpp"
#include "shardopt/rules.hpp"
#include "shardopt/state_dict.hpp"

namespace shardopt {

/// BERT's usual split: parameters whose name matches `no_decay` (biases, LayerNorm) get weight
/// decay 0; the rest keep the rule's. Parameters keep their named_parameters() order.
std::vector<ParamGroup> weight_decay_groups(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    const std::function<bool(const std::string& name)>& no_decay);

class DistributedOptimizer;
namespace detail {
class Engine;
class ShardAccess;
ShardAccess& shard_access(DistributedOptimizer& optimizer);
}  // namespace detail

/// The drop-in ZeRO optimizer (stages 0-3) for libtorch trainers: a torch::optim::Optimizer whose
/// state, gradients and (stage 3) parameters are sharded over `comm`'s ranks. See the file's
/// comment for the usage and the contract; every method is collective unless noted.
class DistributedOptimizer : public torch::optim::Optimizer, public PipelineOptimizer {
 public:
  /// Every parameter in one group stepped by `rule`; the names appear in errors and checkpoints.
  DistributedOptimizer(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       Rule rule, CommunicatorPtr comm, ZeroOptions options = {});
  /// Parameter groups (weight_decay_groups(), or your own) stepped by `rule`.
  DistributedOptimizer(std::vector<ParamGroup> groups, Rule rule, CommunicatorPtr comm,
                       ZeroOptions options = {});
  /// Parameter groups stepped by any torch optimizer over this rank's shard, built by `factory`.
  DistributedOptimizer(std::vector<ParamGroup> groups, ShardOptimizerFactory factory,
                       CommunicatorPtr comm, ZeroOptions options = {});
  ~DistributedOptimizer() override;

  /// Finishes the gradient reduction, clips, updates the local shard and gathers parameters.
  /// The closure, when given, is called first (under grad mode) and its loss returned.
  at::Tensor step(LossClosure closure = nullptr) override;
  /// Discards the gradients: every .grad becomes undefined and the next backward's first gradient
  /// overwrites shardopt's buffers (nothing is written now), whatever `set_to_none` says.
  /// Optional between steps: step() consumes the
  /// gradients, so the next backward starts from zero also when a trainer holding a
  /// torch::optim::Optimizer& calls the base's zero_grad, which is not virtual (torch 1.13's
  /// zero_grad(), 2.6's zero_grad(bool)), or none at all.
  void zero_grad(bool set_to_none = true);
  /// (loss / grad_accumulation_steps).backward() plus micro-step bookkeeping (and loss scaling
  /// with fp16). Gradients are summed over micro-steps, so torch's own (loss / k).backward() gives
  /// the same big-batch gradient (Note [Gradient accumulation convention], src/engine/engine.cpp).
  void backward(const at::Tensor& loss);
  /// The autograd runs inside `fn` count as one backward pass (one micro-step): a zero-bubble
  /// weight pass runs one per layer (run_pipeline does this itself given the optimizer).
  void as_one_backward(const std::function<void()>& fn);

  /// PipelineOptimizer: run_pipeline, given the optimizer (PipelineRunOptions::optimizer), says
  /// how many backward passes the step has (v*m: grad_accumulation_steps is not set for it),
  /// which chunk each is for and when a chunk's gradients are final, so each bucket is reduced
  /// once a step (Note [Pipeline handshake] in src/pipeline/runner.cpp). Not called by trainers.
  void begin_pipeline(int chunks, int microbatches) override;
  void chunk_backward(int chunk, bool last, const std::function<void()>& pass) override;
  void end_pipeline() override;

  /// What the last step() did: norm, clipping, skipping, times, elements sent. Not collective.
  const StepStats& last_step() const;
  /// This rank's bytes of parameters, gradients, optimizer state, buffers. Not collective.
  MemoryReport memory() const;
  const ZeroOptions& options() const;  ///< The options it was built with. Not collective.
  /// The communicator it was given (world, even under hybrid sharding). Not collective.
  const CommunicatorPtr& communicator() const;
  /// Number of (deduplicated, trainable) parameters and their padded total in the flat layout.
  int64_t numel() const;
  int64_t padded_numel() const;  ///< the padded total of numel() in the flat layout
  /// Stage 3: gathers every unit's parameters (e.g. to evaluate or save the whole model outside
  /// Units::run); each is freed again when the next forward leaves it or by the next step().
  /// No-op for stages 0-2, whose parameters are always whole.
  void gather_full_parameters();
  /// Whether every rank's master weights (its owned shard) are finite; the same answer on every
  /// rank. Trainers check it before saving so a NaN/Inf model never replaces a good checkpoint.
  bool parameters_finite();

  /// Sharded, atomic checkpoint of parameters and optimizer state into directory `dir`; loads on
  /// any world size and stage. Shorthands of shardopt::save_checkpoint / load_checkpoint
  /// (shardopt/checkpoint.hpp, which also stores trainer state). Collective.
  void save_checkpoint(const std::string& dir);
  /// Loads what save_checkpoint (or shardopt::save_checkpoint) wrote, at any world size and stage.
  void load_checkpoint(const std::string& dir);

  /// The rule (hyper-parameters) parameter group `group` steps with, as torch LR schedulers and the
  /// Python bindings see it. Not collective. set_group_rule takes effect at the next step(); it
  /// must be the same kind of rule with the same state buffers (e.g. SGD momentum cannot go from
  /// 0 to non-zero, Adam's amsgrad cannot change). Factory-built optimizers keep their own.
  Rule group_rule(size_t group) const;
  /// Changes group `group`'s rule from the next step() on (see group_rule).
  void set_group_rule(size_t group, const Rule& rule);

  /// Parameter groups are fixed at construction (they decide the flat layout every rank shares):
  /// throws Error{InvalidArgument}. Torch's add_param_group is not virtual; a group added through
  /// a torch::optim::Optimizer& is reported by the next step().
  void add_param_group(const torch::optim::OptimizerParamGroup& group);

  /// ---- torch's state-dict contract (shardopt/state_dict.hpp) -------------------------------
  /// Gathers the full optimizer state onto world rank `to` (ZeroRedundancyOptimizer's
  /// consolidate_state_dict). Collective. Throws Error{Unsupported} for factory-built optimizers
  /// and for adamw8bit (its quantised state has no place in torch's format; its checkpoints hold
  /// it: Note [Quantised state in checkpoints]).
  void consolidate_state_dict(int to = 0);
  /// The state consolidate_state_dict gathered, on its rank `to`, as long as no step() ran since;
  /// elsewhere throws Error{InvalidArgument} saying to consolidate first. Not collective.
  const OptimizerStateDict& state_dict() const;
  /// Replaces the optimizer state (step count, every buffer) and the groups' hyper-parameters with
  /// a full state, as torch's load_state_dict does; parameters keep their values. Every rank
  /// passes the same state; each keeps its shard. Collective. Error{Mismatch} when the groups,
  /// parameters, shapes or state buffers are not those of this optimizer.
  void load_state_dict(const OptimizerStateDict& state);
  /// torch::save(opt, file) on the consolidated rank writes what torch::load into a
  /// torch::optim optimizer of the same rule (AdamW, Adam, SGD, Adagrad, RMSprop; LAMB has no
  /// torch counterpart) reads; torch::load(opt, file) on every rank loads such a file (collective).
  /// Anything else throws Error{Unsupported} or Error{InvalidArgument}, never writes an empty file.
  /// torch::load parses the file with torch's own reader before load() sees it, which trusts the
  /// sizes the file states (torch 1.13 also crashes on some corrupt archives:
  /// tests/fuzz/README.md); for files from anywhere, load_checkpoint and load_full_state_dict
  /// (checkpoint.hpp) are bounded.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Loads such a file (collective; see save()).
  void load(torch::serialize::InputArchive& archive) override;

 private:
  friend detail::ShardAccess& detail::shard_access(DistributedOptimizer& optimizer);
  void register_groups(const std::vector<ParamGroup>& groups);
  void check_groups_unchanged() const;
  void push_factory_lr();
  std::unique_ptr<detail::Engine> engine_;
  /// The parameters as given, by group (frozen and tied ones too): what torch's state dicts list.
  struct GivenParam {
    std::string name;
    int index = -1;  ///< its slot in the flat layout; -1 when frozen
  };
  std::vector<std::vector<GivenParam>> given_;
  std::unique_ptr<OptimizerStateDict> consolidated_;
  int64_t consolidated_step_ = -1;
  double factory_lr_ = -1.0;  ///< factory-built: the lr last handed to the torch optimizer
};

}  // namespace shardopt
