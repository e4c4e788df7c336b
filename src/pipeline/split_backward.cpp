// SplitBackward: the zero-bubble B and W passes over one chunk's autograd graph (Note [Cheap
// weight pass] in split_backward.hpp).
#include "pipeline/split_backward.hpp"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace shardopt::detail {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
// std::shared_ptr<Node> in torch 1.13, c10::intrusive_ptr<Node> in newer ones (2.15): what an
// Edge holds.
using NodePtr = decltype(Edge::function);

struct SplitBackward::Group {
  NodePtr node;                                  // the split node
  std::vector<Edge> parameter_edges;             // its parameters' gradient accumulators
  variable_list captured;                        // the gradients into `node` during B
};

namespace {

// Keeps the gradients arriving at a split node; passes them on unchanged.
struct Capture : torch::autograd::FunctionPreHook {
  explicit Capture(std::shared_ptr<SplitBackward::Group> g) : group(std::move(g)) {}
  variable_list operator()(const variable_list& grads) override {
    group->captured = grads;
    return grads;
  }
  std::shared_ptr<SplitBackward::Group> group;
};

// Parents of each node of the graph under `root` (the reverse of next_edges), and an owning
// pointer to each node.
struct Graph {
  std::unordered_map<Node*, std::vector<Node*>> parents;
  std::unordered_map<Node*, NodePtr> owner;
};

// The graph under every output's node, walked depth-first in next_edges order.
Graph graph_under(const std::vector<NodePtr>& roots) {
  Graph g;
  std::vector<Node*> stack;
  for (const NodePtr& root : roots) {
    if (g.owner.count(root.get())) continue;
    g.parents[root.get()];
    g.owner[root.get()] = root;
    stack.push_back(root.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      Node* child = e.function.get();
      const bool seen = g.parents.count(child) > 0;
      g.parents[child].push_back(n);
      if (!seen) {
        g.owner[child] = e.function;
        stack.push_back(child);
      }
    }
  }
  return g;
}

std::vector<NodePtr> roots_of(const std::vector<at::Tensor>& outputs) {
  std::vector<NodePtr> roots;
  for (const at::Tensor& out : outputs) {
    if (out.defined() && out.grad_fn()) roots.push_back(out.grad_fn());
  }
  return roots;
}

// The outputs a backward pass starts from (those requiring grad) and their gradients.
std::pair<variable_list, variable_list> differentiable(const std::vector<at::Tensor>& outputs,
                                                       const std::vector<at::Tensor>& grads) {
  std::pair<variable_list, variable_list> out;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined() || !outputs[i].requires_grad()) continue;
    out.first.push_back(outputs[i]);
    out.second.push_back(i < grads.size() ? grads[i] : at::Tensor());
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> owed_parameters(const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& declared,
                                        const std::vector<at::Tensor>& inputs) {
  std::unordered_set<const void*> known;
  for (const at::Tensor& t : declared) known.insert(t.unsafeGetTensorImpl());
  for (const at::Tensor& t : inputs) known.insert(t.unsafeGetTensorImpl());
  std::vector<at::Tensor> owed = declared;
  // Depth-first in next_edges order, not over the graph's hash maps: the order must not depend
  // on addresses (Note [Weight passes in a fixed order]).
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (const NodePtr& root : roots_of(outputs)) stack.push_back(root.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) {
      const at::Tensor& leaf = acc->variable;
      if (leaf.defined() && leaf.requires_grad() && known.insert(leaf.unsafeGetTensorImpl()).second) {
        owed.push_back(leaf);
      }
      continue;
    }
    const auto& edges = n->next_edges();
    for (auto it = edges.rbegin(); it != edges.rend(); ++it) {
      if (it->is_valid()) stack.push_back(it->function.get());
    }
  }
  return owed;
}

