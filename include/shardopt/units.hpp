/// \file
/// Units: the groups of parameters that ZeRO stage 3 gathers together (usually one per layer).
///
///   // in the model: one Units object, one declaration per layer, one run() per layer call
///   units = std::make_shared<shardopt::Units>();
///   for (size_t i = 0; i < layers.size(); ++i) units->add(fmt::format("layer{}", i), layers[i]);
///   ...
///   x = units->run(i, [&] { return layers[i]->forward(x, mask); });
///
///   // in the trainer: hand the same object to the optimizer
///   zo.stage = shardopt::Stage::Parameters;  zo.units = model->units;
///
/// With stage 3, run() all-gathers the unit's parameters before `fn` (prefetching the units that
/// come next), frees the full storage after it, and gathers it again when backward reaches the
/// unit. Without a stage-3 optimizer attached, run() just calls `fn`, so the model code is the
/// same for every stage. A unit may run several times in one forward (BERT's tied word embeddings:
/// the lookup, then the MLM decoder) and is gathered for each run. A parameter declared by two
/// units (the word embeddings declared by the embeddings unit and by the heads unit) is gathered
/// whenever either runs and freed once its gradient is in. Parameters declared in no unit are
/// gathered from zero_grad() (or the first run()) until step(), and named in a warning.
///
/// Recomputation: a unit declared with UnitOptions{/*recompute=*/true} (or set_recompute) keeps
/// none of its activations; call it with its inputs, run(i, fn, inputs), and run() wraps the call
/// in shardopt::recompute (recompute.hpp, whose Note [What fn may capture] applies to fn):
///   units->add_module("layer0", layer, {/*recompute=*/true});
///   x = units->run(0, [layer, mask](const std::vector<at::Tensor>& in) {
///     return layer->forward(in[0], mask); }, {x});
/// Without the declaration the same call just runs fn(inputs). At stage 3 backward gathers the
/// unit before the recomputation, as it does for any unit, so recomputing costs no communication.
///
/// Communication per micro-step: each unit's parameters are all-gathered once per run in forward
/// and once in backward, and reduce-scattered once; parameters in no unit once per step.
///
/// Between steps, no parameter has storage (zero bytes): read them only inside run(), or after
/// DistributedOptimizer::gather_full_parameters(). Any ATen operation on a released parameter
/// throws Error{InvalidArgument} naming it (Python: a RuntimeError with the same text, raised
/// through torch's dispatcher). Code that takes data_ptr() directly gets no valid address.
#pragma once

#include <ATen/core/Tensor.h>

#include "shardopt/recompute.hpp"

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace shardopt {

/// What run() calls into; implemented by the stage-3 optimizer.
class UnitRuntime {
 public:
  virtual ~UnitRuntime() = default;
  virtual void enter(int unit) = 0;  ///< the unit's parameters must be gathered now
  virtual void exit(int unit) = 0;   ///< the unit's forward is over
  /// Arranges for the unit to be gathered again when backward reaches `output`.
  virtual void mark_for_backward(int unit, const at::Tensor& output) = 0;
};

/// How a unit runs (Units::add).
struct UnitOptions {
  bool recompute = false;  ///< run(i, fn, inputs) recomputes the unit's activations in backward
};

/// The groups of parameters that stage 3 gathers together (see the file's comment): declared once,
/// run through run(), given to the optimizer as ZeroOptions::units.
class Units {
 public:
  /// Declares a unit gathered as one; returns its index for run().
  int add(std::string name, std::vector<at::Tensor> parameters, UnitOptions options = {});
  /// Any module or module holder: its parameters, recursively.
  template <typename Module>
  int add_module(std::string name, const Module& module, UnitOptions options = {}) {
    return add(std::move(name), module->parameters(/*recurse=*/true), options);
  }
  /// Declares whether unit `index` recomputes its activations in backward.
  void set_recompute(int index, bool recompute);
  bool recomputes(int index) const;  ///< whether unit `index` recomputes

  /// run() for a unit that takes tensors: fn(inputs), through shardopt::recompute when the unit
  /// is declared to recompute. fn returns an at::Tensor or a std::vector<at::Tensor>.
  template <typename Fn>
  auto run(int index, Fn&& fn, std::vector<at::Tensor> inputs)
      -> std::invoke_result_t<Fn&, const std::vector<at::Tensor>&> {
    return run_unit(index, [&] {
      return recomputes(index) ? recompute(fn, std::move(inputs)) : fn(inputs);
    });
  }

  /// Calls fn() with unit `index`'s parameters gathered; returns what fn returns (a tensor, a
  /// vector or tuple of tensors, or anything else, which is passed through).
  template <typename Fn>
  auto run(int index, Fn&& fn) -> decltype(fn()) {
    check_plain_run(index);
    return run_unit(index, std::forward<Fn>(fn));
  }

  /// run() split in two, for callers that reach a unit through hooks rather than a call they can
  /// wrap (the Python bindings' forward pre-hook and forward hook): begin(i) before the unit's
  /// forward, end(i, outputs) after it. Same effect as run(); no-ops without a stage-3 optimizer.
  void begin(int index) {
    check_index(index);
    if (runtime_ != nullptr) runtime_->enter(index);
  }
  /// The second half of run() (see begin()).
  void end(int index, const std::vector<at::Tensor>& outputs) {
    check_index(index);
    if (runtime_ == nullptr) return;
    mark(index, outputs);
    runtime_->exit(index);
  }

  int size() const { return static_cast<int>(units_.size()); }  ///< number of units declared
  const std::string& name(int index) const;  ///< unit `index`'s name
  const std::vector<at::Tensor>& parameters(int index) const;  ///< unit `index`'s parameters

  /// For the optimizer: attach (stage 3) and detach the runtime. One optimizer at a time.
  void attach(UnitRuntime* runtime);
  void detach(const UnitRuntime* runtime);  ///< Detaches `runtime` if it is the one attached.

 private:
  struct Unit {
    std::string name;
    std::vector<at::Tensor> parameters;
    UnitOptions options;
  };
  struct Scope {
    Scope(Units& units, int index) : units(units), index(index) { units.runtime_->enter(index); }
    ~Scope() {
      if (units.runtime_ != nullptr) units.runtime_->exit(index);
    }
    Units& units;
    int index;
  };

  template <typename Fn>
  auto run_unit(int index, Fn&& fn) -> decltype(fn()) {
    check_index(index);
    if (runtime_ == nullptr) return fn();
    Scope scope(*this, index);
    auto out = fn();
    mark(index, out);
    return out;
  }

  void check_index(int index) const;
  /// A recomputing unit needs its inputs: run(i, fn) without them is refused, naming the unit.
  void check_plain_run(int index) const;
  void mark(int index, const at::Tensor& t) {
    if (t.defined() && t.requires_grad()) runtime_->mark_for_backward(index, t);
  }
  void mark(int index, const std::vector<at::Tensor>& ts) {
    for (const auto& t : ts) mark(index, t);
  }
  template <typename... Ts>
  void mark(int index, const std::tuple<Ts...>& ts) {
    std::apply([&](const auto&... t) { (mark(index, t), ...); }, ts);
  }
  template <typename T>
  void mark(int, const T&) {}  ///< not a tensor: nothing to hook

  std::vector<Unit> units_;
  UnitRuntime* runtime_ = nullptr;
};

/// The shared handle the model and the optimizer both hold.
using UnitsPtr = std::shared_ptr<Units>;

}  // namespace shardopt
