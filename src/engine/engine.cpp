// Engine: builds the pieces from the StagePlan, routes hook events to them, and runs step().
//
// Note [Stage 3 units]
// Parameters are gathered in parts (model_check.cpp): each declared unit's own parameters, one part
// per set of units sharing parameters (BERT's word embeddings, also the MLM decoder), and the root
// part, the parameters no unit declares. Buckets never span parts. Releasing a part frees its
// storage (StorageImpl::reset): the parameters keep their shape and autograd identity, and what
// autograd saved (the parameters or views of them) shares that storage, so gathering again before
// backward makes it valid again. A unit is gathered for each forward run and again at its outputs'
// backward hook; a part is released once all its gradients are in (a shared or re-run part stays
// gathered until its last backward use). The root part lives from zero_grad() (or the first unit)
// to step(); nothing stays gathered between steps. Every rank issues the gathers in the same order
// because passes visit units alike (as DDP assumes), and the reductions because buckets launch in
// layout order (Note [Bucket completion]). A scheduler decides every gather, prefetch and release
// (Note [One owner of releases]); the engine reports the moments, the store executes.
// Communication per micro-step (padded elements): each part is all-gathered once per forward run
// that needs it and once in backward, and reduce-scattered once; the root part once per step. With
// each unit run once and no sharing that is 3 * Psi, as docs/stages.md states; BERT's tied word
// embeddings add one all-gather of their part.
#include "engine/engine.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>

#include "engine/finite_check.hpp"
#include "engine/group_options.hpp"
#include "engine/placement.hpp"
#include "engine/whole_parameters.hpp"
#include "parallel/sequence_sums.hpp"
#include "shardopt/error.hpp"
#include "shardopt/memory_tracker.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "shardopt/recompute.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace shardopt::detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::function<void()> ready) : ready(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ready();
    return outputs;
  }
  std::function<void()> ready;
};

std::vector<at::Tensor> tensors_of(const std::vector<ModelParam>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}

// Stage 3 without declared units: units from the parameters' names (Note [Automatic units] in
// auto_gather.cpp). Without the release guard's key nothing can gather on use: every parameter is
// then in the root part, which persists (Note [Persistent parameters] in part_store.cpp).
UnitsPtr derived_units(const std::vector<ParamGroup>& groups, const UnitPolicy& policy,
                       bool report) {
  std::vector<std::string> names;
  std::vector<int64_t> numels, ids;
  std::vector<at::Tensor> tensors;
  std::unordered_map<const c10::TensorImpl*, int64_t> id_of;
  for (const auto& g : groups) {
    for (const auto& np : g.params) {
      if (!np.tensor.defined() || !np.tensor.requires_grad()) continue;
      names.push_back(np.name);
      numels.push_back(np.tensor.numel());
      auto [it, fresh] = id_of.emplace(np.tensor.unsafeGetTensorImpl(),
                                       static_cast<int64_t>(id_of.size()));
      ids.push_back(it->second);
      tensors.push_back(np.tensor);
    }
  }
  auto units = std::make_shared<Units>();
  if (!release_guard_available()) {
    if (report) {
      fmt::print(stderr, "shardopt: stage 3: automatic units need the dispatch key {} that "
                 "another library holds; every parameter stays gathered for good, as at stage "
                 "2\n", "TESTING_ONLY_GenericWrapper");
    }
    return units;
  }
  const DerivedUnits derived = derive_units(names, numels, ids, policy);
  for (size_t u = 0; u < derived.names.size(); ++u) {
    std::vector<at::Tensor> members;
    for (int i : derived.members[u]) members.push_back(tensors[i]);
    units->add(derived.names[u], std::move(members));
  }
  return units;
}

}  // namespace