std::vector<at::Tensor> SplitBackward::backward_input(const std::vector<at::Tensor>& outputs,
                                                      const std::vector<at::Tensor>& grad_outputs,
                                                      const std::vector<at::Tensor>& inputs,
                                                      const std::vector<at::Tensor>& parameters) {
  groups_.clear();
  split_ = false;
  const std::vector<NodePtr> roots = roots_of(outputs);
  std::vector<NodePtr> input_nodes;
  for (const at::Tensor& input : inputs) {
    if (NodePtr n = torch::autograd::impl::try_get_grad_accumulator(input)) {
      input_nodes.push_back(std::move(n));
    }
  }
  if (!roots.empty() && !input_nodes.empty()) {
    const Graph graph = graph_under(roots);
    const auto& parents = graph.parents;
    // The trunk: the nodes from which an input's accumulator is reached.
    std::unordered_set<Node*> trunk;
    std::vector<Node*> stack;
    for (const NodePtr& n : input_nodes) {
      if (parents.count(n.get())) stack.push_back(n.get());
    }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (!trunk.insert(n).second) continue;
      for (Node* p : parents.at(n)) stack.push_back(p);
    }
    std::unordered_map<Node*, std::shared_ptr<Group>> by_node;
    std::vector<std::shared_ptr<Group>> in_order;  // by their first parameter's position
    split_ = !trunk.empty();
    for (const at::Tensor& param : owed_parameters(outputs, parameters, inputs)) {
      const NodePtr acc = torch::autograd::impl::try_get_grad_accumulator(param);
      if (!split_ || !acc || !parents.count(acc.get())) continue;  // not used by this graph
      // Walk up the parameter's own branch to the trunk.
      std::unordered_set<Node*> seen, meets;
      std::vector<Node*> up{acc.get()};
      while (!up.empty()) {
        Node* n = up.back();
        up.pop_back();
        if (!seen.insert(n).second) continue;
        if (trunk.count(n)) {
          meets.insert(n);
          continue;
        }
        for (Node* p : parents.at(n)) up.push_back(p);
      }
      if (meets.size() != 1) {
        split_ = false;  // used at several places (or never reaching the trunk): re-traverse
        break;
      }
      Node* node = *meets.begin();
      auto& group = by_node[node];
      if (!group) {
        group = std::make_shared<Group>();
        group->node = graph.owner.at(node);
        in_order.push_back(group);
      }
      group->parameter_edges.push_back(torch::autograd::impl::gradient_edge(param));
    }
    if (split_) {
      // Note [Weight passes in a fixed order]: the weight pass runs the split nodes in reverse
      // parameter order, as a full backward roughly would, and never in the nodes' address order:
      // gradients reach an optimizer's hooks in this order, and a data-parallel optimizer issues
      // its bucket reductions in arrival order, which must be the same on every rank (the
      // addresses were not: ZeRO's reduce-scatters then summed different buckets).
      for (auto it = in_order.rbegin(); it != in_order.rend(); ++it) {
        (*it)->node->add_pre_hook(std::make_unique<Capture>(*it));
        groups_.push_back(*it);
      }
    } else {
      groups_.clear();
    }
  }
  const auto [outs, grads] = differentiable(outputs, grad_outputs);
  variable_list result;
  try {
    result = torch::autograd::grad(outs, inputs, grads, /*retain_graph=*/true,
                                   /*create_graph=*/false, /*allow_unused=*/true);
  } catch (...) {
    for (auto& g : groups_) g->node->pre_hooks().pop_back();
    throw;
  }
  // Our hooks are the last ones added to each split node.
  for (auto& g : groups_) g->node->pre_hooks().pop_back();
  return result;
}

void SplitBackward::backward_weight(const std::vector<at::Tensor>& outputs,
                                    const std::vector<at::Tensor>& grad_outputs,
                                    const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& parameters) {
  if (!split_) {
    const auto [outs, grads] = differentiable(outputs, grad_outputs);
    const std::vector<at::Tensor> owed = owed_parameters(outputs, parameters, inputs);
    if (!outs.empty() && !owed.empty()) {
      torch::autograd::backward(outs, grads, /*retain_graph=*/false, /*create_graph=*/false,
                                owed);
    }
    return;
  }
  // One engine run per split node: with the parameters of other nodes among the outputs, the
  // trunk below this node would lead to them and run again (counting their gradients twice).
  for (const auto& g : groups_) {
    torch::autograd::edge_list roots;
    variable_list grads;
    for (size_t i = 0; i < g->captured.size(); ++i) {
      if (!g->captured[i].defined()) continue;
      roots.emplace_back(g->node, static_cast<uint32_t>(i));
      grads.push_back(g->captured[i]);
    }
    if (roots.empty()) continue;  // no gradient reached this node: nothing to accumulate
    torch::autograd::Engine::get_default_engine().execute(
        roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true,
        g->parameter_edges);
  }
  groups_.clear();
}

}  // namespace shardopt::detail
