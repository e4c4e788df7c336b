// The MPI engine's collective algorithms (comm/mpi_collectives.hpp). Reductions are our own:
// OpenMPI 4.1's MPI_Reduce_scatter_block allocates per call and reached ~1 GB/s here, the pairwise
// exchange ~4 GB/s (docs/design.md). Each chunk is reduced by exactly one rank and then gathered,
// so all_reduce gives bitwise-identical results on every rank.
#include "comm/mpi_collectives.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

namespace shardopt::detail {
namespace {

void combine(const at::Tensor& acc, const at::Tensor& other, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: acc.add_(other); break;
    case ReduceOp::Max: at::maximum_out(const_cast<at::Tensor&>(acc), acc, other); break;
    case ReduceOp::Min: at::minimum_out(const_cast<at::Tensor&>(acc), acc, other); break;
    case ReduceOp::Avg: SHARDOPT_INTERNAL_ASSERT(false, "Avg reaches the MPI engine as Sum");
  }
}

// Completes `n` requests by polling (Note [Polite waits] in comm/polite_waits.hpp), sleeping
// between polls (20 us, doubling to 1 ms) so that the waiting thread leaves its core.
void wait_politely(MPI_Request* requests, int n, const char* context) {
  constexpr std::chrono::microseconds kFirst{20}, kLongest{1000};
  std::chrono::microseconds pause = kFirst;
  for (;;) {
    int done = 0;
    SHARDOPT_MPI_CHECK(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE), context);
    if (done) return;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kLongest);
  }
}

}  // namespace

// Typed view of the persistent scratch buffer; grows once, never shrinks.
at::Tensor MpiCollectives::scratch(int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (!scratch_.defined() || scratch_.numel() < bytes) {
    scratch_ = at::empty({bytes}, at::kByte);
    scratch_.zero_();  // pre-fault once rather than on the first reduction
  }
  return at::from_blob(scratch_.data_ptr(), {numel}, at::TensorOptions().dtype(dtype));
}

// Pairwise exchange: in step k, send the chunk owned by rank+k and receive our chunk from
// rank-k, then fold it in. Each rank sends and receives (N-1)/N of the input: the minimum.
void MpiCollectives::reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op,
                                    bool polite) {
  const int64_t shard = out.numel();
  const int64_t bytes = static_cast<int64_t>(out.nbytes());
  const int r = rank_, n = size_;
  auto* base = static_cast<char*>(in.data_ptr());
  if (out.data_ptr() != base + r * bytes) std::memcpy(out.data_ptr(), base + r * bytes, bytes);
  if (n == 1 || shard == 0) return;
  // Pieces bound the scratch buffer and keep counts inside MPI's int.
  constexpr int64_t kPieceBytes = int64_t{64} << 20;
  const int64_t elem = static_cast<int64_t>(out.element_size());
  const int64_t piece = std::max<int64_t>(1, kPieceBytes / elem);
  const MPI_Datatype type = mpi_type(out.scalar_type());
  at::Tensor tmp = scratch(std::min(piece, shard), out.scalar_type());
  for (int64_t off = 0; off < shard; off += piece) {
    const int64_t len = std::min(piece, shard - off);
    at::Tensor acc = out.narrow(0, off, len);
    at::Tensor recv = tmp.narrow(0, 0, len);
    for (int k = 1; k < n; ++k) {
      const int dst = (r + k) % n, src = (r - k + n) % n;
      if (polite) {
        MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
        SHARDOPT_MPI_CHECK(MPI_Irecv(recv.data_ptr(), static_cast<int>(len), type, src, 0, comm_,
                                     &requests[0]),
                           "reduce_scatter");
        SHARDOPT_MPI_CHECK(MPI_Isend(base + (dst * shard + off) * elem, static_cast<int>(len),
                                     type, dst, 0, comm_, &requests[1]),
                           "reduce_scatter");
        wait_politely(requests, 2, "reduce_scatter");
      } else {
        SHARDOPT_MPI_CHECK(MPI_Sendrecv(base + (dst * shard + off) * elem,
                                        static_cast<int>(len), type, dst, 0, recv.data_ptr(),
                                        static_cast<int>(len), type, src, 0, comm_,
                                        MPI_STATUS_IGNORE),
                           "reduce_scatter");
      }
      combine(acc, recv, op);
    }
  }
}

void MpiCollectives::all_gather(const at::Tensor& in, const at::Tensor& out, bool polite) {
  const int count = mpi_count(in.numel(), "all_gather");
  const MPI_Datatype type = mpi_type(in.scalar_type());
  auto* own = static_cast<char*>(out.data_ptr()) + rank_ * in.nbytes();
  const void* send = in.data_ptr() == own ? MPI_IN_PLACE : in.data_ptr();
  if (!polite) {
    SHARDOPT_MPI_CHECK(MPI_Allgather(send, count, type, out.data_ptr(), count, type, comm_),
                       "all_gather");
    return;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDOPT_MPI_CHECK(
      MPI_Iallgather(send, count, type, out.data_ptr(), count, type, comm_, &request),
      "all_gather");
  wait_politely(&request, 1, "all_gather");
}

// Reduce-scatter then all-gather in place, on a padded copy when the length does not divide.
void MpiCollectives::all_reduce(const at::Tensor& t, ReduceOp op, bool polite) {
  const int n = size_;
  if (n == 1) return;
  const int64_t shard = (t.numel() + n - 1) / n;
  at::Tensor work = t;
  if (shard * n != t.numel()) {
    if (!padded_.defined() || padded_.numel() < shard * n * t.element_size()) {
      padded_ = at::empty({shard * n * t.element_size()}, at::kByte);
    }
    work = at::from_blob(padded_.data_ptr(), {shard * n}, at::TensorOptions().dtype(t.dtype()));
    work.narrow(0, 0, t.numel()).copy_(t);
    work.narrow(0, t.numel(), shard * n - t.numel()).zero_();
  }
  at::Tensor own = work.narrow(0, rank_ * shard, shard);
  reduce_scatter(work, own, op, polite);
  all_gather(own, work, polite);
  if (!work.is_same(t)) t.copy_(work.narrow(0, 0, t.numel()));
}

void MpiCollectives::broadcast(const at::Tensor& t, int root, bool polite) {
  // Pieces of at most 1 GiB keep the count inside MPI's int.
  constexpr int64_t kPiece = int64_t{1} << 30;
  auto* base = static_cast<char*>(t.data_ptr());
  for (int64_t off = 0; off < static_cast<int64_t>(t.nbytes()); off += kPiece) {
    const int64_t n = std::min<int64_t>(kPiece, t.nbytes() - off);
    if (!polite) {
      SHARDOPT_MPI_CHECK(MPI_Bcast(base + off, static_cast<int>(n), MPI_BYTE, root, comm_),
                         "broadcast");
      continue;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    SHARDOPT_MPI_CHECK(
        MPI_Ibcast(base + off, static_cast<int>(n), MPI_BYTE, root, comm_, &request),
        "broadcast");
    wait_politely(&request, 1, "broadcast");
  }
}

void MpiCollectives::barrier(bool polite) {
  if (!polite) {
    SHARDOPT_MPI_CHECK(MPI_Barrier(comm_), "barrier");
    return;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDOPT_MPI_CHECK(MPI_Ibarrier(comm_, &request), "barrier");
  wait_politely(&request, 1, "barrier");
}

}  // namespace shardopt::detail
