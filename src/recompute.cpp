// shardopt::recompute: a torch::autograd::Function whose forward runs fn under no-grad and whose
// backward runs it again with grad and back-propagates through it (recompute.hpp).
#include "shardopt/recompute.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <mutex>

#include "shardopt/error.hpp"

namespace shardopt {
namespace detail {
namespace {

// ---- generators (Note [Same randomness]) -------------------------------------------------------

std::vector<c10::Device> rng_devices(const std::vector<at::Tensor>& inputs) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  auto add = [&](c10::Device d) {
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  };
  bool gpu = false;
  for (const auto& t : inputs) {
    if (t.defined() && t.is_cuda()) {
      gpu = true;
      add(t.device());
    }
  }
  // The current device's generator too: fn may create tensors there (torch.utils.checkpoint
  // forks the same set). DeviceGuardImpl is the device-generic interface: no CUDA headers.
  if (gpu) add(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice());
  return devices;
}

struct RngStates {
  std::vector<c10::Device> devices;
  std::vector<at::Tensor> states;

  static RngStates capture(std::vector<c10::Device> devices) {
    RngStates s{std::move(devices), {}};
    for (const auto& d : s.devices) {
      auto gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.states.push_back(gen.get_state());
    }
    return s;
  }
  void restore() const {
    for (size_t i = 0; i < devices.size(); ++i) {
      auto gen = at::globalContext().defaultGenerator(devices[i]);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(states[i]);
    }
  }
};

// Sets the forward's generator states for the recomputation and puts the caller's back after it,
// whether it returns or throws.
class RngFork {
 public:
  explicit RngFork(const RngStates& forward) : caller_(RngStates::capture(forward.devices)) {
    forward.restore();
  }
  ~RngFork() { caller_.restore(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates caller_;
};

// ---- callbacks past nested backward passes (queue_after_backward) -----------------------------

// Per thread: CPU and single-GPU backward passes run a reentrant backward on the thread of the
// node that started it, and the hooks it fires run there too.
struct Nesting {
  int depth = 0;
  std::vector<std::function<void()>> pending;
};
thread_local Nesting nesting;

class NestedBackward {
 public:
  NestedBackward() { ++nesting.depth; }
  ~NestedBackward() {
    if (--nesting.depth > 0) return;
    // Back in the outer pass (its graph task is current again): hand it what was deferred.
    auto pending = std::move(nesting.pending);
    nesting.pending.clear();
    for (auto& cb : pending) {
      torch::autograd::Engine::get_default_engine().queue_callback(std::move(cb));
    }
  }
  NestedBackward(const NestedBackward&) = delete;
  NestedBackward& operator=(const NestedBackward&) = delete;
};

// ---- the autograd Function -------------------------------------------------------------------

struct State : torch::CustomClassHolder {
  RecomputeFn fn;
  size_t user_inputs = 0;  // inputs[user_inputs] is the anchor, when there is one
  std::vector<bool> requires_grad;
  RngStates rng;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Recompute : torch::autograd::Function<Recompute> {
  // `inputs` is a TensorList: torch's Function takes only that form (not a vector) as tensors.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<State> state,
                               at::TensorList inputs) {
    state->rng = RngStates::capture(rng_devices(inputs));
    std::vector<at::Tensor> user(inputs.begin(), inputs.begin() + state->user_inputs);
    variable_list outputs;
    {
      at::NoGradGuard no_grad;
      outputs = state->fn(user);
    }
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    SHARDOPT_CHECK(!at::GradMode::is_enabled(), Unsupported,
                   "recompute: double backward through a recomputed call is not supported "
                   "(backward with create_graph=true reached shardopt::recompute); recompute "
                   "without create_graph, or call the block directly");
    auto state = c10::static_intrusive_pointer_cast<State>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(state->user_inputs);
    for (size_t i = 0; i < state->user_inputs; ++i) {
      at::Tensor t = saved[i].defined() ? saved[i].detach() : at::Tensor();
      if (t.defined()) t.requires_grad_(state->requires_grad[i]);
      inputs.push_back(std::move(t));
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork fork(state->rng);
      at::AutoGradMode grad(true);
      outputs = state->fn(inputs);
    }
    SHARDOPT_CHECK(outputs.size() == grad_outputs.size(), InvalidArgument,
                   "recompute: fn returned {} tensors when run again in backward, {} in forward; "
                   "it must compute the same thing both times",
                   outputs.size(), grad_outputs.size());
    variable_list roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) {
      NestedBackward nested;
      torch::autograd::backward(roots, grads);
    }
    // One gradient per forward argument: the state, then each input (the anchor gets none).
    variable_list result{at::Tensor()};
    for (size_t i = 0; i < saved.size(); ++i) {
      result.push_back(i < inputs.size() && inputs[i].defined() && inputs[i].requires_grad()
                           ? inputs[i].grad()
                           : at::Tensor());
    }
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> recompute_impl(RecomputeFn fn, std::vector<at::Tensor> inputs) {
  SHARDOPT_CHECK(fn != nullptr, InvalidArgument, "recompute: fn is empty");
  if (!at::GradMode::is_enabled()) return fn(inputs);  // nothing to keep or recompute
  auto state = c10::make_intrusive<State>();
  state->fn = std::move(fn);
  state->user_inputs = inputs.size();
  bool any = false;
  for (const auto& t : inputs) {
    state->requires_grad.push_back(t.defined() && t.requires_grad());
    any = any || state->requires_grad.back();
  }
  // No input requires grad (the first block of a model fed raw data): the result must still
  // lead backward here, or the parameters inside fn would get no gradient. An empty leaf that
  // requires grad anchors the call in the graph; it never receives a gradient.
  if (!any) inputs.push_back(at::empty({0}, at::TensorOptions().requires_grad(true)));
  return Recompute::apply(std::move(state), at::TensorList(inputs));
}

void queue_after_backward(std::function<void()> callback) {
  if (nesting.depth > 0) {
    nesting.pending.push_back(std::move(callback));
  } else {
    torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
  }
}

}  // namespace detail
}  // namespace shardopt