Engine::Engine(torch::optim::Optimizer& owner, std::vector<ParamGroup> groups, Rule rule,
               ShardOptimizerFactory factory, CommunicatorPtr comm, ZeroOptions options)
    : owner_(owner), options_(std::move(options)) {
  SHARDOPT_CHECK(comm, InvalidArgument, "optimizer: the communicator is null");
  options_.validate();
  SHARDOPT_CHECK(!options_.grid.dp || options_.grid.dp->size() == comm->size(), InvalidArgument,
                 "optimizer: the communicator has {} rank(s) but ZeroOptions::grid's data-parallel "
                 "group has {}: pass grid.dp as the communicator",
                 comm->size(), options_.grid.dp ? options_.grid.dp->size() : 0);
  // Hybrid sharding: every piece works on the shard group's view (make_hybrid_communicator).
  ranks_.world = std::move(comm);
  ranks_.shard = options_.shard_group_size > 0
                     ? make_hybrid_communicator(ranks_.world, options_.shard_group_size)
                     : ranks_.world;
  comm_ = ranks_.shard;
  world_ = comm_->size();
  ranks_.replica = ranks_.world->rank() / world_;
  ranks_.replicas = ranks_.world->size() / world_;
  plan_ = StagePlan::make(options_.stage, options_.precision, options_.offload,
                          first_trainable_on_host(groups),
                          options_.reduce_dtype != Precision::FP32);
  // Note [Pipelines decide two defaults] in shardopt/detail/plan.hpp.
  plan_.defer_reduction = defers_reduction(options_.defer_reduction, pipeline_ranks());
  accumulation_ = options_.grad_accumulation_steps;
  if (plan_.loss_scaling) scaler_.emplace(options_.loss_scale);
  if (plan_.per_part()) {
    unit_plan_ = options_.units;
    if (!unit_plan_) {
      unit_plan_ = derived_units(groups, options_.unit_policy, ranks_.world->rank() == 0);
      automatic_ = true;
    }
  }
  model_ = collect_model(std::move(groups), rule, factory != nullptr, options_.precision,
                         plan_.per_part() ? unit_plan_.get() : nullptr);
  verify_same_model(params(), plan_.per_part(), *ranks_.world, options_.timeout);
  copy_shared_from_first_stage();
  build(rule, factory);
  attach_hooks();
  if (plan_.per_part() && !automatic_ && !model_.loose_names.empty() && comm_->rank() == 0) {
    fmt::print(stderr,
               "shardopt: stage 3: {} parameter(s) in no unit, gathered for every forward and "
               "backward until step(): {}\n",
               model_.loose_names.size(), fmt::join(model_.loose_names, ", "));
  }
  if (unit_plan_ && !automatic_) unit_plan_->attach(this);
}

// Where the update may read gradients per parameter (Note [Gradients where autograd left them] in
// gradient_reducer.cpp): one rank, in-place gradients in the master's dtype and device, no
// model-parallel grid, and a rule the kernels step.
bool Engine::reads_param_grads(const Rule& rule, bool factory) const {
  const auto group_of_one = [](const CommunicatorPtr& c) { return !c || c->size() == 1; };
  const ParallelGroups& grid = options_.grid;
  if (ranks_.world->size() != 1 || plan_.bucketed() || plan_.separate_master() ||
      !group_of_one(grid.tp) || !group_of_one(grid.pp) || grid.embedding ||
      flat_->model_options().device() != flat_->master_options().device() ||
      flat_->model_options().dtype() != flat_->master_options().dtype()) {
    return false;
  }
  for (const auto& p : params()) {  // sequence-parallel sums read the flat gradients
    const auto record = tp::record_of(p.tensor);
    if (record && record->group && record->group->size() > 1) return false;
  }
  return LocalUpdate::can_read_param_grads(rule, factory, options_.fused_update,
                                           flat_->master_options());
}

int Engine::pipeline_ranks() const { return options_.grid.pp ? options_.grid.pp->size() : 1; }

Engine::~Engine() {
  if (unit_plan_ && !automatic_) unit_plan_->detach(this);
  if (claimed_sequence_sums_) {  // the hooks sum again (Note [Sequence-parallel sums])
    for (const auto& p : params()) {
      const auto record = tp::record_of(p.tensor);
      if (record && record->sequence_parallel) release_sequence_sum(p.tensor);
    }
  }
  for (auto& h : hooks_) {
    if (h.accumulator && h.key) h.accumulator->del_post_hook(h.key);
  }
}

