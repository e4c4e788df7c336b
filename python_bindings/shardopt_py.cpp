// Python bindings (module shardopt._C): errors, options, units and the optimizer; communicators
// in bind_comm.cpp, the estimator in bind_estimate.cpp, hyper-parameters in bind_rules.cpp,
// snapshots in host memory in bind_snapshots.cpp (bindings.hpp). The Python package
// (shardopt/*.py) wraps the optimizer core as a torch.optim.Optimizer; this file only converts.
// Invariant: every call that communicates or runs the optimizer releases the GIL (autograd hooks
// and collectives never need Python), and every call back into Python re-acquires it.
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <fmt/ranges.h>

#include <map>

#include "bindings.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/detail/names.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/estimate.hpp"
#include "shardopt/shardopt.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace shardopt {
namespace {

using python::read_rule;
using python::rule_dict;
using python::to_duration;

// ---- errors ----------------------------------------------------------------------------------

// Note [Python exceptions]: every shardopt::Error becomes an instance of shardopt.Error (a
// RuntimeError) carrying .kind and .rank; kinds with an obvious builtin also derive from it:
// InvalidArgument -> ValueError, Timeout -> TimeoutError, Unsupported -> NotImplementedError.
struct ErrorKindInfo {
  ErrorKind kind;
  const char* name;       // Python class name
  const char* kind_name;  // .kind
  PyObject* builtin;      // second base, or null
  const char* doc;
};

constexpr int kKinds = 9;
PyObject* g_error_types[kKinds] = {};

const char* kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return "InvalidArgument";
    case ErrorKind::Mismatch: return "Mismatch";
    case ErrorKind::Timeout: return "Timeout";
    case ErrorKind::Communication: return "Communication";
    case ErrorKind::Checkpoint: return "Checkpoint";
    case ErrorKind::Unsupported: return "Unsupported";
    case ErrorKind::Internal: return "Internal";
    case ErrorKind::NonFinite: return "NonFinite";
    case ErrorKind::OutOfMemory: return "OutOfMemory";
  }
  return "Internal";
}

void register_errors(py::module_& m) {
  PyObject* base = PyErr_NewExceptionWithDoc(
      "shardopt.Error",
      "Base of every shardopt error; .kind names the C++ ErrorKind, .rank the raising rank "
      "(-1 before any communicator existed).",
      PyExc_RuntimeError, nullptr);
  if (!base) throw py::error_already_set();
  m.add_object("Error", py::handle(base));
  const ErrorKindInfo infos[kKinds] = {
      {ErrorKind::InvalidArgument, "InvalidArgumentError", "InvalidArgument", PyExc_ValueError,
       "Bad options, shapes, dtypes or hyper-parameters: the caller can fix the call."},
      {ErrorKind::Mismatch, "MismatchError", "Mismatch", nullptr,
       "Ranks disagree (models, layouts, checkpoints vs models)."},
      {ErrorKind::Timeout, "CommTimeoutError", "Timeout", PyExc_TimeoutError,
       "A collective did not complete within its deadline."},
      {ErrorKind::Communication, "CommunicationError", "Communication", nullptr,
       "The communication engine reported a failure."},
      {ErrorKind::Checkpoint, "CheckpointError", "Checkpoint", nullptr,
       "Missing, corrupt or incompatible checkpoint files."},
      {ErrorKind::Unsupported, "UnsupportedError", "Unsupported", PyExc_NotImplementedError,
       "A valid request this build or engine cannot serve."},
      {ErrorKind::Internal, "InternalError", "Internal", nullptr, "A bug in shardopt."},
      {ErrorKind::NonFinite, "NonFiniteError", "NonFinite", nullptr,
       "NaN/Inf gradients in max_nonfinite_steps consecutive steps (each one skipped)."},
      {ErrorKind::OutOfMemory, "OutOfMemoryError", "OutOfMemory", PyExc_MemoryError,
       "An allocation over MemoryTracker's cap was refused (as a device would refuse it)."},
  };
  for (const auto& info : infos) {
    // pybind11 3's make_tuple returns typed tuples (Tuple<handle, handle> vs Tuple<handle>).
    py::tuple bases = info.builtin
                          ? py::tuple(py::make_tuple(py::handle(base), py::handle(info.builtin)))
                          : py::tuple(py::make_tuple(py::handle(base)));
    const std::string qualified = std::string("shardopt.") + info.name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), info.doc, bases.ptr(), nullptr);
    if (!type) throw py::error_already_set();
    m.add_object(info.name, py::handle(type));
    g_error_types[static_cast<int>(info.kind)] = type;  // module-lifetime reference
  }
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = g_error_types[static_cast<int>(e.kind())];
      py::object exc = py::reinterpret_steal<py::object>(PyObject_CallFunction(type, "s", e.what()));
      if (!exc) return;  // constructing it raised; that error stays set
      exc.attr("kind") = kind_name(e.kind());
      exc.attr("rank") = e.rank();
      PyErr_SetObject(type, exc.ptr());
    }
  });
}

