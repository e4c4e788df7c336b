// The MPI engine's collective algorithms (src/comm/mpi_communicator.cpp runs them on its worker):
// reduce-scatter as a pairwise exchange into a persistent scratch buffer plus an ATen add,
// all-gather, all-reduce as the two, broadcast and barrier, each blocking or waited for politely
// (Note [Polite waits] in comm/polite_waits.hpp). Internal; needs <mpi.h>.
#pragma once

#include <ATen/ATen.h>
#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>

#include "shardopt/comm.hpp"  // ReduceOp
#include "shardopt/error.hpp"

#define SHARDOPT_MPI_CHECK(call, context)                                                      \
  do {                                                                                         \
    const int shardopt_mpi_rc = (call);                                                        \
    if (shardopt_mpi_rc != MPI_SUCCESS) {                                                      \
      char shardopt_mpi_msg[MPI_MAX_ERROR_STRING];                                             \
      int shardopt_mpi_len = 0;                                                                \
      MPI_Error_string(shardopt_mpi_rc, shardopt_mpi_msg, &shardopt_mpi_len);                  \
      SHARDOPT_FAIL(Communication, "comm.mpi: {} failed in {}: {}", #call, context,            \
                    std::string(shardopt_mpi_msg, shardopt_mpi_len));                          \
    }                                                                                          \
  } while (false)

namespace shardopt::detail {

// MPI only moves bytes here; reductions are done by ATen, so 16-bit floats travel as uint16.
inline MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kHalf: case at::kBFloat16: return MPI_UINT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    default: SHARDOPT_FAIL(InvalidArgument, "comm.mpi: no MPI type for {}", c10::toString(t));
  }
}

inline int mpi_count(int64_t numel, const char* op) {
  SHARDOPT_CHECK(numel <= INT_MAX, InvalidArgument,
                 "comm.mpi: {} of {} elements per rank exceeds MPI's int count ({}); use smaller "
                 "buckets", op, numel, INT_MAX);
  return static_cast<int>(numel);
}

// One communicator's collectives, called by one thread at a time (the engine's worker).
class MpiCollectives {
 public:
  MpiCollectives(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}

  void reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op, bool polite);
  void all_gather(const at::Tensor& in, const at::Tensor& out, bool polite);
  void all_reduce(const at::Tensor& t, ReduceOp op, bool polite);
  void broadcast(const at::Tensor& t, int root, bool polite);
  void barrier(bool polite);

 private:
  at::Tensor scratch(int64_t numel, at::ScalarType dtype);

  MPI_Comm comm_;
  int rank_, size_;
  at::Tensor scratch_;
  at::Tensor padded_;
};

}  // namespace shardopt::detail