// The layout, the pieces and the initial values (where each buffer lives: Note [Placement] in
// shardopt/detail/plan.hpp).
void Engine::build(const Rule& rule, const ShardOptimizerFactory& factory) {
  const int root = plan_.per_part() ? model_.root_part : 0;
  std::vector<int64_t> numels;
  std::vector<int> groups, parts, part_of;  // part_of: the tracker's, -1 for the root part
  int64_t total = 0;
  for (const auto& p : params()) {
    numels.push_back(p.tensor.numel());
    total += numels.back();
    groups.push_back(p.group);
    if (plan_.per_part()) parts.push_back(p.part);
    part_of.push_back(plan_.per_part() && p.part != root ? p.part : -1);
  }
  const auto& proto = params().front().tensor;
  const int64_t elem = static_cast<int64_t>(proto.element_size());
  // 8-bit AdamW: parameters start, and shards end, on whole blocks (Note [Blockwise 8-bit state]).
  const int64_t block = std::holds_alternative<AdamW8bit>(rule) ? AdamW8bit::kBlock : 1;
  FlatLayout layout = make_layout(
      numels, groups, world_, std::lcm(block, std::max<int64_t>(1, options_.align_bytes / elem)),
      bucket_numel(options_.bucket_bytes, total, world_, elem), parts, block);
  const BufferOptions where = buffer_options(
      Placement::make(plan_, options_.precision, options_.reduce_dtype, options_.reduce_in_fp32,
                      proto.is_cpu()),
      proto.options());
  flat_ = std::make_unique<FlatState>(plan_, std::move(layout), comm_->rank(), where.model,
                                      where.master, where.reduce);
  tracker_ = std::make_unique<BackwardTracker>(std::move(part_of), root + 1);

  // Allocations by category: Note [Peak attribution] in shardopt/memory_tracker.hpp.
  if (plan_.per_part()) {
    // One part per declared unit, shared set and the root (Note [Stage 3 units]).
    auto labels = part_labels(model_, *unit_plan_);
    if (automatic_) labels.back() = "the persistent groups, gathered for good";
    std::vector<std::string> names;
    for (const auto& p : params()) names.push_back(p.name);
    auto parts = std::make_unique<PartStore>(*flat_, tensors_of(params()), std::move(names),
                                             std::move(labels), comm_, options_.timeout,
                                             /*root_persists=*/automatic_);
    if (automatic_) {  // Note [Automatic units] in auto_gather.cpp
      auto automatic = std::make_unique<AutoUnits>(
          *parts, options_.prefetch, options_.reuse_distance, comm_, options_.timeout);
      parts->set_automatic(automatic.get());
      scheduler_ = std::move(automatic);
    } else {
      scheduler_ = std::make_unique<DeclaredUnits>(*parts, model_.unit_parts, comm_,
                                                   options_.timeout, options_.prefetch);
    }
    scheduler_->hold_through_step(
        holds_parts_through_step(options_.reshard_between_uses, pipeline_ranks()));
    store_ = std::move(parts);
  } else {
    store_ = std::make_unique<WholeParameters>(*flat_, tensors_of(params()), comm_,
                                               options_.timeout);
  }
  // A scope lives to the end of its full expression: (scope(c), allocating call).
  auto scope = [](const char* category) { return MemoryScope(category, "optimizer"); };
  at::Tensor initial = (scope(plan_.per_part() ? "parameter shards" : "parameters"),
                        store_->adopt(where.initial, options_.broadcast_initial_params));
  (scope("optimizer state"), flat_->init_master(std::exchange(initial, at::Tensor())));
  reducer_ = (scope("gradients"),
              std::make_unique<GradientReducer>(*flat_, tensors_of(params()), comm_,
                                                options_.overlap_comm,
                                                options_.grad_accumulation_steps,
                                                options_.timeout,
                                                reads_param_grads(rule, factory != nullptr)));
  bucket_tag_ = MemoryScope::tag("gradient buckets", "optimizer");
  step_tag_ = MemoryScope::tag("step temporaries", "optimizer");
  MemoryScope state_scope("optimizer state", "optimizer");
  flat_->build_segments(
      [&](int b, const UpdatedRange& r) { return store_->model_slice(b, r); },
      [&](int b, const UpdatedRange& r) { return reducer_->reduced(b, r); });
  // Muon's update exchange is point-to-point, which the hybrid communicator does not carry.
  SHARDOPT_CHECK(!std::holds_alternative<Muon>(rule) || factory || comm_ == ranks_.world,
                 Unsupported,
                 "optimizer: muon does not run with hybrid sharding (shard_group_size {}) yet: its "
                 "update exchange needs point-to-point messages within the shard group; use "
                 "shard_group_size 0",
                 options_.shard_group_size);
  update_ = std::make_unique<LocalUpdate>(
      *flat_, comm_, options_.timeout, rule, factory,
      [this](int group) -> const Rule& { return group_rule_of(owner_, group); },
      options_.fused_update, [&] {
        std::vector<std::vector<int64_t>> shapes;
        for (const auto& p : params()) shapes.push_back(p.tensor.sizes().vec());
        return shapes;
      }());
  if (reducer_->direct()) {  // Note [Gradients where autograd left them] in gradient_reducer.cpp
    update_->read_param_grads(
        [this](int param) -> const at::Tensor& { return reducer_->param_grad(param); });
    reducer_->set_on_param_final([this](int param) {
      update_->check_param_early(param, options_.max_grad_norm > 0);
    });
  }
  wire_grid(rule);  // engine_grid.cpp
  // Note [The non-finite check during backward] in local_update.cpp.
  reducer_->set_on_reduced([this](int bucket) {
    update_->check_early(bucket, grad_divisor(), options_.max_grad_norm > 0);
  });
  checkpoint_ = std::make_unique<CheckpointAccess>(
      options_, ranks_, model_, *flat_, *store_, *update_, owner_, scaler_, steps_, [this] {
        stats_ = StepStats{};
        stats_.step = steps_;
        reducer_->take_comm_elements();
        store_->take_comm_elements();
        zero_grad();
      });
}