// ---- teardown without the GIL ------------------------------------------------------------------

// Note [Freeing without the GIL]: a communicator's or optimizer's destructor joins the engine's
// worker and waits for collectives in flight, and the worker may need the GIL to drop the last
// reference to a tensor created in Python; pybind11 frees its holders with the GIL held.
// - Optimizers are handed to Python in a holder whose deleter releases the GIL while the real
//   last reference goes.
// - Communicators cannot be: they derive from enable_shared_from_this, so pybind11 rebuilds
//   their holder from shared_from_this() and ignores a custom deleter. The engines instead open
//   a detail::BlockingRegion around the join, and the hooks installed at import release the GIL
//   there (set_gil_hooks below).
template <typename T>
std::shared_ptr<T> freed_without_gil(std::shared_ptr<T> object) {
  if (!object) return object;
  T* raw = object.get();
  return std::shared_ptr<T>(raw, [keep = std::move(object)](T*) mutable {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      keep.reset();
    } else {
      keep.reset();
    }
  });
}

void set_gil_hooks() {
  detail::BlockingHooks hooks;
  hooks.enter = []() -> void* {
    if (!Py_IsInitialized() || !PyGILState_Check()) return nullptr;
    return PyEval_SaveThread();
  };
  hooks.exit = [](void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); };
  detail::set_blocking_hooks(hooks);
}

// ---- the factory path: any torch.optim optimizer over this rank's shard ------------------------

// A Python optimizer object as the torch::optim::Optimizer the engine steps. step() runs with the
// GIL released around it, so it takes the GIL back to call Python.
class PythonShardOptimizer final : public torch::optim::Optimizer {
  struct NoOptions : torch::optim::OptimizerCloneableOptions<NoOptions> {};

 public:
  PythonShardOptimizer(std::vector<at::Tensor> shard, py::object optimizer)
      : torch::optim::Optimizer(std::move(shard), std::make_unique<NoOptions>()),
        optimizer_(std::move(optimizer)) {}
  ~PythonShardOptimizer() override {
    py::gil_scoped_acquire gil;
    optimizer_ = py::object();
  }
  at::Tensor step(LossClosure closure) override {
    py::gil_scoped_acquire gil;
    optimizer_.attr("step")();
    return {};
  }

 private:
  py::object optimizer_;
};

