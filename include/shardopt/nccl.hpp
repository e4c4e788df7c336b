/// \file
/// The NCCL engine (built when CUDA and NCCL were found: SHARDOPT_HAS_NCCL). No NCCL or CUDA
/// types in this header.
#pragma once

#include "shardopt/comm.hpp"

namespace shardopt {

/// Creates an NCCL communicator over the same ranks as `bootstrap` (MPI, Gloo, ...), which carries
/// the ncclUniqueId from rank 0. Tensors must live on CUDA device `device`. Collectives are issued
/// on a stream of their own; Work::wait polls a CUDA event against the deadline and aborts the NCCL
/// communicator on timeout, so a missing rank ends in Error{Timeout} rather than a hang.
/// Call on all ranks.
CommunicatorPtr make_nccl_communicator(const CommunicatorPtr& bootstrap, int device);

}  // namespace shardopt
