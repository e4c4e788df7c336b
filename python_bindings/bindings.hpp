// What the binding TUs of shardopt._C share (PYBIND11_MODULE is in shardopt_py.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include "shardopt/comm.hpp"

namespace shardopt::python {

// Timeouts from Python: a datetime.timedelta or seconds (int or float); None -> `otherwise`.
Duration to_duration(pybind11::handle value, Duration otherwise);

void bind_comm(pybind11::module_& m);      // bind_comm.cpp: engines, Work, init_from_env
void bind_estimate(pybind11::module_& m);  // bind_estimate.cpp: the analytic memory model

}  // namespace shardopt::python