void Engine::attach_hooks() {
  for (size_t i = 0; i < params().size(); ++i) {
    Hook h;
    h.accumulator = torch::autograd::impl::grad_accumulator(params()[i].tensor);
    SHARDOPT_INTERNAL_ASSERT(h.accumulator != nullptr, "no grad accumulator for '{}'",
                             params()[i].name);
    const int index = static_cast<int>(i);
    h.key = h.accumulator->add_post_hook(
        std::make_unique<ReadyHook>([this, index] { on_grad_ready(index); }));
    hooks_.push_back(std::move(h));
  }
}

void Engine::mark_for_backward(int unit, const at::Tensor& output) {
  output.register_hook([this, unit](const at::Tensor&) {
    begin_pass();
    scheduler_->pre_backward(unit);
  });
}

// First event of a backward pass: arrange for on_backward_end when autograd finishes. In a
// pipeline step the runner says where passes are (chunk_backward): a zero-bubble input pass,
// whose units' output hooks fire too, is none.
void Engine::begin_pass() {
  if (tracker_->in_pass() || (pipeline_ && !in_chunk_)) return;
  check_micro_step_open();
  tracker_->begin_pass();
  // Past any nested backward of a recomputation (recompute.hpp): its end is not the pass's.
  queue_after_backward([this] {
    if (tracker_->in_pass() && held_passes_ == 0) on_backward_end();
  });
}

void Engine::as_one_backward(const std::function<void()>& fn) {
  ++held_passes_;
  try {
    fn();
  } catch (...) {
    --held_passes_;
    throw;
  }
  if (--held_passes_ == 0 && tracker_->in_pass()) on_backward_end();
}

// The pipeline's passes are the step's (Note [Pipeline handshake] in src/pipeline/runner.cpp).
void Engine::begin_pipeline(int chunks, int microbatches) {
  SHARDOPT_CHECK(chunks >= 1 && microbatches >= 1, InvalidArgument,
                 "optimizer: a pipeline step of {} chunks and {} micro-batches, expected at "
                 "least one of each",
                 chunks, microbatches);
  SHARDOPT_CHECK(tracker_->micro_steps() == 0 && !tracker_->in_pass(), InvalidArgument,
                 "optimizer: run_pipeline with PipelineRunOptions::optimizer began after {} "
                 "backward pass(es) since the last step(); a pipeline step's backward passes all "
                 "come from one run_pipeline call (call step() or zero_grad() first)",
                 tracker_->micro_steps() + (tracker_->in_pass() ? 1 : 0));
  pipeline_ = true;
  accumulation_ = chunks * microbatches;
  reducer_->begin_pipeline(accumulation_);
}

void Engine::chunk_backward(int chunk, bool last, const std::function<void()>& pass) {
  (void)chunk;  // the buckets know their parameters; the chunk names nothing more yet
  SHARDOPT_CHECK(pipeline_, InvalidArgument,
                 "optimizer: chunk_backward outside a pipeline step (begin_pipeline first)");
  in_chunk_ = true;
  reducer_->set_last_pass_of_chunk(last);
  try {
    // Opened here, a pass even where no gradient reaches this optimizer; closed by
    // as_one_backward, not by autograd's final callback (none is queued).
    SHARDOPT_CHECK(!tracker_->in_pass(), InvalidArgument,
                   "optimizer: a pipeline chunk's backward pass began inside another pass");
    check_micro_step_open();
    tracker_->begin_pass();
    as_one_backward(pass);
  } catch (...) {
    in_chunk_ = false;
    throw;
  }
  in_chunk_ = false;
  reducer_->set_last_pass_of_chunk(false);
}

