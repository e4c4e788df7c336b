/// \file
/// Communicator: one small interface over several real engines (MPI, c10d ProcessGroups such as
/// Gloo, NCCL, single process). Collectives run on flat contiguous tensors and follow NCCL's
/// in-place contract: for reduce_scatter/all_gather, rank r's shard is the slice [r*S, (r+1)*S).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace shardopt {

/// How a collective combines the ranks' tensors (Avg: the sum divided by the ranks).
enum class ReduceOp { Sum, Avg, Max, Min };
/// "sum", "avg", "max", "min".
const char* to_string(ReduceOp op);

/// Timeouts and deadlines, in milliseconds.
using Duration = std::chrono::milliseconds;
/// Default deadline of every collective (c10d's default is 30 minutes; shorter surfaces hangs sooner).
inline constexpr Duration kDefaultTimeout = std::chrono::minutes(10);
/// The timeout every default takes (ZeroOptions, InitOptions, GlooOptions, communicators): the
/// environment variable SHARDOPT_TIMEOUT in seconds (e.g. "30" or "2.5") when set, else
/// kDefaultTimeout. Throws Error{InvalidArgument} when SHARDOPT_TIMEOUT is not a positive number.
Duration default_timeout();

/// Handle of an issued collective. wait() blocks until the result is in the output tensors.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until completion. Throws shardopt::Error{Timeout} naming the operation when it did not
  /// complete within `timeout` (zero: the communicator's timeout), or {Communication} when the
  /// engine failed. Calling wait() again after success returns at once.
  void wait(Duration timeout = Duration::zero());
  /// Whether the result is in, without waiting (an engine error shows at wait()).
  virtual bool is_completed() = 0;
  /// "all_reduce(1024 x float32, sum) on mpi": used in error messages.
  const std::string& description() const { return description_; }

 protected:
  /// `description` names the operation in errors; `default_timeout` is what wait() waits by default.
  Work(std::string description, Duration default_timeout)
      : description_(std::move(description)), default_timeout_(default_timeout) {}
  /// Returns false when `timeout` expired first; throws when the engine failed.
  virtual bool wait_for(Duration timeout) = 0;
  /// Runs once after the engine finished, on the waiting thread (e.g. Avg emulation).
  virtual void on_complete() {}

 private:
  std::string description_;
  Duration default_timeout_;
  bool done_ = false;
};
/// A Work as the communicators return it.
using WorkPtr = std::shared_ptr<Work>;

/// What an engine can do natively; the rest is emulated (documented per engine).
struct Capabilities {
  bool native_avg = false;             ///< else Sum followed by a division on the output
  bool native_reduce_scatter = true;   ///< else all_reduce of a scratch copy (2x traffic)
  bool overlaps_caller = true;         ///< async work proceeds while the caller computes
  bool cpu_tensors = true;             ///< serves tensors in host memory
  bool cuda_tensors = false;           ///< serves tensors on CUDA devices
  bool can_time_out = true;            ///< a missing rank ends in an Error rather than a hang
};

class Communicator;
/// How communicators are held and passed.
using CommunicatorPtr = std::shared_ptr<Communicator>;

/// One message of a point-to-point batch (Communicator::batch_isend_irecv).
struct P2pOp {
  /// Whether the op sends its tensor or receives into it.
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;  ///< send or receive
  at::Tensor tensor;  ///< contiguous; a Recv fills it in place
  int peer = -1;      ///< the rank sent to or received from, in this communicator
  /// Sends `t` to rank `dst`.
  static P2pOp send(at::Tensor t, int dst) { return {Kind::Send, std::move(t), dst}; }
  /// Receives into `t` from rank `src`.
  static P2pOp recv(at::Tensor t, int src) { return {Kind::Recv, std::move(t), src}; }
};

// Note [Point-to-point messages]: send/recv are not collective; only the two ranks take part.
// There are no tags: the messages from rank a to rank b are matched to b's receives from a in the
// order each side issued them (MPI's non-overtaking rule), whatever else either rank does in
// between. A receive names the dtype and element count it expects (its tensor); a message of
// another dtype or size fails that receive with Error{Mismatch} naming both (MPI: the message's
// tag carries the dtype and its byte count is checked; Gloo: a 16-byte header precedes each
// message, and the payload is received only once the header matches, else drained into scratch,
// so it never lands in a tensor of another size and the pair stays in step: Note
// [Point-to-point on process groups]). NCCL cannot check: there a mismatch is
// undefined, as in NCCL itself. A peer that never sends ends in Error{Timeout}, as collectives do.

