// Engine: builds the pieces from the StagePlan, routes hook events to them, and runs step().
//
// Note [Flat layout]
// Trainable parameters (deduplicated: tied weights appear once; frozen ones are left out) are
// sorted by parameter group and, within a group, placed in reverse registration order, which is
// roughly the order backward produces their gradients. They are packed into buckets of about
// bucket_bytes (Note [Default bucket size] when 0); a parameter larger than the space left in a bucket fills it and continues in the
// next (the split falls at a multiple of world * align, so the parameter stays contiguous in the
// full flat buffer and its view stays one view). Each bucket is padded to a multiple of
// world * align so it splits evenly, and rank r owns [r*S, (r+1)*S) of every bucket. Model
// parameters become views into flat storage, so the optimizer updates them with no copy. A bucket
// is the unit of one collective and is complete once every piece in it has its gradient.
//
// Note [Stages] (what src/engine/plan.hpp turns each stage into)
//   stage 0: Replicated, InPlace gradients (flat buffer, .grad are views), each complete bucket
//            all-reduced in place; every rank updates the whole buffer.
//   stage 1: Sharded: buckets are reduce-scattered into the owned slice; each rank updates its
//            slices; then every bucket is all-gathered in place.
//   stage 2: + Bucketed gradients: a hook copies each fresh .grad into a pooled bucket buffer and
//            frees it; a complete bucket is reduce-scattered and folded into the gradient shard.
//   stage 3: + PerUnit parameters (Note [Stage 3 units]).
// fp16/bf16 and offload make the master Separate and the gradients Bucketed at every stage.
//
// Note [Stage 3 units]
// Parameters are gathered in parts (src/engine/model_check.cpp): each declared unit's own
// parameters; one part per set of units sharing parameters (BERT's word embeddings, declared by
// the embeddings unit and by the heads that reuse them as the MLM decoder); and the root part, the
// parameters no unit declares. Buckets never span parts. A part is gathered by allocating storage
// for its full buffer and all-gathering each bucket's shards into it; it is released by freeing
// that storage (StorageImpl::reset), so the model's parameters keep their shape and autograd
// identity but hold no bytes. Autograd saved the parameters themselves (or views of them), which
// share the StorageImpl, so gathering again before a unit's backward makes them valid again.
// Forward: Units::run enters (gather the unit's parts; prefetch the next units of the last pass's
// order) and exits (release the parts no running unit needs); a unit may run several times, and is
// gathered for each run. Backward: a hook on each run's outputs gathers the unit's parts
// (prefetching the unit backward reaches next); once every parameter of a part has its gradient
// (the bucketed path reduce-scatters them), the part is released; a shared part or one run twice
// stays gathered between its backward uses (its gradients arrive after the last one). The root
// part is gathered before the forward (zero_grad() or the first unit entered) and released by
// step(); nothing stays gathered between steps. Collectives are issued in the same order on every
// rank because forward and backward visit units in the same order everywhere (as DDP assumes of
// its buckets).
//
// Communication per micro-step at stage 3 (elements, padded): each part is all-gathered once per
// forward run of a unit that needs it and once in backward, and reduce-scattered once; the root
// part is all-gathered once per step instead. With every unit run once and no sharing that is
// 3 * Psi per micro-step, as DESIGN.md states; BERT's shared word embeddings, run at the lookup and
// at the decoder, add one all-gather of that part.
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

#include "engine/finite_check.hpp"
#include "shardopt/error.hpp"

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

std::vector<std::string> names_of(const std::vector<ModelParam>& params) {
  std::vector<std::string> out;
  for (const auto& p : params) out.push_back(p.name);
  return out;
}

// How a released parameter's error names the units that gather its part (release_guard.hpp):
// "unit 'layer'", "units 'embeddings', 'heads'" for a shared part, "no unit" for the root part.
std::vector<std::string> part_labels(const CollectedModel& model, const Units& units) {
  std::vector<std::vector<std::string>> users(model.root_unit + 1);
  for (size_t u = 0; u < model.unit_parts.size(); ++u) {
    for (int part : model.unit_parts[u]) {
      users[part].push_back(fmt::format("'{}'", units.name(static_cast<int>(u))));
    }
  }
  std::vector<std::string> labels;
  for (const auto& names : users) {
    labels.push_back(names.empty()       ? std::string("no unit: gathered from zero_grad() to step()")
                     : names.size() == 1 ? fmt::format("unit {}", names[0])
                                         : fmt::format("units {}", fmt::join(names, ", ")));
  }
  return labels;
}

}  // namespace

