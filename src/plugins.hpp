// Optional parts of shardopt that link CUDA (libshardopt_nccl, libshardopt_cuda) are separate
// shared libraries, so that libshardopt itself never depends on CUDA. Each registers what it
// provides when it is loaded; libshardopt loads one on first need from its own directory (or the
// loader's search path). An application that links one directly registers it at start-up.
#pragma once

#include <string>

#include "shardopt/comm.hpp"

namespace shardopt::detail {

// Loads lib<stem>.so once (RTLD_NOW | RTLD_GLOBAL). Returns "" on success, else why not.
std::string load_plugin(const std::string& stem);

// The NCCL engine's constructor (make_nccl_communicator), registered by libshardopt_nccl.
using NcclFactory = CommunicatorPtr (*)(const CommunicatorPtr& bootstrap, int device);
void register_nccl_factory(NcclFactory factory);
// The registered factory, loading libshardopt_nccl on first use; throws Unsupported naming why
// it is not available.
NcclFactory nccl_factory();

}  // namespace shardopt::detail