void Engine::end_pipeline() { pipeline_ = false; }

// The path of a gradient: hook -> tracker (once per pass) -> reducer (Note [Bucket completion]) ->
// at stage 3, the scheduler's post-backward moment once all of a part is in.
void Engine::on_grad_ready(int index) {
  MemoryScope scope(bucket_tag_);
  begin_pass();
  const auto arrival = tracker_->arrive(index);
  if (arrival.duplicate) return;  // reentrant double fire: counted once
  reducer_->accept(index, tracker_->micro_steps());
  if (arrival.part_complete) scheduler_->post_backward(params()[index].part);
}

void Engine::on_backward_end() {
  if (scheduler_) scheduler_->end_backward();
  reducer_->end_pass(tracker_->micro_steps());
  tracker_->end_pass();
}

// One rule at every stage: at most grad_accumulation_steps backward passes per step(). Checked
// before autograd runs when the pass comes through backward(), and by the first hook of a plain
// loss.backward() (in-place gradients of one parameter may already hold the extra pass then).
void Engine::check_micro_step_open() const {
  const int k = accumulation_;
  SHARDOPT_CHECK(tracker_->micro_steps() < k, InvalidArgument,
                 "optimizer: backward pass {} since the last step(), but {} is {}; call "
                 "backward() at most that many times per step() (zero_grad() starts over)",
                 tracker_->micro_steps() + 1,
                 pipeline_ ? "the pipeline's v*m" : "grad_accumulation_steps", k);
}

// Note [Gradient accumulation convention]: gradients of the k = grad_accumulation_steps
// micro-steps are summed, and backward(loss) scales the loss by 1/k (DeepSpeed's convention). So
// opt.backward(loss) and torch's (and FSDP's) own (loss / k).backward() both give the gradient of
// the average loss over the big batch; nothing divides by k behind the caller's back.
void Engine::backward(const at::Tensor& loss) {
  if (!tracker_->in_pass()) check_micro_step_open();
  const double factor =
      (scaler_ ? scaler_->scale() : 1.0) / static_cast<double>(options_.grad_accumulation_steps);
  (factor != 1.0 ? loss * factor : loss).backward();
  if (tracker_->in_pass()) on_backward_end();  // no final callback ran (no hook fired)
}

// Note [step() consumes the gradients]: a trainer may hold only a torch::optim::Optimizer&, whose
// zero_grad() on torch 1.13 is the base's (not virtual) and resets nothing of ours. So step()
// itself starts the gradients and the micro-step count over (end_step); zero_grad() repeats that,
// discarding a backward's gradients (Note [Gradients start over without a zeroing pass]).
void Engine::zero_grad() {
  end_pipeline_step();
  reducer_->start_over();
  update_->forget_early();
  tracker_->reset_micro_steps();
  if (scheduler_) scheduler_->start_forward();  // stage 3: a forward follows
}

