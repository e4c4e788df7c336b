// The zero-bubble split of one chunk's backward pass: the input-gradient pass B keeps, at each
// node where a parameter's own branch leaves the chain to the input, the gradient flowing into
// it; the weight pass W runs only those branches (Note [Cheap weight pass]).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace shardopt::detail {

// Note [Cheap weight pass]: torch.distributed.pipelining's stage_backward_input/_weight, in C++.
// The trunk is every node of the output's graph from which the input's gradient accumulator is
// reached. A parameter's branch is the nodes between its accumulator and the trunk; where it
// meets the trunk (the "split node", e.g. AddmmBackward for a Linear's weight and bias) a
// pre-hook keeps the gradient arriving there during B. W then runs the autograd engine from each
// split node with that gradient and the node's parameters as the only outputs, so the node
// computes only its parameters' gradients (the mat2 and bias halves of addmm's backward) and no
// node of the trunk runs again. Values are those of one full backward pass, bitwise: the same
// nodes run on the same gradients. Where this cannot hold it falls back to re-traversing the
// graph for the parameters (correct, as costly as a full backward): a parameter whose branch
// meets the trunk at more than one node (used twice) or an input that is not differentiable.
class SplitBackward {
 public:
  // The input-gradient pass: returns d(output)/d(input) for grad_output, and keeps what the
  // weight pass needs. `input` must be a leaf requiring grad.
  at::Tensor backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                            const at::Tensor& input, const std::vector<at::Tensor>& parameters);
  // The weight pass: accumulates the parameters' gradients into their .grad.
  void backward_weight(const at::Tensor& output, const at::Tensor& grad_output,
                       const std::vector<at::Tensor>& parameters);
  // Whether backward_input found split nodes for every parameter (false: W re-traverses).
  bool split() const { return split_; }

  struct Group;  // one split node: its captured gradient and its parameters' edges

 private:
  std::vector<std::shared_ptr<Group>> groups_;
  bool split_ = false;
};

}  // namespace shardopt::detail