Engine::Engine(torch::optim::Optimizer& owner, std::vector<ParamGroup> groups, Rule rule,
               ShardOptimizerFactory factory, CommunicatorPtr comm, ZeroOptions options)
    : owner_(owner), world_comm_(std::move(comm)), options_(std::move(options)) {
  SHARDOPT_CHECK(world_comm_, InvalidArgument, "optimizer: the communicator is null");
  options_.validate();
  // Hybrid sharding: every piece works on the shard group's view (make_hybrid_communicator).
  comm_ = options_.shard_group_size > 0
              ? make_hybrid_communicator(world_comm_, options_.shard_group_size)
              : world_comm_;
  world_ = comm_->size();
  replica_ = world_comm_->rank() / world_;
  replicas_ = world_comm_->size() / world_;
  plan_ = StagePlan::make(options_.stage, options_.precision, options_.offload,
                          first_trainable_on_host(groups),
                          options_.reduce_dtype != Precision::FP32);
  if (plan_.loss_scaling) scaler_.emplace(options_.loss_scale);
  if (plan_.per_unit()) unit_plan_ = options_.units;
  model_ = collect_model(std::move(groups), rule, factory != nullptr, options_.precision,
                         plan_.per_unit() ? unit_plan_.get() : nullptr);
  verify_same_model(params(), plan_.per_unit(), *world_comm_, options_.timeout);
  build(rule, factory);
  attach_hooks();
  if (plan_.per_unit() && !model_.loose_names.empty() && comm_->rank() == 0) {
    fmt::print(stderr,
               "shardopt: stage 3: {} parameter(s) in no unit, gathered for every forward and "
               "backward until step(): {}\n",
               model_.loose_names.size(), fmt::join(model_.loose_names, ", "));
  }
  if (unit_plan_) unit_plan_->attach(this);
}

Engine::~Engine() {
  if (unit_plan_) unit_plan_->detach(this);
  for (auto& h : hooks_) {
    if (h.accumulator && h.key) h.accumulator->del_post_hook(h.key);
  }
  // The pieces' destructors let outstanding collectives land before their buffers go.
}