/// All calls but point-to-point ones are collective: every rank must make the same calls in the
/// same order.
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }  ///< this rank, in [0, size())
  int size() const { return size_; }  ///< the number of ranks
  virtual std::string backend() const = 0;  ///< "mpi", "gloo", "nccl", "threads", "single", ...
  virtual Capabilities capabilities() const = 0;  ///< what this engine does natively
  Duration timeout() const { return timeout_; }  ///< the deadline of every wait
  /// Sets the deadline of later waits; Error{InvalidArgument} unless positive.
  void set_timeout(Duration timeout);

  /// In place on `tensor`. With async=false the call returns after completion.
  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Sum, bool async = false);
  /// input holds size()*S elements, output S; output may alias input[rank*S, (rank+1)*S).
  /// The rest of input is left unchanged.
  WorkPtr reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                         ReduceOp op = ReduceOp::Sum, bool async = false);
  /// input holds S elements, output size()*S; input may alias output[rank*S, (rank+1)*S).
  WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output, bool async = false);
  /// In place on `tensor`: every rank gets rank `root`'s.
  WorkPtr broadcast(const at::Tensor& tensor, int root, bool async = false);
  /// Returns once every rank has called it.
  void barrier();

  /// Point-to-point (Note [Point-to-point messages]). The i- forms return at once; the tensor must
  /// stay alive and unchanged (send) or unread (recv) until wait(). A peer outside [0, size()) or
  /// equal to rank() is Error{InvalidArgument}.
  void send(const at::Tensor& tensor, int dst);
  /// Receives into `tensor` from `src`; returns once it is there.
  void recv(const at::Tensor& tensor, int src);
  /// send(), returning at once; wait() on the Work.
  WorkPtr isend(const at::Tensor& tensor, int dst);
  /// recv(), returning at once; the tensor holds the message after wait().
  WorkPtr irecv(const at::Tensor& tensor, int src);
  /// Issues every op at once and returns one Work for all: with NCCL the ops form one group, so a
  /// rank may both send to and receive from a peer in one batch without deadlock (the other
  /// engines never block on issue).
  WorkPtr batch_isend_irecv(const std::vector<P2pOp>& ops);

  /// Sub-communicators (MPI_Comm_split; a c10d subgroup for process groups). Call on all ranks.
  /// Ranks passing the same color >= 0 form one new communicator, ranked by (key, rank here);
  /// a rank passing color < 0 joins none and gets nullptr. The new one keeps this one's timeout.
  CommunicatorPtr split(int color, int key);
  /// The ranks on this rank's host, ranked as here: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) on
  /// MPI, equal gethostname() elsewhere. Call on all ranks.
  CommunicatorPtr split_by_host();

  /// Ends every rank of the job now, from this rank alone (not collective; shardopt::abort_job in
  /// job.hpp prints the reason first): MPI_Abort on MPI; on the other engines this process exits at
  /// once, which fails the peers' pending collectives, and the launcher ends the rest.
  [[noreturn]] void abort(int exit_code = 1);

 protected:
  /// Engines pass this rank and the number of ranks; names the rank in error messages.
  Communicator(int rank, int size);
  /// Engines implement these on validated arguments (contiguous, same dtype/device, sizes checked).
  /// reduce ops reach them as Sum/Max/Min, and Avg only when capabilities().native_avg.
  virtual WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  /// reduce_scatter() on validated arguments.
  virtual WorkPtr do_reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                    ReduceOp op) = 0;
  /// all_gather() on validated arguments.
  virtual WorkPtr do_all_gather(const at::Tensor& input, const at::Tensor& output) = 0;
  /// broadcast() on validated arguments.
  virtual WorkPtr do_broadcast(const at::Tensor& tensor, int root) = 0;
  /// barrier().
  virtual void do_barrier() = 0;
  /// Validated ops (peers in range, tensors checked), issued in order. The default throws
  /// Error{Unsupported} naming the engine.
  virtual WorkPtr do_batch_isend_irecv(const std::vector<P2pOp>& ops);
  /// Called on validated arguments (color < 0 already mapped to "none"); engines without
  /// sub-groups keep the default, which throws Error{Unsupported} naming the engine.
  virtual CommunicatorPtr do_split(int color, int key);
  /// Default: all-gathers each rank's hostname and splits by it.
  virtual CommunicatorPtr do_split_by_host();
  /// Engines that can end the whole job (MPI_Abort) override this; the default returns, and
  /// abort() then exits the process without running destructors (which could wait on peers).
  virtual void do_abort(int exit_code);

 private:
  WorkPtr finish(WorkPtr work, const at::Tensor& result, ReduceOp requested, bool async);
  int rank_;
  int size_;
  Duration timeout_ = default_timeout();
};

