// Engine: DistributedOptimizer's machinery. It builds the pieces from one StagePlan, routes the
// autograd and stage-3 unit events to them and runs step() as five named phases. Each piece owns
// its state:
//   FlatState        (flat_state.hpp)        layout, coordinates, master weights, optimizer state
//   ParameterStore   (parameter_store.hpp)   the model's parameters: whole, or parts (stage 3)
//   PartScheduler    (part_scheduler.hpp)    stage 3: when each part is gathered and released
//   GradientReducer  (gradient_reducer.hpp)  gradient sinks, bucket pool, reduction collectives
//   BackwardTracker  (backward_tracker.hpp)  micro-steps, duplicate hooks, which parts are complete
//   LocalUpdate      (local_update.hpp)      unscale, non-finite check, clip, the rules and kernels
// What checkpoints read and write (ShardAccess) is CheckpointAccess over the same pieces.
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "engine/backward_tracker.hpp"
#include "engine/checkpoint_access.hpp"
#include "engine/flat_state.hpp"
#include "engine/gradient_reducer.hpp"
#include "engine/local_update.hpp"
#include "engine/model_check.hpp"
#include "engine/parameter_store.hpp"
#include "engine/part_store.hpp"
#include "engine/part_scheduler.hpp"
#include "shardopt/detail/plan.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/optimizer_types.hpp"
#include "shardopt/options.hpp"
#include "shardopt/rules.hpp"
#include "shardopt/units.hpp"

namespace shardopt::detail {

class Engine final : public UnitRuntime {
 public:
  Engine(torch::optim::Optimizer& owner, std::vector<ParamGroup> groups, Rule rule,
         ShardOptimizerFactory factory, CommunicatorPtr comm, ZeroOptions options);
  ~Engine() override;

  at::Tensor step(const torch::optim::Optimizer::LossClosure& closure);
  void zero_grad();
  void backward(const at::Tensor& loss);
  void as_one_backward(const std::function<void()>& fn);
  // PipelineOptimizer (Note [Pipeline handshake] in src/pipeline/runner.cpp).
  void begin_pipeline(int chunks, int microbatches);
  void chunk_backward(int chunk, bool last, const std::function<void()>& pass);
  void end_pipeline();
  const StepStats& last_step() const { return stats_; }
  MemoryReport memory() const;
  const ZeroOptions& options() const { return options_; }
  // The communicator the optimizer was given (under hybrid sharding comm() is the shard group's).
  const CommunicatorPtr& communicator() const { return ranks_.world; }
  int64_t numel() const { return flat_->layout().numel; }
  int64_t padded_numel() const { return flat_->layout().padded_numel; }
  void gather_full_parameters() {
    if (scheduler_) scheduler_->gather_all();
  }
  bool parameters_finite();
  // The torch param groups DistributedOptimizer registers, and their rules.
  const CollectedModel& model() const { return model_; }
  torch::optim::Optimizer* factory_optimizer() const { return update_->factory_optimizer(); }

  // UnitRuntime (stage 3): called by Units::run and the output hooks.
  void enter(int unit) override { scheduler_->pre_forward(unit, tracker_->in_pass()); }
  void exit(int unit) override { scheduler_->post_forward(unit); }
  void mark_for_backward(int unit, const at::Tensor& output) override;

  // What src/checkpoint reads and writes.
  ShardAccess& checkpoint_access() { return *checkpoint_; }

 private:
  using Clock = std::chrono::steady_clock;
  const std::vector<ModelParam>& params() const { return model_.params; }
  // The grid's pipeline size (1 without one): Note [Pipelines decide two defaults].
  int pipeline_ranks() const;
  // Whether the update reads each parameter's gradient where autograd left it (one rank).
  bool reads_param_grads(const Rule& rule, bool factory) const;

  void build(const Rule& rule, const ShardOptimizerFactory& factory);
  // engine_grid.cpp: the grid's groups and sums, wired once by build().
  void wire_grid(const Rule& rule);
  std::vector<char> pipeline_shared_slots() const;
  void claim_sequence_sums();
  void copy_shared_from_first_stage();
  void attach_hooks();
  // Autograd events.
  void begin_pass();
  void check_micro_step_open() const;
  void on_grad_ready(int index);
  void on_backward_end();
  // The phases of step().
  void finish_reduction();
  double grad_divisor() const;
  bool skip_non_finite();
  void clip();
  void update();
  void after_update();
  void end_step(Clock::time_point t0);
  // The step's micro-steps are grad_accumulation_steps again (the reducer's: start_over()).
  void end_pipeline_step() {
    pipeline_ = in_chunk_ = false;
    accumulation_ = options_.grad_accumulation_steps;
  }

  torch::optim::Optimizer& owner_;
  Ranks ranks_;
  CommunicatorPtr comm_;  // ranks_.shard: what the pieces shard over
  ZeroOptions options_;
  StagePlan plan_;
  int world_ = 1;
  CollectedModel model_;
  UnitsPtr unit_plan_;  // stage 3: the model's declared units (attached to this engine)
  bool automatic_ = false;  // stage 3: unit_plan_ derived from names (Note [Automatic units])
  std::optional<LossScaler> scaler_;  // fp16
  std::unique_ptr<FlatState> flat_;
  // Stage 3; before store_: the store unregisters it on destruction.
  std::unique_ptr<PartScheduler> scheduler_;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<LocalUpdate> update_;
  std::unique_ptr<BackwardTracker> tracker_;
  std::unique_ptr<CheckpointAccess> checkpoint_;
  struct Hook {
    // std::shared_ptr<Node> up to torch 2.x, c10::intrusive_ptr<Node> in recent releases.
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
    uintptr_t key = 0;
  };
  std::vector<Hook> hooks_;
  int64_t steps_ = 0;
  int bucket_tag_ = 0, step_tag_ = 0;  // MemoryScope tags (Note [Peak attribution])
  int nonfinite_run_ = 0;  // consecutive steps skipped for non-finite gradients (no loss scaler)
  bool claimed_sequence_sums_ = false;  // Note [Sequence-parallel sums]
  int held_passes_ = 0;  // as_one_backward() calls in progress: autograd's end is not the pass's
  // The step's micro-steps: grad_accumulation_steps, or a pipeline's v*m (begin_pipeline).
  int accumulation_ = 1;
  bool pipeline_ = false;  // between begin_pipeline and end_pipeline
  bool in_chunk_ = false;  // inside chunk_backward
  StepStats stats_;
};

}  // namespace shardopt::detail