// Where everything lives (Note [Mixed precision] in shardopt/precision.hpp): the model's
// parameters in the compute dtype on their device; master weights, optimizer state and reduced
// gradients in fp32 (mixed) on the host (offload) or next to the parameters.
void Engine::build(const Rule& rule, const ShardOptimizerFactory& factory) {
  std::vector<int64_t> numels;
  std::vector<int> groups, units, unit_of;
  std::vector<std::vector<int>> buckets_of;
  for (const auto& p : params()) {
    numels.push_back(p.tensor.numel());
    groups.push_back(p.group);
    if (plan_.per_unit()) units.push_back(p.unit);
  }
  const auto& proto = params().front().tensor;
  const int64_t elem = static_cast<int64_t>(proto.element_size());
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  FlatLayout layout =
      make_layout(numels, groups, world_, std::max<int64_t>(1, options_.align_bytes / elem),
                  bucket_numel_for(options_.bucket_bytes, total, world_, elem), units);
  const auto base = proto.options().requires_grad(false);
  const auto model_options = base.dtype(plan_.mixed ? compute_dtype(options_.precision)
                                                    : proto.scalar_type());
  auto master_options = base.dtype(plan_.mixed ? at::kFloat : proto.scalar_type());
  if (plan_.master_on_host) {
    master_options = master_options.device(at::kCPU).pinned_memory(!proto.is_cpu());
  }
  // Gradients travel in reduce_dtype when set, else fp32 (mixed, reduce_in_fp32) or the model's.
  const auto reduce_options = model_options.dtype(
      options_.reduce_dtype != Precision::FP32 ? compute_dtype(options_.reduce_dtype)
      : plan_.mixed && options_.reduce_in_fp32 ? at::kFloat
                                               : model_options.dtype().toScalarType());
  for (int i = 0; i < static_cast<int>(layout.slots.size()); ++i) {
    buckets_of.emplace_back();
    for (const ParamPiece* p = layout.pieces_begin(i); p != layout.pieces_end(i); ++p) {
      buckets_of.back().push_back(p->bucket);
    }
  }
  const int root = plan_.per_unit() ? model_.root_unit : 0;
  for (const auto& p : params()) unit_of.push_back(plan_.per_unit() && p.unit != root ? p.unit : -1);
  const int bucket_count = static_cast<int>(layout.buckets.size());
  flat_ = std::make_unique<FlatState>(plan_, std::move(layout), comm_->rank(), model_options,
                                      master_options, reduce_options);
  tracker_ = std::make_unique<BackwardTracker>(std::move(buckets_of), unit_of, bucket_count, root + 1);

  // Initial values, full and in master precision: rank 0's reach every rank (as DDP does), then
  // become the model's storage and the master weights. Stage 3 moves them over bucket by bucket
  // into this rank's shard instead (ParameterStore::adopt_shards), never holding a second copy.
  if (plan_.per_unit()) {
    at::NoGradGuard no_grad;
    store_ = std::make_unique<ParameterStore>(*flat_, tensors_of(params()), names_of(params()),
                                              part_labels(model_, *unit_plan_), model_.unit_parts,
                                              comm_, options_.timeout, options_.prefetch);
    const at::Tensor initial = store_->adopt_shards(base.dtype(master_options.dtype()),
                                                    options_.broadcast_initial_params);
    flat_->init_master_shard(initial);
  } else {
    at::NoGradGuard no_grad;
    const auto& lay = flat_->layout();
    // Note [One copy at construction] (stages 0-2): the flat buffer is one allocation (buckets
    // split parameters, so no boundary between parameters is also one between buckets), but its
    // pages are touched only as it fills: each parameter is copied in (ranks that receive rank
    // 0's values skip the copy) and, when the model keeps the master's dtype and device, becomes
    // its view at once, so its original storage is freed before the next one is copied. The
    // resident peak is about one model plus one parameter; an allocator that reserves (a device,
    // the bench's tracker) still counts the model plus the flat buffer.
    at::Tensor initial = at::empty({lay.padded_numel}, base.dtype(master_options.dtype()));
    const bool same_storage = initial.dtype() == model_options.dtype() &&
                              initial.device() == model_options.device();
    const bool receives = options_.broadcast_initial_params && world_ > 1 && comm_->rank() != 0;
    for (const auto& bl : lay.buckets) {  // padding: alignment gaps and each bucket's tail
      int64_t end = 0;
      for (int k : bl.pieces) {
        const auto& piece = lay.pieces[k];
        if (piece.offset > end) initial.narrow(0, bl.flat_offset + end, piece.offset - end).zero_();
        end = std::max(end, piece.offset + piece.numel);
      }
      if (bl.padded > end) initial.narrow(0, bl.flat_offset + end, bl.padded - end).zero_();
    }
    for (size_t i = 0; i < params().size(); ++i) {
      auto& param = params()[i].tensor;
      at::Tensor slot = initial.narrow(0, lay.flat_offset(static_cast<int>(i)), lay.slots[i].numel);
      if (!receives) slot.copy_(param.reshape(-1));
      if (same_storage) param.set_data(slot.view(param.sizes()));
    }
    if (options_.broadcast_initial_params && world_ > 1) {
      comm_->broadcast(initial, 0, true)->wait(options_.timeout);
    }
    store_ = std::make_unique<ParameterStore>(*flat_, tensors_of(params()), names_of(params()),
                                              std::vector<std::string>{"the whole model"},
                                              std::vector<std::vector<int>>{}, comm_,
                                              options_.timeout, options_.prefetch);
    store_->adopt(initial);
    flat_->init_master(initial);
  }
  reducer_ = std::make_unique<GradientReducer>(*flat_, tensors_of(params()), comm_,
                                               options_.overlap_comm, options_.timeout);
  flat_->build_segments(
      [&](int b, const UpdatedRange& r) { return store_->model_slice(b, r); },
      [&](int b, const UpdatedRange& r) { return reducer_->reduced(b, r); });
  update_ = std::make_unique<LocalUpdate>(
      *flat_, comm_, options_.timeout, rule, factory,
      [this](int group) -> const Rule& { return current_rule(group); }, options_.fused_update);
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
    store_->before_backward(unit);
  });
}

// ---- autograd events ----------------------------------------------------------------------------

// First event of a backward pass: arrange for on_backward_end when autograd finishes.
void Engine::begin_pass() {
  if (tracker_->in_pass()) return;
  check_micro_step_open();
  tracker_->begin_pass();
  torch::autograd::Engine::get_default_engine().queue_callback([this] {
    if (tracker_->in_pass()) on_backward_end();
  });
}

