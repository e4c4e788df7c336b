// Python bindings of the communicators: ReduceOp, Capabilities, Work, Communicator and the
// engines' factories (init_from_env, Gloo, c10d groups). Calls that communicate release the GIL.
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "shardopt/shardopt.hpp"

#if SHARDOPT_HAS_C10D
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "shardopt/process_group.hpp"
#include "shardopt/process_group_splitter.hpp"
#endif

namespace py = pybind11;
using namespace pybind11::literals;

namespace shardopt::python {

Duration to_duration(py::handle value, Duration otherwise) {
  if (value.is_none()) return otherwise;
  double seconds = 0;
  if (py::hasattr(value, "total_seconds")) {
    seconds = value.attr("total_seconds")().cast<double>();
  } else {
    SHARDOPT_CHECK(!py::isinstance<py::bool_>(value) &&
                       (PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr())),
                   InvalidArgument,
                   "timeout must be a datetime.timedelta or a number of seconds, got {}",
                   py::str(py::repr(value)).cast<std::string>());
    seconds = py::cast<double>(value);
  }
  SHARDOPT_CHECK(seconds > 0, InvalidArgument, "timeout must be positive, got {} s", seconds);
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(seconds));
}

void bind_comm(py::module_& m) {
  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("SUM", ReduceOp::Sum)
      .value("AVG", ReduceOp::Avg)
      .value("MAX", ReduceOp::Max)
      .value("MIN", ReduceOp::Min);

  py::class_<Capabilities>(m, "Capabilities")
      .def_readonly("native_avg", &Capabilities::native_avg)
      .def_readonly("native_reduce_scatter", &Capabilities::native_reduce_scatter)
      .def_readonly("overlaps_caller", &Capabilities::overlaps_caller)
      .def_readonly("cpu_tensors", &Capabilities::cpu_tensors)
      .def_readonly("cuda_tensors", &Capabilities::cuda_tensors)
      .def_readonly("can_time_out", &Capabilities::can_time_out);

  py::class_<Work, std::shared_ptr<Work>>(m, "Work",
                                          "Handle of an issued collective (async_op=True).")
      .def(
          "wait",
          [](Work& w, py::object timeout) {
            const Duration deadline = to_duration(timeout, Duration::zero());
            py::gil_scoped_release nogil;
            w.wait(deadline);
          },
          "timeout"_a = py::none(),
          "Blocks until the result is in the output tensors. timeout: a datetime.timedelta or "
          "seconds; None means the communicator's. Raises CommTimeoutError after it.")
      .def("is_completed", &Work::is_completed, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("description", &Work::description);

  auto none_if_sync = [](WorkPtr w, bool async) { return async ? w : WorkPtr(); };
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "Collectives on flat contiguous tensors; every rank must make the same calls in the same "
      "order. reduce_scatter/all_gather follow NCCL's in-place contract: rank r's shard is "
      "[r*S, (r+1)*S) of the full buffer.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend", &Communicator::backend)
      .def_property_readonly("capabilities", &Communicator::capabilities)
      .def_property(
          "timeout", &Communicator::timeout,
          [](Communicator& c, py::object t) { c.set_timeout(to_duration(t, c.timeout())); })
      .def(
          "all_reduce",
          [none_if_sync](Communicator& c, const at::Tensor& t, ReduceOp op, bool async) {
            py::gil_scoped_release nogil;
            return none_if_sync(c.all_reduce(t, op, async), async);
          },
          "tensor"_a, "op"_a = ReduceOp::Sum, "async_op"_a = false)
      .def(
          "reduce_scatter",
          [none_if_sync](Communicator& c, const at::Tensor& in, const at::Tensor& out,
                         ReduceOp op, bool async) {
            py::gil_scoped_release nogil;
            return none_if_sync(c.reduce_scatter(in, out, op, async), async);
          },
          "input"_a, "output"_a, "op"_a = ReduceOp::Sum, "async_op"_a = false)
      .def(
          "all_gather",
          [none_if_sync](Communicator& c, const at::Tensor& in, const at::Tensor& out,
                         bool async) {
            py::gil_scoped_release nogil;
            return none_if_sync(c.all_gather(in, out, async), async);
          },
          "input"_a, "output"_a, "async_op"_a = false)
      .def(
          "broadcast",
          [none_if_sync](Communicator& c, const at::Tensor& t, int root, bool async) {
            py::gil_scoped_release nogil;
            return none_if_sync(c.broadcast(t, root, async), async);
          },
          "tensor"_a, "root"_a = 0, "async_op"_a = false)
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("split", &Communicator::split, "color"_a, "key"_a,
           py::call_guard<py::gil_scoped_release>(),
           "A sub-communicator of the ranks passing the same color, ordered by key (as "
           "MPI_Comm_split); a negative color gives None. Collective.")
      .def("__repr__", [](const Communicator& c) {
        return fmt::format("<shardopt.Communicator backend={} rank={} size={}>", c.backend(),
                           c.rank(), c.size());
      });

  m.def(
      "init_from_env",
      [](const std::string& backend, const std::string& device, py::object timeout) {
        InitOptions o;
        o.backend = backend;
        o.device = device;
        o.timeout = to_duration(timeout, default_timeout());
        py::gil_scoped_release nogil;
        return init_from_env(o);
      },
      "backend"_a = "", "device"_a = "cpu", "timeout"_a = py::none(),
      "The communicator this process was launched for: mpirun/srun -> 'mpi'; torchrun's RANK, "
      "WORLD_SIZE, MASTER_ADDR, MASTER_PORT -> 'gloo'; otherwise 'single'. SHARDOPT_BACKEND or "
      "backend= override the choice.");
  m.def("make_single_communicator", [] { return make_single_communicator(); });
  // The thread engine (shardopt/threads.hpp): each rank thread holds the GIL only while it runs
  // Python; the communicator's waits release it (detail::BlockingRegion).
  m.def(
      "_run_ranks",
      [](int n, py::function fn, py::object timeout) {
        ThreadRanksOptions options;
        options.timeout = to_duration(timeout, default_timeout());
        py::gil_scoped_release nogil;
        run_ranks(n, [&fn](const CommunicatorPtr& comm) {
          py::gil_scoped_acquire gil;
          fn(comm);
        }, options);
      },
      "n"_a, "fn"_a, "timeout"_a = py::none());

  // The rank grid of model parallelism (shardopt/parallel_layout.hpp).
  py::class_<ParallelGroups>(m, "ParallelGroups",
                             "The groups of make_parallel_groups: world, tp, dp, pp and this "
                             "rank's place in each")
      .def_readonly("world", &ParallelGroups::world)
      .def_readonly("tp", &ParallelGroups::tp)
      .def_readonly("dp", &ParallelGroups::dp)
      .def_readonly("embedding", &ParallelGroups::embedding,
                    "pp > 1: the first and the last stage's data-parallel ranks (None elsewhere)")
      .def_readonly("pp", &ParallelGroups::pp)
      .def_readonly("tp_rank", &ParallelGroups::tp_rank)
      .def_readonly("dp_rank", &ParallelGroups::dp_rank)
      .def_readonly("pp_rank", &ParallelGroups::pp_rank)
      .def_property_readonly("layout",
                             [](const ParallelGroups& g) { return g.layout.to_string(); })
      .def(py::init<>(), "No model parallelism (every group None): ZeroOptions.grid's default.")
      .def("__eq__",
           [](const ParallelGroups& a, const ParallelGroups& b) {
             return a.world == b.world && a.tp == b.tp && a.dp == b.dp && a.pp == b.pp &&
                    a.embedding == b.embedding;
           })
      .def("__repr__", [](const ParallelGroups& g) {
        return g.dp ? "ParallelGroups(" + g.layout.to_string() + ")" : "ParallelGroups(none)";
      });
  m.def(
      "make_parallel_groups",
      [](const CommunicatorPtr& world, int tp, int pp, int dp) {
        py::gil_scoped_release nogil;
        return make_parallel_groups(world, ParallelLayout{tp, pp, dp});
      },
      "world"_a, "tp"_a = 1, "pp"_a = 1, "dp"_a = 0,
      "Cuts `world` into tensor-parallel (innermost), data-parallel and pipeline groups: world "
      "rank = tp_rank + tp * (dp_rank + dp * pp_rank); dp = 0: world.size / (tp * pp). Collective.");
  // Note [Split records] (shardopt/tensor_parallel.hpp): what the optimizer and checkpoints read
  // instead of names.
  m.def("mark_split", &tp::mark_split, "param"_a, "group"_a, "dim"_a, "full_size"_a,
        "padded_size"_a,
        "Records that `param` is this rank's slice of a tensor split along `dim` over `group` "
        "(padded_size = param.size(dim) * group.size, full_size <= padded_size without padding).");
  m.def("mark_replicated", &tp::mark_replicated, "param"_a, "group"_a,
        "Records that every rank of `group` holds `param` whole (counted once in the clipping "
        "norm; unmarked parameters are taken as replicated).");
  m.def("mark_pipeline_shared", &mark_pipeline_shared, "param"_a,
        "Records that the first and the last pipeline stage each hold a copy of `param` (a tied "
        "embedding): the optimizer, given ZeroOptions.grid, sums their gradients. Without "
        "pipelines it means nothing.");
  m.def(
      "split_of",
      [](const at::Tensor& param) -> py::object {
        const auto s = tp::split_of(param);
        if (!s) return py::none();
        return py::make_tuple(s->dim, s->full_size, s->padded_size);
      },
      "param"_a, "The (dim, full_size, padded_size) `param` is split by, or None.");
#if SHARDOPT_HAS_C10D
  m.def(
      "_make_process_group_communicator",
      [](c10::intrusive_ptr<c10d::ProcessGroup> group, py::object splitter) {
        if (splitter.is_none()) return make_process_group_communicator(std::move(group));
        // split() calls it from C++ without the GIL; the last reference goes with the GIL (or
        // is left to the process's exit once the interpreter is gone).
        std::shared_ptr<py::object> fn(new py::object(std::move(splitter)), [](py::object* f) {
          if (!Py_IsInitialized()) return;
          py::gil_scoped_acquire gil;
          delete f;
        });
        ProcessGroupSplitter split = [fn](int color, int key) {
          py::gil_scoped_acquire gil;
          py::object sub = (*fn)(color, key);
          return sub.is_none() ? c10::intrusive_ptr<c10d::ProcessGroup>{}
                               : sub.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        };
        return make_process_group_communicator(std::move(group), std::move(split));
      },
      "group"_a, "splitter"_a = py::none(),
      "A communicator over a torch.distributed group; `splitter(color, key)`, called on every "
      "rank alike by split(), returns this rank's subgroup (ranks of its color ordered by key).");
#endif
#if SHARDOPT_HAS_GLOO
  m.def(
      "make_gloo_communicator",
      [](int rank, int size, const std::string& store, py::object timeout) {
        GlooOptions o;
        o.rank = rank;
        o.size = size;
        o.store = store;
        o.timeout = to_duration(timeout, default_timeout());
        py::gil_scoped_release nogil;
        return make_gloo_communicator(o);
      },
      "rank"_a, "size"_a, "store"_a, "timeout"_a = py::none(),
      "A Gloo communicator of its own; store: 'file:/path' or 'tcp://host:port' (rank 0 serves).");
#endif
}

}  // namespace shardopt::python