/// A completed Work, for engines whose calls finish before they return.
WorkPtr make_completed_work(std::string description);
/// One Work over several: wait() waits for each in order within the one deadline.
WorkPtr make_work_group(std::string description, std::vector<WorkPtr> parts, Duration timeout);

/// One process, rank 0 of 1: collectives are copies or no-ops.
CommunicatorPtr make_single_communicator();

/// Hybrid sharding (FSDP's HYBRID_SHARD, ZeRO++'s hierarchical partitioning) as a communicator.
/// `world` is cut into shard groups of `shard_group_size` consecutive ranks (a host each, when
/// ranks are placed host by host) and replica groups (the ranks at one position of every shard
/// group), both made with split(). The result is the shard group's view: rank() and size() are
/// the position in the group and its size, so an optimizer over it shards within the group and
/// replicates across groups. Gathers stay within the group; reductions span the world:
///   reduce_scatter  within the group, then an all-reduce of the shard across replicas (only
///                   1/shard_group_size of the bytes crosses between groups);
///   all_reduce      reduce-scatter within, all-reduce across, all-gather within;
///   Sum             the sum over the group of the mean over replicas (world sum / replicas), so
///                   that dividing by size() gives the world mean; Avg gives the world mean;
///                   Max/Min are over the world; every replica gets bitwise the same result;
///   broadcast(root) from world rank `root` (in the first group) to every rank.
/// Call on all ranks; shard_group_size must divide world->size(); equal to it returns `world`.
CommunicatorPtr make_hybrid_communicator(const CommunicatorPtr& world, int shard_group_size);

/// What init_from_env() makes. `backend` "threads:N" is refused there: N thread-ranks are made by
/// run_ranks() (shardopt/threads.hpp), which gives each its own communicator.
struct InitOptions {
  /// "" picks from the environment: mpirun/srun variables (OMPI_*, PMI_*, PMIX_*, SLURM_*) -> "mpi";
  /// RANK + WORLD_SIZE + MASTER_ADDR + MASTER_PORT (torchrun) -> "gloo"; otherwise "single".
  /// With device "cuda" in a build with NCCL, a launched job takes "nccl" instead: MPI or Gloo
  /// carry its ncclUniqueId (and later its host tensors), and the local rank (LOCAL_RANK, else
  /// OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID) picks the GPU, which becomes the
  /// current CUDA device. SHARDOPT_BACKEND in the environment overrides the choice.
  std::string backend;
  std::string device = "cpu";  ///< "cpu" or "cuda": where the tensors to communicate live
  Duration timeout = default_timeout();  ///< the communicator's deadline for every wait
};
/// Creates the communicator this process was launched for (see InitOptions::backend).
CommunicatorPtr init_from_env(const InitOptions& options = {});

/// Describes a tensor for messages: "[4, 8] float32 cpu".
std::string describe(const at::Tensor& tensor);

namespace detail {
/// Set by the Python bindings: a thread that blocks in a destructor (joining an engine's worker,
/// which may need the interpreter lock to drop a tensor created in Python) releases the lock for
/// the duration. enter() returns what exit() needs to restore, or null when there was nothing to
/// release. Without hooks (C++ programs) a BlockingRegion does nothing.
struct BlockingHooks {
  void* (*enter)() = nullptr;
  void (*exit)(void* token) = nullptr;
};
void set_blocking_hooks(BlockingHooks hooks);
class BlockingRegion {
 public:
  BlockingRegion();
  ~BlockingRegion();
  BlockingRegion(const BlockingRegion&) = delete;
  BlockingRegion& operator=(const BlockingRegion&) = delete;

 private:
  void* token_ = nullptr;
};

/// Whether a Work::wait of this process (on a thread-rank of run_ranks: of this rank) has timed
/// out. Teardown (the optimizer's destructors) then stops waiting for collectives that can no
/// longer complete; engines keep their tensors alive.
bool collective_timed_out();
}  // namespace detail

}  // namespace shardopt