void Engine::on_grad_ready(int index) {
  begin_pass();
  const auto& p = params()[index];
  const auto arrival = tracker_->arrive(index);
  if (arrival.duplicate) return;  // reentrant double fire: counted once
  const int micro = tracker_->micro_steps();
  const bool launch = options_.overlap_comm && reduces_this_micro_step();
  // Piece by piece: a bucket this arrival completes is launched before the next piece needs a
  // buffer, so the pool stays at two buffers however many buckets the parameter spans.
  reducer_->accept(index, micro, [&](int bucket) {
    const auto& done = arrival.complete_buckets;
    if (launch && std::find(done.begin(), done.end(), bucket) != done.end()) {
      reducer_->launch(bucket, micro);
    }
  });
  // Every parameter of the unit has its gradient: its backward is over, free it.
  if (arrival.unit_complete) store_->release(p.unit);
}

bool Engine::reduces_this_micro_step() const {
  return plan_.reduces_every_micro_step() ||
         tracker_->micro_steps() + 1 >= options_.grad_accumulation_steps;
}

// End of one backward pass: reduce what is still pending (buckets with unused parameters, or all
// of them without overlap) when this micro-step communicates.
void Engine::on_backward_end() {
  if (plan_.per_unit()) store_->end_backward();
  if (reduces_this_micro_step()) {
    const int micro = tracker_->micro_steps();
    for (int b = 0; b < reducer_->buckets(); ++b) {
      if (!reducer_->launched_in(b, micro)) reducer_->launch(b, micro);
    }
  }
  tracker_->end_pass();
}

// One rule at every stage: at most grad_accumulation_steps backward passes per step(). Checked
// before autograd runs when the pass comes through backward(), and by the first hook of a plain
// loss.backward() (in-place gradients of one parameter may already hold the extra pass then).
void Engine::check_micro_step_open() const {
  const int k = options_.grad_accumulation_steps;
  SHARDOPT_CHECK(tracker_->micro_steps() < k, InvalidArgument,
                 "optimizer: backward pass {} since the last step(), but "
                 "grad_accumulation_steps is {}; call backward() at most grad_accumulation_steps "
                 "times per step() (zero_grad() starts over)",
                 tracker_->micro_steps() + 1, k);
}

// Note [Gradient accumulation convention]: gradients of the k = grad_accumulation_steps
// micro-steps are summed, and backward(loss) scales the loss by 1/k (DeepSpeed's convention). So
// opt.backward(loss) and torch's (and FSDP's) own (loss / k).backward() both give the gradient of
// the average loss over the big batch; nothing divides by k behind the caller's back.
void Engine::backward(const at::Tensor& loss) {
  if (!tracker_->in_pass()) check_micro_step_open();
  const double factor =
      (scaler_ ? scaler_->scale() : 1.0) / static_cast<double>(options_.grad_accumulation_steps);
  if (factor != 1.0) {
    (loss * factor).backward();
  } else {
    loss.backward();
  }
  if (tracker_->in_pass()) on_backward_end();  // no final callback ran (no hook fired)
}

void Engine::zero_grad() {
  reducer_->zero();
  tracker_->reset_micro_steps();
  store_->gather_root();  // stage 3: parameters in no unit, for the forward that follows
}

// ---- step() ---------------------------------------------------------------------------------------

