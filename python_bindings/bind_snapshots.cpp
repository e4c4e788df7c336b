// Python bindings of the snapshots in host memory (shardopt/snapshot.hpp, Note [Snapshots in
// memory]): SnapshotTiming, RestoreReport and _MemorySnapshots, which shardopt/snapshot.py wraps.
// The trainer state crosses as JSON text and {name: tensor}, as for save_checkpoint.
#include <torch/extension.h>

#include <pybind11/stl.h>
#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>

#include "bindings.hpp"
#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/snapshot.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace shardopt::python {
namespace {

// MemorySnapshots keeps a reference to its optimizer: the Python object holds the optimizer's
// holder too (whose last reference is dropped without the GIL, Note [Freeing without the GIL]),
// and is freed first. Its destructor joins the background thread, which never takes the GIL but
// may wait on collectives of other ranks that need this thread's GIL to get there.
struct PySnapshots {
  std::shared_ptr<DistributedOptimizer> optimizer;
  std::unique_ptr<MemorySnapshots> snapshots;

  PySnapshots(std::shared_ptr<DistributedOptimizer> o, const CommunicatorPtr& world,
              const SnapshotOptions& options)
      : optimizer(std::move(o)) {
    SHARDOPT_CHECK(optimizer != nullptr, InvalidArgument, "MemorySnapshots: optimizer is None");
    const CommunicatorPtr& comm = world ? world : optimizer->communicator();
    py::gil_scoped_release nogil;  // collective: splits communicators, agrees on the directory
    snapshots = std::make_unique<MemorySnapshots>(*optimizer, comm, options);
  }
  ~PySnapshots() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      snapshots.reset();
    } else {
      snapshots.reset();
    }
  }
  PySnapshots(const PySnapshots&) = delete;
  PySnapshots& operator=(const PySnapshots&) = delete;
};

}  // namespace

void bind_snapshots(py::module_& m) {
  py::class_<SnapshotTiming>(m, "SnapshotTiming", "Times of the last snapshot (seconds).")
      .def_readonly("blocking_s", &SnapshotTiming::blocking_s,
                    "inside snapshot(): joining the previous one, the copy")
      .def_readonly("background_s", &SnapshotTiming::background_s,
                    "checksum, the buddy exchange, the agreement, the commit (once joined)")
      .def("__repr__", [](const SnapshotTiming& t) {
        return fmt::format("SnapshotTiming(blocking_s={:.6f}, background_s={:.6f})", t.blocking_s,
                           t.background_s);
      });
  py::class_<RestoreReport>(m, "RestoreReport", "What MemorySnapshots.restore() found and did.")
      .def_readonly("restored", &RestoreReport::restored, "whether a snapshot was restored")
      .def_readonly("number", &RestoreReport::number,
                    "the snapshot's number (counted by snapshot() calls over the job); -1: none")
      .def_readonly("step", &RestoreReport::step, "the optimizer's step count it holds")
      .def_readonly("from_buddy", &RestoreReport::from_buddy,
                    "ranks whose own host had lost their copy (sent by their buddy)")
      .def_readonly("seconds", &RestoreReport::seconds, "the whole restore, on this rank")
      .def_readonly("reason", &RestoreReport::reason,
                    "why nothing was restored ('no snapshot ...', another world size, ...)")
      .def("__bool__", [](const RestoreReport& r) { return r.restored; })
      .def("__repr__", [](const RestoreReport& r) {
        return fmt::format("RestoreReport(restored={}, number={}, step={}, from_buddy={}, "
                           "seconds={:.6f}, reason='{}')",
                           r.restored ? "True" : "False", r.number, r.step, r.from_buddy,
                           r.seconds, r.reason);
      });
  py::class_<PySnapshots>(m, "_MemorySnapshots")
      .def(py::init([](std::shared_ptr<DistributedOptimizer> optimizer, CommunicatorPtr world,
                       const std::string& dir, int ranks_per_host) {
             return std::make_unique<PySnapshots>(std::move(optimizer), world,
                                                  SnapshotOptions{dir, ranks_per_host});
           }),
           "optimizer"_a, "world"_a, "dir"_a, "ranks_per_host"_a = 0)
      .def(
          "snapshot",
          [](PySnapshots& s, const std::string& json,
             const std::map<std::string, at::Tensor>& tensors) {
            s.snapshots->snapshot(TrainerState{json, tensors});
          },
          "json"_a = "{}", "tensors"_a = std::map<std::string, at::Tensor>{},
          py::call_guard<py::gil_scoped_release>())
      .def(
          "wait", [](PySnapshots& s) { s.snapshots->wait(); },
          py::call_guard<py::gil_scoped_release>())
      .def("restore",
           [](PySnapshots& s) {
             RestoreReport report;
             std::optional<TrainerState> t;
             {
               py::gil_scoped_release nogil;
               t = s.snapshots->restore(&report);
             }
             py::object state = py::none();
             if (t) state = py::make_tuple(t->json, t->tensors);
             return py::make_tuple(state, report);
           })
      .def(
          "remove", [](PySnapshots& s) { s.snapshots->remove(); },
          py::call_guard<py::gil_scoped_release>())
      .def("last_timing", [](const PySnapshots& s) { return s.snapshots->last_timing(); })
      .def("host_bytes", [](const PySnapshots& s) { return s.snapshots->host_bytes(); })
      .def("buddy", [](const PySnapshots& s) { return s.snapshots->buddy(); });
}

}  // namespace shardopt::python
