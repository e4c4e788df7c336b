/// \file
/// Activation recomputation (activation checkpointing) for C++ models: the reentrant design of
/// torch.utils.checkpoint, which libtorch's C++ API lacks.
///
///   // a block's activations are not kept; backward runs the block again to get them
///   x = shardopt::recompute([layer, mask](const std::vector<at::Tensor>& in) {
///     return layer->forward(in[0], mask);
///   }, {x});
///
/// recompute(fn, inputs) runs fn(inputs) under no-grad, keeping only `inputs`, and returns what fn
/// returns (an at::Tensor or a std::vector<at::Tensor>). When backward reaches the result it calls
/// fn again with grad enabled on detached copies of the inputs and back-propagates through that
/// (a nested, "reentrant" backward): parameter gradients accumulate as in the plain run, so
/// DistributedOptimizer's hooks see them as usual, and the inputs' gradients flow on.
///
/// Note [What fn may capture]
/// fn runs a second time during backward, after the caller's scope has ended: capture by value
/// (module holders and tensors are cheap shared handles), never [&] over locals. Tensors that
/// need a gradient must be passed in `inputs`; parameters (leaves) are fine as captures. Inputs
/// that do not require grad, undefined inputs and outputs that do not require grad are allowed.
///
/// Note [Same randomness]
/// The CPU generator's state (and, when an input is on a GPU, the state of the default generator
/// of those devices and of the current one) is saved before the forward and restored around the
/// recomputation, so dropout draws the same masks and gradients are bitwise those of the plain
/// run; the caller's generators are put back afterwards, so its random stream after backward is
/// what it would be without recomputation. Autocast state is not captured.
///
/// Note [Recompute and ZeRO]
/// Stages 0-2: no extra communication; gradients reach the buckets during the nested backward.
/// Stage 3: write the call inside units->run(i, ...) (or declare the unit with recompute = true,
/// units.hpp): backward gathers the unit before the recomputation (as it would without it) and
/// releases it when its gradients are in, so a recomputed unit costs no extra all-gather.
///
/// Limits: double backward (create_graph=true) through a recomputed call is refused with an Error
/// of kind Unsupported; torch::autograd::grad() with `inputs` does not see gradients that reach
/// parameters only inside the nested backward (as with torch.utils.checkpoint's reentrant form).
/// Under no-grad (evaluation) recompute just calls fn.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

namespace shardopt {

/// The function recompute() runs, in its vector form.
using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

namespace detail {
/// The vector form; recompute() adapts fn's return type to it.
std::vector<at::Tensor> recompute_impl(RecomputeFn fn, std::vector<at::Tensor> inputs);

/// Queues `callback` on the outermost backward pass now running on this thread, i.e. past any
/// nested backward of a recomputation (what torch's Engine::queue_callback does when no
/// recomputation is running). The optimizer's end-of-backward work goes through it.
void queue_after_backward(std::function<void()> callback);
}  // namespace detail

template <typename Fn>
/// Runs fn(inputs) keeping only the inputs, and runs it again in backward (see the file's comment).
/// fn returns an at::Tensor or a std::vector<at::Tensor>.
auto recompute(Fn&& fn, std::vector<at::Tensor> inputs)
    -> std::invoke_result_t<Fn&, const std::vector<at::Tensor>&> {
  using Result = std::invoke_result_t<Fn&, const std::vector<at::Tensor>&>;
  static_assert(std::is_same_v<Result, at::Tensor> || std::is_same_v<Result, std::vector<at::Tensor>>,
                "shardopt::recompute: fn must return at::Tensor or std::vector<at::Tensor>");
  if constexpr (std::is_same_v<Result, at::Tensor>) {
    auto out = detail::recompute_impl(
        [f = std::forward<Fn>(fn)](const std::vector<at::Tensor>& in) mutable {
          return std::vector<at::Tensor>{f(in)};
        },
        std::move(inputs));
    return out.at(0);
  } else {
    return detail::recompute_impl(RecomputeFn(std::forward<Fn>(fn)), std::move(inputs));
  }
}

}  // namespace shardopt