at::Tensor Engine::step(const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode grad_mode(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  const auto t0 = Clock::now();
  stats_ = StepStats{};
  stats_.step = steps_;
  finish_reduction();
  if (skip_non_finite()) {
    end_step(t0);
    return loss;
  }
  clip();
  update();
  after_update();
  ++steps_;
  end_step(t0);
  return loss;
}

// Phase 1: every bucket reduced and folded in; gradients averaged over ranks, summed over
// micro-steps (Note [Gradient accumulation convention]); phase 2 unscales them.
void Engine::finish_reduction() {
  RECORD_FUNCTION("shardopt::reduce", std::vector<c10::IValue>());
  const auto t = Clock::now();
  if (tracker_->in_pass()) on_backward_end();
  if (reducer_->nothing_launched()) {
    // step() without backward() through our hooks (e.g. gradients set by hand): reduce now.
    reducer_->accept_manual();
    tracker_->count_manual_micro_step();
    for (int b = 0; b < reducer_->buckets(); ++b) reducer_->launch(b, tracker_->micro_steps());
  }
  reducer_->complete_all();
  stats_.reduce_wait_s = seconds_since(t);
}

// Phase 2: gradients unscaled (averaged over ranks, divided by the loss scale) and checked in one
// pass (src/engine/finite_check.hpp), with the global norm when clipping: non-finite gradients on
// any rank, at every precision, mean no update anywhere, parameters and optimizer state untouched.
// fp16's scaler backs off; without one, options_.max_nonfinite_steps skipped steps in a row throw
// on every rank (they agree on the flag).
bool Engine::skip_non_finite() {
  RECORD_FUNCTION("shardopt::skip_non_finite", std::vector<c10::IValue>());
  const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const bool clipping = options_.max_grad_norm > 0;
  const auto check =
      update_->unscale_and_check(static_cast<double>(world_) * loss_scale, clipping);
  if (clipping) stats_.grad_norm = check.norm;
  stats_.unscale_s = check.unscale_s;
  stats_.check_s = check.check_s;
  const bool non_finite = check.non_finite;
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
  update_->update(steps_ + 1);
  stats_.update_s = seconds_since(t);
  const auto w = Clock::now();
  flat_->write_back_master();
  stats_.write_back_s = seconds_since(w);
}

// Phase 5: parameters whole again where the model reads them (all-gather, or units released).
void Engine::after_update() {
  RECORD_FUNCTION("shardopt::gather", std::vector<c10::IValue>());
  const auto t = Clock::now();
  store_->after_update();
  stats_.gather_s = seconds_since(t);
}

// The bookkeeping every step() ends with, taken or skipped.
void Engine::end_step(Clock::time_point t0) {
  stats_.step = steps_;
  tracker_->reset_micro_steps();
  stats_.comm_elements = reducer_->take_comm_elements() + store_->take_comm_elements();
  stats_.step_s = seconds_since(t0);
}

// The master weights (each rank's owned slices) through the gradients' check: one read, one
// all-reduce, the same answer everywhere.
bool Engine::parameters_finite() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> slices;
  for (int b = 0; b < static_cast<int>(flat_->layout().buckets.size()); ++b) {
    slices.push_back(owned_param_slice(b));
  }
  return !scan_finite(slices, 1.0, false, comm_.get(), options_.timeout).non_finite;
}

MemoryReport Engine::memory() const {
  MemoryReport m;
  m.param_bytes = store_->param_bytes();
  m.grad_bytes = reducer_->grad_bytes();
  m.optimizer_state_bytes = flat_->state_bytes();
  m.buffer_bytes = store_->gathered_bytes() + reducer_->buffer_bytes();
  return m;
}

const Rule& Engine::current_rule(int group) const {
  auto& options = owner_.param_groups()[group].options();
  return static_cast<const GroupOptions&>(options).rule;
}

// ---- ShardAccess --------------------------------------------------------------------------------

at::ScalarType Engine::master_dtype() const {
  return flat_->master_options().dtype().toScalarType();
}

// The master weights: the separate (fp32 / host) copy, or the model's own storage.
at::Tensor Engine::owned_param_slice(int bucket) {
  if (plan_.separate_master()) return flat_->owned_master_slice(bucket);
  return store_->owned_slice(bucket);
}

at::Tensor Engine::owned_state_slice(int state, int bucket) {
  return flat_->owned_state_slice(state, bucket);
}

void Engine::set_step_count(int64_t steps) {
  steps_ = steps;
  stats_ = StepStats{};
  stats_.step = steps_;
}

void Engine::set_group_rule(int group, const Rule& rule) {
  static_cast<GroupOptions&>(owner_.param_groups()[group].options()).rule = rule;
}

std::optional<LossScaler::State> Engine::loss_scaler_state() const {
  if (!scaler_) return std::nullopt;
  return scaler_->state();
}

void Engine::set_loss_scaler_state(const LossScaler::State& state) {
  if (scaler_) scaler_->set_state(state);
}

void Engine::after_load() {
  at::NoGradGuard no_grad;
  if (!plan_.sharded()) {
    // Every rank holds everything when replicated: assemble the full master weights and state.
    const int rank = comm_->rank();
    std::vector<WorkPtr> works;
    for (const auto& bl : flat_->layout().buckets) {
      auto gather_bucket = [&](const at::Tensor& full) {
        at::Tensor range = full.narrow(0, bl.flat_offset, bl.padded);
        works.push_back(comm_->all_gather(range.narrow(0, rank * bl.shard, bl.shard), range, true));
      };
      gather_bucket(plan_.separate_master() ? flat_->master() : store_->whole());
      for (auto& s : flat_->state()) gather_bucket(s);
    }
    for (auto& w : works) w->wait(options_.timeout);
  }
  for (auto& s : flat_->segments()) s.low_done = false;
  flat_->write_back_master();  // master -> model dtype
  store_->after_update();      // sharded: parameters; per unit: frees stale units, gathers the root
  reducer_->take_comm_elements();
  store_->take_comm_elements();
  zero_grad();
}

}  // namespace shardopt::detail