at::Tensor Engine::step(const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode grad_mode(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  MemoryScope scope(step_tag_);
  const auto t0 = Clock::now();
  stats_ = StepStats{};
  stats_.step = steps_;
  finish_reduction();
  if (!skip_non_finite()) {
    clip();
    update();
    after_update();
    ++steps_;
  }
  end_step(t0);
  return loss;
}

// Phase 1: every bucket reduced and folded in (summed over ranks and micro-steps).
void Engine::finish_reduction() {
  RECORD_FUNCTION("shardopt::reduce", std::vector<c10::IValue>());
  const auto t = Clock::now();
  MemoryScope scope(bucket_tag_);
  if (tracker_->in_pass()) on_backward_end();
  if (reducer_->nothing_launched()) {
    // step() without backward() through our hooks (e.g. gradients set by hand): reduce now.
    tracker_->count_manual_micro_step();
    reducer_->reduce_manual(tracker_->micro_steps());
  }
  reducer_->complete_all();
  stats_.reduce_wait_s = seconds_since(t);
  stats_.reduce_wait_backward_s = reducer_->take_backward_wait_s();
}

// Phase 2: gradients unscaled and checked in one pass, with the global norm when clipping:
// non-finite gradients on any rank mean no update anywhere. fp16's scaler backs off; without one,
// max_nonfinite_steps skipped steps in a row throw on every rank (they agree on the flag).
bool Engine::skip_non_finite() {
  RECORD_FUNCTION("shardopt::skip_non_finite", std::vector<c10::IValue>());
  for (int b = 0; b < static_cast<int>(flat_->layout().buckets.size()); ++b) {
    if (reducer_->written_after_reduced(b)) update_->recheck(b);
  }
  const bool non_finite =
      update_->unscale_and_check(grad_divisor(), options_.max_grad_norm > 0, stats_);
  if (scaler_) {
    stats_.loss_scale = scaler_->scale();
    stats_.skipped = scaler_->update(non_finite);
    return stats_.skipped;
  }
  stats_.skipped = non_finite;
  nonfinite_run_ = non_finite ? nonfinite_run_ + 1 : 0;
  stats_.nonfinite_steps = nonfinite_run_;
  if (non_finite && options_.max_nonfinite_steps > 0 &&
      nonfinite_run_ >= options_.max_nonfinite_steps) {
    nonfinite_run_ = 0;
    SHARDOPT_FAIL(NonFinite,
                  "optimizer: gradients were NaN/Inf on some rank in {} consecutive steps (all "
                  "skipped, parameters unchanged since step {}); check the loss and the learning "
                  "rate, or raise ZeroOptions::max_nonfinite_steps (0: only skip)",
                  options_.max_nonfinite_steps, steps_);
  }
  return non_finite;
}

// Reduced gradients are sums over ranks of loss-scaled ones: the unscale divides by this.
double Engine::grad_divisor() const {
  return static_cast<double>(world_) * (scaler_ ? scaler_->scale() : 1.0);
}

// Phase 3: global gradient-norm clipping (the norm was computed by phase 2).
void Engine::clip() {
  if (options_.max_grad_norm <= 0) return;
  RECORD_FUNCTION("shardopt::clip", std::vector<c10::IValue>());
  const auto t = Clock::now();
  stats_.clipped = update_->clip(options_.max_grad_norm, stats_.grad_norm);
  stats_.clip_s = seconds_since(t);
}

// Phase 4: the local update of this rank's segments, cast into the model's dtype.
void Engine::update() {
  RECORD_FUNCTION("shardopt::update", std::vector<c10::IValue>());
  const auto t = Clock::now();
  update_->update(steps_ + 1, &stats_);
  stats_.update_s = seconds_since(t);
  const auto w = Clock::now();
  update_->write_back();
  stats_.write_back_s = seconds_since(w);
}

// Phase 5: parameters whole again where the model reads them (all-gather, or parts released).
void Engine::after_update() {
  RECORD_FUNCTION("shardopt::gather", std::vector<c10::IValue>());
  const auto t = Clock::now();
  store_->after_update();
  if (scheduler_) scheduler_->after_step();
  stats_.gather_s = seconds_since(t);
}

// The bookkeeping every step() ends with, taken or skipped.
void Engine::end_step(Clock::time_point t0) {
  stats_.step = steps_;
  tracker_->reset_micro_steps();
  end_pipeline_step();
  reducer_->start_over();  // Note [step() consumes the gradients]
  stats_.gather_elements = store_->take_comm_elements();
  stats_.reduce_elements = reducer_->take_comm_elements();
  stats_.comm_elements = stats_.reduce_elements + stats_.gather_elements;
  stats_.step_s = seconds_since(t0);
}

// The master weights (each rank's owned slices) through the gradients' check.
bool Engine::parameters_finite() {
  at::NoGradGuard no_grad;
  FiniteScan scan;
  for (int b = 0; b < static_cast<int>(flat_->layout().buckets.size()); ++b) {
    add_scan(scan, scan_local(checkpoint_->owned_param_slice(b), 1.0, false));
  }
  return !agree_on(scan, false, comm_.get(), options_.timeout).non_finite;
}

MemoryReport Engine::memory() const {
  MemoryReport m;
  m.param_bytes = store_->param_bytes();
  m.grad_bytes = reducer_->grad_bytes();
  m.optimizer_state_bytes = flat_->state_bytes();
  m.buffer_bytes = store_->gathered_bytes() + reducer_->buffer_bytes();
  m.persistent_param_bytes = store_->persistent_bytes();
  m.snapshot_host_bytes = checkpoint_->snapshot_host_bytes();
  return m;
}

}  // namespace shardopt::detail