ShardOptimizerFactory python_factory(py::function make) {
  // Copies of the std::function may be made or dropped without the GIL: the callable is released
  // under it.
  std::shared_ptr<py::function> fn(new py::function(std::move(make)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
  return [fn](std::vector<at::Tensor> shard) -> std::unique_ptr<torch::optim::Optimizer> {
    py::gil_scoped_acquire gil;
    py::object optimizer = (*fn)(shard);
    SHARDOPT_CHECK(!optimizer.is_none(), InvalidArgument,
                   "optimizer: the optimizer factory returned None");
    return std::make_unique<PythonShardOptimizer>(std::move(shard), std::move(optimizer));
  };
}

// (names, tensors) per group, in the order of the Python param_groups.
using GroupSpec = std::pair<std::vector<std::string>, std::vector<at::Tensor>>;

std::vector<ParamGroup> to_groups(const std::vector<GroupSpec>& specs) {
  std::vector<ParamGroup> groups;
  for (size_t g = 0; g < specs.size(); ++g) {
    const auto& [names, tensors] = specs[g];
    SHARDOPT_CHECK(names.size() == tensors.size(), InvalidArgument,
                   "optimizer: group {} has {} names for {} parameters", g, names.size(),
                   tensors.size());
    ParamGroup group;
    for (size_t i = 0; i < names.size(); ++i) group.params.push_back({names[i], tensors[i]});
    groups.push_back(std::move(group));
  }
  return groups;
}

Offload parse_offload(const std::string& text) {
  if (const auto o = detail::offload_named(text)) return *o;
  SHARDOPT_FAIL(InvalidArgument, "options: offload must be one of none, cpu, got '{}'", text);
}

// Sets attributes from keyword arguments through the bound properties (so that every field has
// one conversion and one error path).
template <typename T>
void apply_kwargs(T& object, const py::dict& kwargs, const char* type_name) {
  py::object self = py::cast(&object, py::return_value_policy::reference);
  for (auto item : kwargs) {
    const auto key = py::cast<std::string>(item.first);
    py::object field = py::getattr(py::type::of(self), key.c_str(), py::none());
    SHARDOPT_CHECK(PyObject_IsInstance(field.ptr(), reinterpret_cast<PyObject*>(&PyProperty_Type)) == 1,
                   InvalidArgument, "{}: unknown field '{}'", type_name, key);
    self.attr(key.c_str()) = item.second;
  }
}

// ---- the module ------------------------------------------------------------------------------

void bind_options(py::module_& m) {
  py::class_<UnitPolicy>(m, "UnitPolicy",
                         "Stage 3 without units=: how units are derived from the parameters' "
                         "names (include/shardopt/unit_policy.hpp). UnitPolicy(patterns=[...], "
                         "persist_below=100000, persist_share=0.1).")
      .def(py::init([](const py::kwargs& kwargs) {
        UnitPolicy p;
        apply_kwargs(p, kwargs, "UnitPolicy");
        return p;
      }))
      .def_readwrite("patterns", &UnitPolicy::patterns,
                     "regular expressions matched at the start of a name; the match names the "
                     "unit (empty: numbered module-list elements and top-level children)")
      .def_readwrite("persist_below", &UnitPolicy::persist_below,
                     "groups with fewer elements stay gathered for good, smallest first, ...")
      .def_readwrite("persist_share", &UnitPolicy::persist_share,
                     "... while together within this share (0..1) of the model's elements")
      .def("__eq__", [](const UnitPolicy& a, const UnitPolicy& b) {
        return a.patterns == b.patterns && a.persist_below == b.persist_below &&
               a.persist_share == b.persist_share;
      })
      .def("__repr__", [](const UnitPolicy& p) {
        return fmt::format("UnitPolicy(patterns=[{}], persist_below={}, persist_share={})",
                           fmt::join(p.patterns, ", "), p.persist_below, p.persist_share);
      });
  py::class_<LossScaleOptions>(m, "LossScaleOptions",
                               "fp16 dynamic loss scaling (include/shardopt/precision.hpp). "
                               "LossScaleOptions(initial_scale=1024, ...).")
      .def(py::init([](const py::kwargs& kwargs) {
        LossScaleOptions o;
        apply_kwargs(o, kwargs, "LossScaleOptions");
        return o;
      }))
      .def_readwrite("dynamic", &LossScaleOptions::dynamic, "False: a fixed scale of initial_scale")
      .def_readwrite("initial_scale", &LossScaleOptions::initial_scale)
      .def_readwrite("growth_factor", &LossScaleOptions::growth_factor)
      .def_readwrite("growth_interval", &LossScaleOptions::growth_interval)
      .def_readwrite("backoff_factor", &LossScaleOptions::backoff_factor)
      .def_readwrite("hysteresis", &LossScaleOptions::hysteresis)
      .def_readwrite("min_scale", &LossScaleOptions::min_scale)
      .def("validate", &LossScaleOptions::validate);

  py::class_<ZeroOptions>(m, "ZeroOptions",
                          "How DistributedOptimizer shards, communicates and steps "
                          "(include/shardopt/options.hpp). ZeroOptions(stage=1, ...).")
      .def(py::init([](const py::kwargs& kwargs) {
        ZeroOptions o;
        apply_kwargs(o, kwargs, "ZeroOptions");
        return o;
      }))
      .def_property(
          "stage", [](const ZeroOptions& o) { return to_int(o.stage); },
          [](ZeroOptions& o, int stage) { o.stage = stage_from_int(stage); },
          "0: DDP-equivalent, 1: optimizer state, 2: + gradients, 3: + parameters sharded")
      .def_readwrite("bucket_bytes", &ZeroOptions::bucket_bytes)
      .def_readwrite("overlap_comm", &ZeroOptions::overlap_comm)
      .def_readwrite("grad_accumulation_steps", &ZeroOptions::grad_accumulation_steps)
      .def_readwrite("defer_reduction", &ZeroOptions::defer_reduction,
                     "bucketed gradients reduced once per step, summed in their buckets until "
                     "then (Note [Deferred reduction])")
      .def_readwrite("max_grad_norm", &ZeroOptions::max_grad_norm)
      .def_property(
          "precision", [](const ZeroOptions& o) { return std::string(to_string(o.precision)); },
          [](ZeroOptions& o, const std::string& p) { o.precision = parse_precision(p); })
      .def_readwrite("reduce_in_fp32", &ZeroOptions::reduce_in_fp32,
                     "mixed precision: reduce gradients in fp32 (False: in the compute dtype)")
      .def_property(
          "loss_scale", [](ZeroOptions& o) -> LossScaleOptions& { return o.loss_scale; },
          [](ZeroOptions& o, const py::object& value) {
            if (py::isinstance<py::dict>(value)) {
              LossScaleOptions l = o.loss_scale;
              apply_kwargs(l, value.cast<py::dict>(), "LossScaleOptions");
              o.loss_scale = l;
            } else {
              o.loss_scale = value.cast<LossScaleOptions>();
            }
          },
          py::return_value_policy::reference_internal,
          "fp16 loss scaling: a LossScaleOptions, or a dict of its fields")
      .def_readwrite("fused_update", &ZeroOptions::fused_update,
                     "update with the fused CPU kernels where they exist (False: torch ops)")
      .def_property(
          "offload",
          [](const ZeroOptions& o) { return std::string(detail::offload_name(o.offload)); },
          [](ZeroOptions& o, const std::string& p) { o.offload = parse_offload(p); })
      .def_readwrite("broadcast_initial_params", &ZeroOptions::broadcast_initial_params)
      .def_readwrite("align_bytes", &ZeroOptions::align_bytes)
      .def_readwrite("prefetch", &ZeroOptions::prefetch)
      .def_readwrite("reuse_distance", &ZeroOptions::reuse_distance,
                     "stage 3, automatic units: a unit used again within this many unit uses "
                     "stays gathered in forward")
      .def_readwrite("shard_group_size", &ZeroOptions::shard_group_size,
                     "hybrid sharding: shard within groups of this many ranks (0: all)")
      .def_property(
          "reduce_dtype", [](const ZeroOptions& o) { return std::string(to_string(o.reduce_dtype)); },
          [](ZeroOptions& o, const std::string& p) { o.reduce_dtype = parse_precision(p); },
          "dtype gradients are reduced in: fp32, bf16 or fp16")
      .def_readwrite("units", &ZeroOptions::units,
                     "Stage 3: the shardopt.Units gathered together (DistributedOptimizer's "
                     "units= builds it and installs the module hooks)")
      .def_readwrite("unit_policy", &ZeroOptions::unit_policy,
                     "Stage 3 without units: how units are derived from parameter names")
      .def_readwrite("max_nonfinite_steps", &ZeroOptions::max_nonfinite_steps)
      .def_readwrite("reshard_between_uses", &ZeroOptions::reshard_between_uses,
                     "stage 3: release a unit between its uses within a step (True), or hold it "
                     "gathered until the update (False); None: False under pipelines")
      .def_readwrite("grid", &ZeroOptions::grid,
                     "model parallelism: make_parallel_groups(world, tp=, pp=) (pass comm= its "
                     ".dp): clipping and the non-finite check span the grid, counting once the "
                     "parameters not marked with mark_split; the gradients of the parameters "
                     "marked with mark_pipeline_shared (a tied embedding on the first and the "
                     "last stage) are summed between the two stages")
      .def_property(
          "timeout", [](const ZeroOptions& o) { return o.timeout; },
          [](ZeroOptions& o, py::object t) { o.timeout = to_duration(t, o.timeout); })
      .def("validate", &ZeroOptions::validate,
           "Raises InvalidArgumentError (a ValueError) naming the first invalid field.");
}

// Stage 3 from Python: shardopt/optimizer.py declares the units and calls begin/end from forward
// pre-hooks and forward hooks; end() hooks the outputs so backward gathers the unit again.
void bind_units(py::module_& m) {
  py::class_<Units, std::shared_ptr<Units>>(m, "Units",
                                             "Stage-3 units (include/shardopt/units.hpp)")
      .def(py::init<>())
      .def("add",
           [](Units& u, std::string name, std::vector<at::Tensor> parameters) {
             return u.add(std::move(name), std::move(parameters));
           },
           "name"_a, "parameters"_a,
           "Declares a unit gathered as one; returns its index.")
      .def("begin", &Units::begin, "index"_a, py::call_guard<py::gil_scoped_release>(),
           "Before the unit's forward: gathers its parameters (collective).")
      .def("end", &Units::end, "index"_a, "outputs"_a, py::call_guard<py::gil_scoped_release>(),
           "After the unit's forward: hooks the outputs for backward, frees the parameters.")
      .def("__len__", &Units::size)
      .def("name", &Units::name, "index"_a);
}

void bind_optimizer(py::module_& m) {
  py::class_<StepStats>(m, "StepStats", "What the last step() did.")
      .def_readonly("step", &StepStats::step)
      .def_readonly("grad_norm", &StepStats::grad_norm)
      .def_readonly("clipped", &StepStats::clipped)
      .def_readonly("skipped", &StepStats::skipped)
      .def_readonly("nonfinite_steps", &StepStats::nonfinite_steps)
      .def_readonly("loss_scale", &StepStats::loss_scale)
      .def_readonly("reduce_wait_s", &StepStats::reduce_wait_s)
      .def_readonly("unscale_s", &StepStats::unscale_s)
      .def_readonly("check_s", &StepStats::check_s)
      .def_readonly("check_backward_s", &StepStats::check_backward_s)
      .def_readonly("reduce_wait_backward_s", &StepStats::reduce_wait_backward_s)
      .def_readonly("clip_s", &StepStats::clip_s)
      .def_readonly("update_s", &StepStats::update_s)
      .def_readonly("write_back_s", &StepStats::write_back_s)
      .def_readonly("gather_s", &StepStats::gather_s)
      .def_readonly("step_s", &StepStats::step_s)
      .def_readonly("comm_elements", &StepStats::comm_elements)
      .def_readonly("gather_elements", &StepStats::gather_elements)
      .def_readonly("reduce_elements", &StepStats::reduce_elements)
      .def_readonly("orthogonalized", &StepStats::orthogonalized,
                    "Muon: matrices this rank orthogonalised in the step (each once over the ranks)")
      .def_readonly("exchange_bytes", &StepStats::exchange_bytes,
                    "Muon: bytes this rank sent to exchange updates with the matrices' owners")
      .def_readonly("orthogonalize_s", &StepStats::orthogonalize_s)
      .def("__repr__", [](const StepStats& s) {
        return fmt::format("StepStats(step={}, grad_norm={}, clipped={}, skipped={}, "
                           "loss_scale={}, step_s={:.6f}, comm_elements={})",
                           s.step, s.grad_norm, s.clipped ? "True" : "False",
                           s.skipped ? "True" : "False", s.loss_scale, s.step_s, s.comm_elements);
      });

  py::class_<MemoryReport>(m, "MemoryReport", "Bytes this rank holds for the model state.")
      .def_readonly("param_bytes", &MemoryReport::param_bytes)
      .def_readonly("grad_bytes", &MemoryReport::grad_bytes)
      .def_readonly("optimizer_state_bytes", &MemoryReport::optimizer_state_bytes)
      .def_readonly("buffer_bytes", &MemoryReport::buffer_bytes)
      .def_readonly("persistent_param_bytes", &MemoryReport::persistent_param_bytes,
                    "stage 3: the part of param_bytes held whole for good (persistent groups)")
      .def_readonly("snapshot_host_bytes", &MemoryReport::snapshot_host_bytes,
                    "host memory (tmpfs) of this rank's in-memory snapshots; not in total")
      .def_property_readonly("total", &MemoryReport::total)
      .def("__repr__", [](const MemoryReport& r) {
        return fmt::format("MemoryReport(param_bytes={}, grad_bytes={}, optimizer_state_bytes={}, "
                           "buffer_bytes={}, persistent_param_bytes={}, snapshot_host_bytes={}, "
                           "total={})",
                           r.param_bytes, r.grad_bytes, r.optimizer_state_bytes, r.buffer_bytes,
                           r.persistent_param_bytes, r.snapshot_host_bytes, r.total());
      });

  m.def("_rule_names", &detail::rule_names, "The optimizers shardopt runs natively, by name.");
  m.def(
      "_rule_defaults",
      [](const std::string& name, const py::dict& values) {
        return rule_dict(read_rule(name, values, /*strict=*/true));
      },
      "name"_a, "values"_a,
      "The full torch-style hyper-parameters of optimizer `name` with `values` applied; raises "
      "ValueError on unknown names or out-of-range values.");

  // The core the Python class shardopt.DistributedOptimizer wraps; not a torch.optim.Optimizer.
  py::class_<DistributedOptimizer, std::shared_ptr<DistributedOptimizer>>(m, "_Optimizer")
      .def(py::init([](const std::vector<GroupSpec>& groups, const std::string& name,
                       const py::dict& values, CommunicatorPtr comm, const ZeroOptions& options) {
             Rule rule = read_rule(name, values, /*strict=*/true);
             auto specs = to_groups(groups);
             py::gil_scoped_release nogil;  // construction broadcasts and compares layouts
             return freed_without_gil(std::make_shared<DistributedOptimizer>(
                 std::move(specs), std::move(rule), std::move(comm), options));
           }),
           "groups"_a, "name"_a, "values"_a, "comm"_a, "options"_a)
      .def(py::init([](const std::vector<GroupSpec>& groups, py::function factory,
                       CommunicatorPtr comm, const ZeroOptions& options) {
             auto specs = to_groups(groups);
             auto make = python_factory(std::move(factory));
             py::gil_scoped_release nogil;
             return freed_without_gil(std::make_shared<DistributedOptimizer>(
                 std::move(specs), std::move(make), std::move(comm), options));
           }),
           "groups"_a, "factory"_a, "comm"_a, "options"_a)
      .def(
          "step", [](DistributedOptimizer& o) { o.step(); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "zero_grad", [](DistributedOptimizer& o) { o.zero_grad(); },
          py::call_guard<py::gil_scoped_release>())
      // The autograd engine refuses to start while the GIL is held; it takes it back for Python
      // hooks of the model, ours are C++.
      .def("backward", &DistributedOptimizer::backward, "loss"_a,
           py::call_guard<py::gil_scoped_release>())
      .def("last_step", &DistributedOptimizer::last_step)
      .def("memory", &DistributedOptimizer::memory)
      .def_property_readonly("options", &DistributedOptimizer::options)
      .def_property_readonly("communicator", &DistributedOptimizer::communicator)
      .def("gather_full_parameters", &DistributedOptimizer::gather_full_parameters,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("numel", &DistributedOptimizer::numel)
      .def_property_readonly("padded_numel", &DistributedOptimizer::padded_numel)
      .def("group_hyperparameters",
           [](const DistributedOptimizer& o, size_t group) { return rule_dict(o.group_rule(group)); })
      .def(
          "set_group_hyperparameters",
          [](DistributedOptimizer& o, size_t group, const py::dict& values) {
            Rule rule = o.group_rule(group);
            // Unknown keys are what schedulers add to param_groups; the constructor was strict.
            py::dict merged = rule_dict(rule);
            for (auto item : values) merged[item.first] = item.second;
            o.set_group_rule(group, read_rule(rule_name(rule), merged, /*strict=*/false));
          },
          "group"_a, "values"_a)
      // The torch state-dict contract (shardopt/state_dict.hpp); optimizer.py speaks torch's
      // format (integer ids, torch's group keys) over these.
      .def("consolidate_state_dict", &DistributedOptimizer::consolidate_state_dict, "to"_a = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("state_dict",
           [](const DistributedOptimizer& o) {
             const OptimizerStateDict& sd = o.state_dict();
             py::list groups;
             for (const auto& g : sd.groups) {
               py::list params;
               for (const auto& p : g.params) params.append(py::make_tuple(p.name, p.state));
               groups.append(params);
             }
             return py::make_tuple(sd.step, groups);
           })
      .def(
          "load_state_dict",
          [](DistributedOptimizer& o, int64_t step,
             const std::vector<std::vector<std::map<std::string, at::Tensor>>>& groups) {
            OptimizerStateDict sd;
            sd.step = step;
            for (size_t g = 0; g < groups.size(); ++g) {
              // The hyper-parameters stay: optimizer.py writes the loaded ones into param_groups.
              OptimizerStateDict::Group group{o.group_rule(std::min(g, o.param_groups().size() - 1)),
                                              {}};
              for (const auto& buffers : groups[g]) group.params.push_back({"", buffers});
              sd.groups.push_back(std::move(group));
            }
            py::gil_scoped_release nogil;
            o.load_state_dict(sd);
          },
          "step"_a, "groups"_a);
  // Checkpoints (shardopt/checkpoint.hpp): collective save/load; consolidation is one process.
  // The trainer state is JSON text (json.dumps in shardopt/optimizer.py) and per-rank tensors.
  m.def(
      "save_checkpoint",
      [](DistributedOptimizer& o, const std::string& dir, const std::string& json,
         const std::map<std::string, at::Tensor>& tensors,
         const std::map<std::string, at::Tensor>& module_state,
         const std::map<std::string, std::string>& aliases) {
        SaveOptions options;
        options.module_state = module_state;
        options.aliases = aliases;
        shardopt::save_checkpoint(o, dir, TrainerState{json, tensors}, options);
      },
      "optimizer"_a, "directory"_a, "json"_a = "{}",
      "tensors"_a = std::map<std::string, at::Tensor>{},
      "module_state"_a = std::map<std::string, at::Tensor>{},
      "aliases"_a = std::map<std::string, std::string>{}, py::call_guard<py::gil_scoped_release>());
  m.def(
      "load_checkpoint",
      [](DistributedOptimizer& o, const std::string& dir, bool restore_hyperparameters,
         const std::map<std::string, at::Tensor>& module_state) {
        LoadOptions options;
        options.restore_hyperparameters = restore_hyperparameters;
        // The module's own tensors (views, not copies): they are overwritten in place.
        options.module_state = module_state;
        const TrainerState t = shardopt::load_checkpoint(o, dir, options);
        return std::make_pair(t.json, t.tensors);
      },
      "optimizer"_a, "directory"_a, "restore_hyperparameters"_a = true,
      "module_state"_a = std::map<std::string, at::Tensor>{},
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "consolidate_checkpoint",
      [](const std::string& dir, const std::string& out, const std::string& optimizer_out) {
        ConsolidateOptions options;
        options.optimizer_state_out = optimizer_out;
        shardopt::consolidate_checkpoint(dir, out, options);
      },
      "directory"_a, "out"_a, "optimizer_out"_a = "", py::call_guard<py::gil_scoped_release>());
  m.def(
      "read_checkpoint_info",
      [](const std::string& dir) {
        const CheckpointInfo info = shardopt::read_checkpoint_info(dir);
        py::list params;
        for (const auto& p : info.params) {
          params.append(py::dict("name"_a = p.name, "shape"_a = p.shape, "dtype"_a = p.dtype,
                                 "group"_a = p.group, "split"_a = p.split));
        }
        return py::dict("dir"_a = info.dir, "format_version"_a = info.format_version,
                        "world_size"_a = info.world_size, "stage"_a = info.stage,
                        "precision"_a = info.precision, "step"_a = info.step, "rule"_a = info.rule,
                        "state_names"_a = info.state_names, "params"_a = params,
                        "trainer_json"_a = info.trainer_json,
                        "manifest_json"_a = info.manifest_json);
      },
      "directory"_a);
  m.def(
      "read_full_state",
      [](const std::string& dir, bool with_optimizer_state) {
        FullState full;
        {
          py::gil_scoped_release nogil;
          full = shardopt::read_full_state(dir, with_optimizer_state);
        }
        py::dict params, state;
        for (const auto& item : full.params) params[py::str(item.key())] = item.value();
        for (const auto& [name, dict] : full.optimizer_state) {
          py::dict buffers;
          for (const auto& item : dict) buffers[py::str(item.key())] = item.value();
          state[py::str(name)] = buffers;
        }
        return py::dict("params"_a = params, "optimizer_state"_a = state, "step"_a = full.step,
                        "rule"_a = full.rule,
                        "hyperparameters_json"_a = full.hyperparameters_json);
      },
      "directory"_a, "with_optimizer_state"_a = false);
  m.def(
      "load_full_state_dict",
      [](DistributedOptimizer& o, const std::vector<std::pair<std::string, at::Tensor>>& items) {
        torch::OrderedDict<std::string, at::Tensor> params;
        for (const auto& [name, t] : items) params.insert(name, t);
        py::gil_scoped_release nogil;
        return shardopt::load_full_state_dict(o, params);
      },
      "optimizer"_a, "params"_a);
  m.def(
      "load_full_state_files",
      [](DistributedOptimizer& o, const std::string& model_file, const std::string& optimizer_file) {
        return shardopt::load_full_state_dict(o, model_file, optimizer_file);
      },
      "optimizer"_a, "model_file"_a, "optimizer_file"_a = "",
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace
}  // namespace shardopt

PYBIND11_MODULE(_C, m) {
  using namespace shardopt;
  m.doc() = "shardopt's C++ core; use the `shardopt` package";
  m.attr("__version__") = version();
  m.attr("has_mpi") = bool(SHARDOPT_HAS_MPI);
  m.attr("has_gloo") = bool(SHARDOPT_HAS_GLOO);
  m.attr("has_c10d") = bool(SHARDOPT_HAS_C10D);
  m.attr("has_nccl") = bool(SHARDOPT_HAS_NCCL);
  m.attr("has_cuda") = bool(SHARDOPT_HAS_CUDA);
  register_errors(m);
  set_gil_hooks();  // Note [Freeing without the GIL]
  // Raises the Python type of every ErrorKind, so the tests can check the mapping of each.
  m.def("_raise_for_test", [](const std::string& kind, const std::string& message) {
    for (int k = 0; k < kKinds; ++k) {
      if (kind == kind_name(static_cast<ErrorKind>(k))) throw Error(static_cast<ErrorKind>(k), -1, message);
    }
    SHARDOPT_FAIL(InvalidArgument, "_raise_for_test: unknown kind '{}'", kind);
  });
  python::bind_comm(m);
  bind_units(m);
  bind_options(m);
  bind_optimizer(m);
  python::bind_estimate(m);
  python::bind_snapshots(m);
}
