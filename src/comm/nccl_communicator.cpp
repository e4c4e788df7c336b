// The NCCL engine on raw device pointers and one CUDA stream; needs only the CUDA runtime and
// NCCL, so it compiles wherever they are installed (CI included) and runs on a GPU machine.
// Collectives on CUDA tensors wait for torch's current stream (torch_stream.hpp); collectives on
// host tensors (the optimizer's flags and partial norms, checkpoint agreement) go through the
// bootstrap engine. Loading libshardopt_nccl registers the engine for init_from_env().
#include "shardopt/nccl.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <thread>

#include "comm/engines.hpp"
#include "plugins.hpp"
#include "shardopt/error.hpp"
#include "torch_stream.hpp"

#define SHARDOPT_CUDA_CHECK(call, context)                                                     \
  do {                                                                                         \
    const cudaError_t shardopt_cuda_rc = (call);                                               \
    SHARDOPT_CHECK(shardopt_cuda_rc == cudaSuccess, Communication, "comm.nccl: {} failed in {}: {}", \
                   #call, context, cudaGetErrorString(shardopt_cuda_rc));                      \
  } while (false)

#define SHARDOPT_NCCL_CHECK(call, context)                                                     \
  do {                                                                                         \
    const ncclResult_t shardopt_nccl_rc = (call);                                              \
    SHARDOPT_CHECK(shardopt_nccl_rc == ncclSuccess, Communication, "comm.nccl: {} failed in {}: {}", \
                   #call, context, ncclGetErrorString(shardopt_nccl_rc));                      \
  } while (false)

namespace shardopt {
namespace {

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    default: SHARDOPT_FAIL(InvalidArgument, "comm.nccl: no NCCL type for {}", c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

struct NcclState {
  ncclComm_t comm = nullptr;
  std::atomic<bool> aborted{false};
};

class NcclWork final : public Work {
 public:
  NcclWork(std::string description, Duration timeout, cudaEvent_t event,
           std::shared_ptr<NcclState> state)
      : Work(std::move(description), timeout), event_(event), state_(std::move(state)) {}
  ~NcclWork() override { cudaEventDestroy(event_); }
  bool is_completed() override { return cudaEventQuery(event_) == cudaSuccess; }

 protected:
  // Polls the event and NCCL's async error state until the deadline, then aborts the communicator
  // so that the kernels waiting for a missing peer return.
  bool wait_for(Duration timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const cudaError_t rc = cudaEventQuery(event_);
      if (rc == cudaSuccess) return true;
      SHARDOPT_CHECK(rc == cudaErrorNotReady, Communication, "comm.nccl: {} failed: {}",
                     description(), cudaGetErrorString(rc));
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(state_->comm, &async_error);
      SHARDOPT_CHECK(async_error == ncclSuccess, Communication, "comm.nccl: {} failed: {}",
                     description(), ncclGetErrorString(async_error));
      if (std::chrono::steady_clock::now() >= deadline) {
        if (!state_->aborted.exchange(true)) ncclCommAbort(state_->comm);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  cudaEvent_t event_;
  std::shared_ptr<NcclState> state_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, const ncclUniqueId& id,
                   CommunicatorPtr bootstrap)
      : Communicator(rank, size), device_(device), bootstrap_(std::move(bootstrap)) {
    SHARDOPT_CUDA_CHECK(cudaSetDevice(device_), "make_nccl_communicator");
    SHARDOPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                        "make_nccl_communicator");
    SHARDOPT_NCCL_CHECK(ncclCommInitRank(&state_->comm, size, id, rank), "make_nccl_communicator");
  }
  // Adopts `comm`, a communicator ncclCommSplit made from a parent's.
  NcclCommunicator(ncclComm_t comm, int device, CommunicatorPtr bootstrap)
      : Communicator(bootstrap->rank(), bootstrap->size()), device_(device),
        bootstrap_(std::move(bootstrap)) {
    state_->comm = comm;
    SHARDOPT_CUDA_CHECK(cudaSetDevice(device_), "comm.split on nccl");
    SHARDOPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                        "comm.split on nccl");
    int nccl_rank = -1, nccl_size = -1;
    SHARDOPT_NCCL_CHECK(ncclCommUserRank(comm, &nccl_rank), "comm.split on nccl");
    SHARDOPT_NCCL_CHECK(ncclCommCount(comm, &nccl_size), "comm.split on nccl");
    SHARDOPT_INTERNAL_ASSERT(nccl_rank == rank() && nccl_size == size(),
                             "comm.split on nccl: NCCL made rank {} of {}, the bootstrap {} of {}",
                             nccl_rank, nccl_size, rank(), size());
  }
  ~NcclCommunicator() override {
    if (!state_->aborted) ncclCommDestroy(state_->comm);
    cudaStreamDestroy(stream_);
  }

  std::string backend() const override { return "nccl"; }
  Capabilities capabilities() const override {
    Capabilities caps;
    caps.native_avg = true;
    caps.cpu_tensors = bootstrap_->capabilities().cpu_tensors;  // through the bootstrap engine
    caps.cuda_tensors = true;
    return caps;
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op) override {
    if (t.is_cpu()) return bootstrap_->all_reduce(t, op, true);
    check_device(t);
    SHARDOPT_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                      nccl_type(t.scalar_type()), nccl_op(op), state_->comm, stream_),
                        "all_reduce");
    return record(fmt::format("all_reduce({}, {}) on nccl", describe(t), to_string(op)));
  }
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) override {
    if (in.is_cpu()) return bootstrap_->reduce_scatter(in, out, op, true);
    check_device(in);
    SHARDOPT_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                          nccl_type(out.scalar_type()), nccl_op(op), state_->comm,
                                          stream_),
                        "reduce_scatter");
    return record(fmt::format("reduce_scatter({} -> {}) on nccl", describe(in), describe(out)));
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    if (in.is_cpu()) return bootstrap_->all_gather(in, out, true);
    check_device(in);
    SHARDOPT_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(),
                                      nccl_type(in.scalar_type()), state_->comm, stream_),
                        "all_gather");
    return record(fmt::format("all_gather({} -> {}) on nccl", describe(in), describe(out)));
  }
  WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    if (t.is_cpu()) return bootstrap_->broadcast(t, root, true);
    check_device(t);
    SHARDOPT_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(),
                                      nccl_type(t.scalar_type()), root, state_->comm, stream_),
                        "broadcast");
    return record(fmt::format("broadcast({}, root {}) on nccl", describe(t), root));
  }
  // The bootstrap engine splits alike (CPU tensors and the unique id travel through it). NCCL
  // 2.18+ splits the communicator itself (ncclCommSplit: no new bootstrap, resources shared with
  // the parent where NCCL can); older NCCL builds a new one over the split bootstrap. Both order
  // ranks by key, then by rank here, as MPI_Comm_split.
  CommunicatorPtr do_split(int color, int key) override {
    CommunicatorPtr sub_bootstrap = bootstrap_->split(color, key);
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    ncclComm_t sub = nullptr;
    SHARDOPT_CUDA_CHECK(cudaSetDevice(device_), "comm.split on nccl");
    SHARDOPT_NCCL_CHECK(ncclCommSplit(state_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                      &sub, nullptr),
                        "comm.split on nccl");
    if (color < 0) return nullptr;
    return std::make_shared<NcclCommunicator>(sub, device_, std::move(sub_bootstrap));
#else
    if (color < 0) return nullptr;
    return make_nccl_communicator(sub_bootstrap, device_);
#endif
  }

  // One NCCL group per batch, so a rank may send to and receive from a peer in one batch (NCCL
  // pairs the two sides' groups). NCCL cannot check a message's dtype or size (Note
  // [Point-to-point messages]); host tensors go through the bootstrap engine, which can.
  WorkPtr do_batch_isend_irecv(const std::vector<P2pOp>& ops) override {
    const bool host = ops.front().tensor.is_cpu();
    for (const auto& op : ops) {
      SHARDOPT_CHECK(op.tensor.is_cpu() == host, InvalidArgument,
                     "comm.nccl: a batch_isend_irecv mixes host and CUDA tensors ({}); issue "
                     "them as two batches",
                     detail::describe_p2p(op, "nccl"));
    }
    if (host) return bootstrap_->batch_isend_irecv(ops);
    for (const auto& op : ops) check_device(op.tensor);
    SHARDOPT_NCCL_CHECK(ncclGroupStart(), "batch_isend_irecv");
    for (const auto& op : ops) {
      const auto type = nccl_type(op.tensor.scalar_type());
      if (op.kind == P2pOp::Kind::Send) {
        SHARDOPT_NCCL_CHECK(ncclSend(op.tensor.data_ptr(), op.tensor.numel(), type, op.peer,
                                     state_->comm, stream_),
                            detail::describe_p2p(op, "nccl"));
      } else {
        SHARDOPT_NCCL_CHECK(ncclRecv(op.tensor.data_ptr(), op.tensor.numel(), type, op.peer,
                                     state_->comm, stream_),
                            detail::describe_p2p(op, "nccl"));
      }
    }
    SHARDOPT_NCCL_CHECK(ncclGroupEnd(), "batch_isend_irecv");
    return record(ops.size() == 1 ? detail::describe_p2p(ops.front(), "nccl")
                                  : fmt::format("batch_isend_irecv of {} messages on nccl",
                                                ops.size()));
  }

  void do_barrier() override {
    // NCCL has no barrier: a one-element all_reduce orders every rank the same way.
    void* scratch = nullptr;
    SHARDOPT_CUDA_CHECK(cudaMallocAsync(&scratch, sizeof(float), stream_), "barrier");
    SHARDOPT_NCCL_CHECK(ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, state_->comm, stream_),
                        "barrier");
    SHARDOPT_CUDA_CHECK(cudaFreeAsync(scratch, stream_), "barrier");
    record("barrier on nccl")->wait();
  }

 private:
  // Checks the device, then orders the collective after what torch's current stream has queued
  // (the producer of the tensor), without blocking the host.
  void check_device(const at::Tensor& t) const {
    SHARDOPT_CHECK(t.device().index() == device_, InvalidArgument,
                   "comm.nccl: tensor is on {}, but this communicator serves cuda:{}",
                   t.device().str(), device_);
    detail::stream_waits_for_torch(stream_, device_, "comm.nccl");
  }
  // Work completes when its event has: Work::wait polls it against the deadline (the host waits
  // for each collective it waits on, as with the other engines).
  WorkPtr record(std::string description) {
    cudaEvent_t event;
    SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), description);
    SHARDOPT_CUDA_CHECK(cudaEventRecord(event, stream_), description);
    return std::make_shared<NcclWork>(std::move(description), timeout(), event, state_);
  }

  int device_;
  CommunicatorPtr bootstrap_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<NcclState> state_ = std::make_shared<NcclState>();
};

}  // namespace

CommunicatorPtr make_nccl_communicator(const CommunicatorPtr& bootstrap, int device) {
  SHARDOPT_CHECK(bootstrap, InvalidArgument, "comm.nccl: the bootstrap communicator is null");
  ncclUniqueId id;
  if (bootstrap->rank() == 0) SHARDOPT_NCCL_CHECK(ncclGetUniqueId(&id), "make_nccl_communicator");
  // The id travels as bytes over the bootstrap engine (CPU memory).
  at::Tensor bytes = at::from_blob(&id, {static_cast<int64_t>(sizeof(id))}, at::kByte);
  bootstrap->broadcast(bytes, 0);
  return std::make_shared<NcclCommunicator>(bootstrap->rank(), bootstrap->size(), device, id,
                                            bootstrap);
}

namespace {
// Loading the library makes the engine available to init_from_env() (src/plugins.hpp).
const bool kRegistered = [] {
  detail::register_nccl_factory(&make_nccl_communicator);
  return true;
}();
}  // namespace

}  // namespace shardopt
