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
// A chunk may have several outputs and inputs (several tensors per boundary): the graph is the
// union under every output, the trunk reaches any input.
//
// Note [Owed gradients]: the weight pass owes a gradient to every leaf of the chunk's graph that
// requires grad, not only to PipelineChunk::parameters: a one-pass backward (1F1B's B) fills
// them all, so a split backward that ran only the declared ones would silently leave a forgotten
// parameter without gradient. owed_parameters() walks the graph from the outputs to its
// AccumulateGrad nodes and appends each undeclared leaf (the chunk's inputs excepted) to the
// declared list, in the walk's order, which depends only on the graph and so is the same on
// every rank (Note [Weight passes in a fixed order]).
class SplitBackward {
 public:
  // The input-gradient pass: returns d(outputs)/d(inputs[i]) for grad_outputs (undefined for an
  // input the outputs do not depend on), and keeps what the weight pass needs. Each input is a
  // leaf requiring grad; an output's undefined gradient is an implicit one (a scalar loss).
  std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& grad_outputs,
                                         const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& parameters);
  // The weight pass: accumulates the gradients owed (Note [Owed gradients]) into their .grad.
  void backward_weight(const std::vector<at::Tensor>& outputs,
                       const std::vector<at::Tensor>& grad_outputs,
                       const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& parameters);
  // Whether backward_input found split nodes for every parameter (false: W re-traverses).
  bool split() const { return split_; }

  struct Group;  // one split node: its captured gradient and its parameters' edges

 private:
  std::vector<std::shared_ptr<Group>> groups_;
  bool split_ = false;
};

// `declared` followed by every other leaf requiring grad under `outputs`, `inputs` excepted
// (Note [Owed gradients]).
std::vector<at::Tensor> owed_parameters(const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& declared,
                                        const std::vector<at::Tensor>& inputs);

}  // namespace shardopt::detail
