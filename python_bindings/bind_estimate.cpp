// Python bindings of the analytic memory/communication model (shardopt/estimate.hpp).
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "shardopt/estimate.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace shardopt::python {

void bind_estimate(py::module_& m) {
  namespace est = shardopt::estimate;
  py::class_<est::Breakdown>(m, "MemoryBreakdown", "Bytes of one kind of memory per rank.")
      .def_readonly("params", &est::Breakdown::params)
      .def_readonly("grads", &est::Breakdown::grads)
      .def_readonly("optimizer_state", &est::Breakdown::optimizer_state)
      .def_readonly("buffers", &est::Breakdown::buffers)
      .def_property_readonly("model_state", &est::Breakdown::model_state)
      .def_property_readonly("total", &est::Breakdown::total)
      .def("__repr__", [](const est::Breakdown& b) {
        return fmt::format("MemoryBreakdown(params={}, grads={}, optimizer_state={}, buffers={})",
                           b.params, b.grads, b.optimizer_state, b.buffers);
      });
  py::class_<est::Estimate>(m, "Estimate", "Analytic memory/communication model of one rank.")
      .def_readonly("padded_params", &est::Estimate::padded_params)
      .def_readonly("p", &est::Estimate::p)
      .def_readonly("g", &est::Estimate::g)
      .def_readonly("k", &est::Estimate::k)
      .def_readonly("device", &est::Estimate::device)
      .def_readonly("host", &est::Estimate::host)
      .def_readonly("comm_elements", &est::Estimate::comm_elements)
      .def_readonly("comm_bytes", &est::Estimate::comm_bytes)
      .def_readonly("wire_bytes", &est::Estimate::wire_bytes)
      .def_readonly("gathered_units_params", &est::Estimate::gathered_units_params)
      .def_property_readonly("total", &est::Estimate::total)
      .def_property_readonly("model_state", &est::Estimate::model_state)
      .def("__repr__", [](const est::Estimate& e) {
        return fmt::format("Estimate(stage={}, world={}, params={}, device_total={}, "
                           "host_total={}, comm_elements={})",
                           e.options.stage, e.options.world, e.padded_params, e.device.total(),
                           e.host.total(), e.comm_elements);
      });
  m.def(
      "estimate",
      [](int64_t params, int world, int stage, const std::string& precision,
         const std::string& offload, const std::string& optimizer, int state_bytes,
         int64_t bucket_bytes, int64_t align_bytes, int64_t gathered_units_params) {
        est::Options o;
        o.params = params;
        o.world = world;
        o.stage = stage;
        o.precision = est::parse_precision(precision);
        o.offload = est::parse_offload(offload);
        o.optimizer = est::parse_optimizer(optimizer);
        o.state_bytes = state_bytes;
        o.bucket_bytes = bucket_bytes;
        o.align_bytes = align_bytes;
        o.gathered_units_params = gathered_units_params;
        return est::model_states(o);
      },
      "params"_a, "world"_a = 1, "stage"_a = 2, "precision"_a = "fp32", "offload"_a = "none",
      "optimizer"_a = "adamw", "state_bytes"_a = -1, "bucket_bytes"_a = 0,
      "align_bytes"_a = 0, "gathered_units_params"_a = 0,
      "Bytes of model state per rank for `params` trainable parameters on `world` ranks "
      "(docs/stages.md). Raises ValueError on invalid arguments.");
  m.def(
      "bert_parameter_count",
      [](const std::string& preset) { return est::bert_parameter_count(preset); }, "preset"_a,
      "Parameters of BERT pretraining (tied decoder): tiny, mini, small, base or large.");
}

}  // namespace shardopt::python
