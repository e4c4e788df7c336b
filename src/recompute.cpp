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

std::vector<c10::Device> rng_devices(at::TensorList inputs) {
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

// torch's Function takes defined tensors only (it records each input's and output's metadata):
// undefined inputs and outputs of fn are kept out of it and put back at their places.
struct State : torch::CustomClassHolder {
  RecomputeFn fn;
  size_t user_inputs = 0;            // fn's inputs, defined or not
  std::vector<size_t> slots;         // the Function's input k is fn's input slots[k] (else anchor)
  std::vector<bool> requires_grad;   // per Function input
  std::vector<bool> output_defined;  // per fn output, from the forward
  RngStates rng;

  // fn's input vector from the Function's inputs.
  std::vector<at::Tensor> user(const std::vector<at::Tensor>& passed) const {
    std::vector<at::Tensor> in(user_inputs);
    for (size_t k = 0; k < slots.size(); ++k) in[slots[k]] = passed[k];
    return in;
  }
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Recompute : torch::autograd::Function<Recompute> {
  // `inputs` is a TensorList: torch's Function takes only that form (not a vector) as tensors.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<State> state,
                               at::TensorList inputs) {
    state->rng = RngStates::capture(rng_devices(inputs));
    variable_list outputs;
    {
      at::NoGradGuard no_grad;
      outputs = state->fn(state->user(inputs.vec()));
    }
    variable_list defined;
    for (const auto& t : outputs) {
      state->output_defined.push_back(t.defined());
      if (t.defined()) defined.push_back(t);
    }
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return defined;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    SHARDOPT_CHECK(!at::GradMode::is_enabled(), Unsupported,
                   "recompute: double backward through a recomputed call is not supported "
                   "(backward with create_graph=true reached shardopt::recompute); recompute "
                   "without create_graph, or call the block directly");
    auto state = c10::static_intrusive_pointer_cast<State>(ctx->saved_data["state"].toCapsule());
    std::vector<at::Tensor> passed;
    for (const auto& saved : ctx->get_saved_variables()) {
      passed.push_back(saved.detach().requires_grad_(state->requires_grad[passed.size()]));
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork fork(state->rng);
      at::AutoGradMode grad(true);
      outputs = state->fn(state->user(passed));
    }
    SHARDOPT_CHECK(outputs.size() == state->output_defined.size(), InvalidArgument,
                   "recompute: fn returned {} tensors when run again in backward, {} in forward; "
                   "it must compute the same thing both times",
                   outputs.size(), state->output_defined.size());
    variable_list roots, grads;
    size_t g = 0;  // grad_outputs follow the outputs that were defined in forward
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!state->output_defined[i]) continue;
      const at::Tensor& grad = grad_outputs.at(g++);
      if (outputs[i].defined() && outputs[i].requires_grad() && grad.defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad);
      }
    }
    if (!roots.empty()) {
      NestedBackward nested;
      torch::autograd::backward(roots, grads);
    }
    // One gradient per forward argument: the state, then each tensor (the anchor gets none).
    variable_list result{at::Tensor()};
    for (const auto& t : passed) result.push_back(t.requires_grad() ? t.grad() : at::Tensor());
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
  std::vector<at::Tensor> passed;
  bool any = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    state->slots.push_back(i);
    state->requires_grad.push_back(inputs[i].requires_grad());
    any = any || inputs[i].requires_grad();
    passed.push_back(inputs[i]);
  }
  // No input requires grad (the first block of a model fed raw data): the result must still
  // lead backward here, or the parameters inside fn would get no gradient. An empty leaf that
  // requires grad anchors the call in the graph; it never receives a gradient.
  if (!any) {
    passed.push_back(at::empty({0}).requires_grad_(true));
    state->requires_grad.push_back(false);  // recomputed without grad: fn never sees it
  }
  const auto st = state;  // apply() takes the state; its output mask is read after
  auto defined = Recompute::apply(std::move(state), at::TensorList(passed));
  std::vector<at::Tensor> out;
  size_t k = 0;
  for (bool d : st->output_defined) out.push_back(d ? defined.at(k++) : at::Tensor());
  return out;
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
