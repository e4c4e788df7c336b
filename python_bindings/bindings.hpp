// What the binding TUs of shardopt._C share (PYBIND11_MODULE is in shardopt_py.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "shardopt/comm.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::python {

// Timeouts from Python: a datetime.timedelta or seconds (int or float); None -> `otherwise`.
Duration to_duration(pybind11::handle value, Duration otherwise);

// bind_rules.cpp: torch-style hyper-parameter dicts <-> rules. read_rule raises InvalidArgument
// (ValueError) naming an unknown optimizer, name or out-of-range value; with strict=false, names
// it does not know are ignored (what LR schedulers add to param_groups).
Rule read_rule(const std::string& name, const pybind11::dict& values, bool strict);
pybind11::dict rule_dict(const Rule& rule);  // what param_groups hold

void bind_comm(pybind11::module_& m);      // bind_comm.cpp: engines, Work, init_from_env
void bind_estimate(pybind11::module_& m);  // bind_estimate.cpp: the analytic memory model
void bind_snapshots(pybind11::module_& m);  // bind_snapshots.cpp: MemorySnapshots

}  // namespace shardopt::python
