// SplitBackward: the zero-bubble B and W passes over one chunk's autograd graph (Note [Cheap
// weight pass] in split_backward.hpp).
#include "pipeline/split_backward.hpp"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
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

Graph graph_under(const NodePtr& root) {
  Graph g;
  g.parents[root.get()];
  g.owner[root.get()] = root;
  std::vector<Node*> stack{root.get()};
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

}  // namespace

at::Tensor SplitBackward::backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                                         const at::Tensor& input,
                                         const std::vector<at::Tensor>& parameters) {
  groups_.clear();
  split_ = false;
  const NodePtr root = output.grad_fn();
  const NodePtr input_node = torch::autograd::impl::try_get_grad_accumulator(input);
  if (root && input_node) {
    const Graph graph = graph_under(root);
    const auto& parents = graph.parents;
    // The trunk: the nodes from which the input's accumulator is reached.
    std::unordered_set<Node*> trunk;
    std::vector<Node*> stack{input_node.get()};
    while (!stack.empty() && parents.count(input_node.get())) {
      Node* n = stack.back();
      stack.pop_back();
      if (!trunk.insert(n).second) continue;
      for (Node* p : parents.at(n)) stack.push_back(p);
    }
    std::unordered_map<Node*, std::shared_ptr<Group>> by_node;
    std::vector<std::shared_ptr<Group>> in_order;  // by their first parameter's position
    split_ = !trunk.empty();
    for (const at::Tensor& param : parameters) {
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
    }
  }
  at::Tensor grad;
  try {
    grad = torch::autograd::grad({output}, {input}, {grad_output}, /*retain_graph=*/true)[0];
  } catch (...) {
    for (auto& g : groups_) g->node->pre_hooks().pop_back();
    throw;
  }
  // Our hooks are the last ones added to each split node.
  for (auto& g : groups_) g->node->pre_hooks().pop_back();
  return grad;
}

void SplitBackward::backward_weight(const at::Tensor& output, const at::Tensor& grad_output,
                                    const std::vector<at::Tensor>& parameters) {
  if (!split_) {
    torch::autograd::backward({output}, {grad_output}, /*retain_graph=*/false,
                              /*create_graph=*/false, parameters);
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
