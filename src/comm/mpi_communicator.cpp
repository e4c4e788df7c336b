// The MPI engine. Collectives run in submission order on one worker thread, so async calls overlap
// the caller's compute; their algorithms (our own reductions, polite waits) are in
// comm/mpi_collectives.cpp.
#include "shardopt/mpi.hpp"

#if defined(__SANITIZE_ADDRESS__)  // GCC's -fsanitize=address (scripts/test.sh --sanitize)
#include <sanitizer/lsan_interface.h>
#endif

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/engines.hpp"
#include "comm/mpi_collectives.hpp"
#include "comm/polite_waits.hpp"
#include "shardopt/error.hpp"

namespace shardopt {
namespace {

using detail::mpi_count;

struct Shared {
  std::atomic<bool> timed_out{false};
  std::atomic<bool> busy{false};  // the worker is inside a collective
};

// Note [MPI timeouts] (shardopt/mpi.hpp): a worker still inside a collective after a timeout can
// never be joined, and MPI_Finalize would block behind it, so mpirun would never end the job.
// When the process tears MPI down in that state (the communicator's destructor, or the MPI
// runtime's at exit), it repeats the timeout on stderr and calls MPI_Abort, which makes the
// launcher end every rank. A timeout whose collective completed later leaves nothing stuck and
// finalises normally.
std::mutex g_live_mutex;
std::vector<std::weak_ptr<Shared>> g_live;  // every threaded engine's state
std::string g_last_timeout;                 // guarded by g_live_mutex

bool stuck(const Shared& s) { return s.timed_out && s.busy; }

[[noreturn]] void abort_stuck_job(const char* when) {
  std::string last;
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    last = g_last_timeout;
  }
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr,
               "shardopt[rank %d] comm.mpi: %s while a collective is still blocked in MPI after a "
               "timeout (%s); MPI cannot cancel it and MPI_Finalize would hang, so calling "
               "MPI_Abort to end the job\n",
               rank, when, last.empty() ? "no description" : last.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);  // MPI_Abort does not return; in case it does
}

class MpiWork final : public Work {
 public:
  MpiWork(std::string description, Duration timeout, std::shared_future<void> done,
          std::shared_ptr<Shared> shared)
      : Work(std::move(description), timeout), done_(std::move(done)), shared_(std::move(shared)) {}
  bool is_completed() override {
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

 protected:
  bool wait_for(Duration timeout) override {
    if (done_.wait_for(timeout) != std::future_status::ready) {
      shared_->timed_out = true;  // the worker may never return: see Note [MPI timeouts]
      std::lock_guard<std::mutex> lock(g_live_mutex);
      g_last_timeout = fmt::format("{} did not complete within {} ms", description(),
                                   timeout.count());
      return false;
    }
    done_.get();  // rethrows the engine's error
    return true;
  }

 private:
  std::shared_future<void> done_;
  std::shared_ptr<Shared> shared_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, bool threaded)
      : Communicator(rank, size), comm_(comm), threaded_(threaded), collectives_(comm, rank, size) {
    // Point-to-point messages match any tag from their source (the tag carries the dtype), so
    // they get a communicator of their own that the collectives' Sendrecv never touches.
    SHARDOPT_MPI_CHECK(MPI_Comm_dup(comm_, &p2p_comm_), "make_mpi_communicator");
    MPI_Comm_set_errhandler(p2p_comm_, MPI_ERRORS_RETURN);
    if (threaded_) {
      {
        std::lock_guard<std::mutex> lock(g_live_mutex);
        g_live.push_back(shared_);
      }
      exited_ = exit_signal_.get_future();
      worker_ = std::thread([this] {
        run_worker();
        exit_signal_.set_value();
      });
    }
  }

  ~MpiCommunicator() override {
    if (threaded_) {
      // The worker may need the GIL to drop a Python tensor: see Note [Freeing without the GIL].
      detail::BlockingRegion blocking;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
      }
      ready_.notify_one();
      // After a timeout the worker may be blocked inside MPI for good; joining would hang.
      if (shared_->timed_out && exited_.wait_for(std::chrono::seconds(2)) != std::future_status::ready) {
        abort_stuck_job("communicator destroyed");
      }
      worker_.join();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Comm_free(&p2p_comm_);
      MPI_Comm_free(&comm_);
    }
  }

  std::string backend() const override { return "mpi"; }
  // MPI_COMM_WORLD, not this communicator: the launcher ends every process of the job.
  void do_abort(int exit_code) override { MPI_Abort(MPI_COMM_WORLD, exit_code); }
  Capabilities capabilities() const override {
    Capabilities caps;
    caps.overlaps_caller = threaded_;
    caps.can_time_out = threaded_;
    return caps;
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op) override {
    return submit(fmt::format("all_reduce({}, {}) on mpi", describe(t), to_string(op)),
                  [this, t, op, polite = detail::polite_waits_here()] {
                    collectives_.all_reduce(t.view(-1), op, polite);
                  });
  }
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) override {
    return submit(fmt::format("reduce_scatter({} -> {}, {}) on mpi", describe(in), describe(out),
                              to_string(op)),
                  [this, in, out, op, polite = detail::polite_waits_here()] {
                    collectives_.reduce_scatter(in.view(-1), out.view(-1), op, polite);
                  });
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    return submit(fmt::format("all_gather({} -> {}) on mpi", describe(in), describe(out)),
                  [this, in, out, polite = detail::polite_waits_here()] {
                    collectives_.all_gather(in.view(-1), out.view(-1), polite);
                  });
  }
  WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    return submit(fmt::format("broadcast({}, root {}) on mpi", describe(t), root),
                  [this, t, root, polite = detail::polite_waits_here()] {
                    collectives_.broadcast(t, root, polite);
                  });
  }
  void do_barrier() override {
    submit("barrier on mpi", [this, polite = detail::polite_waits_here()] {
      collectives_.barrier(polite);
    })->wait();
  }
  // Each message is posted (MPI_Isend/MPI_Irecv) on the worker in submission order and completes
  // there too (poll_p2p), so MPI is entered by one thread only, as MPI_THREAD_SERIALIZED allows.
  WorkPtr do_batch_isend_irecv(const std::vector<P2pOp>& ops) override {
    std::vector<WorkPtr> parts;
    for (const auto& op : ops) parts.push_back(post_p2p(op));
    return make_work_group(fmt::format("batch_isend_irecv of {} messages on mpi", ops.size()),
                           std::move(parts), timeout());
  }
  // On the worker, after every collective issued before it (MPI forbids two threads in
  // collectives on one communicator).
  CommunicatorPtr do_split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    submit(fmt::format("split(color {}, key {}) on mpi", color, key), [this, color, key, &sub] {
      SHARDOPT_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub),
                         "split");
    })->wait();
    return adopt(sub);
  }
  CommunicatorPtr do_split_by_host() override {
    MPI_Comm sub = MPI_COMM_NULL;
    submit("split_by_host on mpi", [this, &sub] {
      SHARDOPT_MPI_CHECK(
          MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &sub),
          "split_by_host");
    })->wait();
    return adopt(sub);
  }

 private:
  WorkPtr submit(std::string description, std::function<void()> fn) {
    if (!threaded_) {
      fn();
      return make_completed_work(std::move(description));
    }
    Task task{std::move(fn), {}};
    std::shared_future<void> done = task.done.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
    return std::make_shared<MpiWork>(std::move(description), timeout(), std::move(done), shared_);
  }

  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    P2pOp op;
    std::shared_ptr<std::promise<void>> done;
  };

  // Posts `op` on the worker (inline without one); the Work completes when the message has.
  WorkPtr post_p2p(const P2pOp& op) {
    std::string description = detail::describe_p2p(op, "mpi");
    auto done = std::make_shared<std::promise<void>>();
    std::shared_future<void> future = done->get_future().share();
    auto post = [this, op, done] {
      Pending p{MPI_REQUEST_NULL, op, done};
      const int bytes = mpi_count(static_cast<int64_t>(op.tensor.nbytes()), "send/recv");
      try {
        if (op.kind == P2pOp::Kind::Send) {
          SHARDOPT_MPI_CHECK(MPI_Isend(op.tensor.data_ptr(), bytes, MPI_BYTE, op.peer,
                                       dtype_tag(op.tensor.scalar_type()), p2p_comm_, &p.request),
                             detail::describe_p2p(op, "mpi"));
        } else {
          SHARDOPT_MPI_CHECK(MPI_Irecv(op.tensor.data_ptr(), bytes, MPI_BYTE, op.peer,
                                       MPI_ANY_TAG, p2p_comm_, &p.request),
                             detail::describe_p2p(op, "mpi"));
        }
      } catch (...) {
        done->set_exception(std::current_exception());
        return;
      }
      pending_.push_back(std::move(p));
    };
    if (!threaded_) {
      post();
      return std::make_shared<InlineP2pWork>(std::move(description), timeout(), std::move(future),
                                             this);
    }
    submit(description, std::move(post));
    return std::make_shared<MpiWork>(std::move(description), timeout(), std::move(future),
                                     shared_);
  }

  // The tag of a message is its dtype, so that the receiver can name what arrived.
  static int dtype_tag(at::ScalarType t) { return static_cast<int>(t); }

  // Completes the posted messages that MPI has finished; returns whether any did. Worker-only
  // (or the caller's thread without a worker).
  bool poll_p2p() {
    bool progressed = false;
    for (auto it = pending_.begin(); it != pending_.end();) {
      int flag = 0;
      MPI_Status status;
      const int rc = MPI_Test(&it->request, &flag, &status);
      if (rc == MPI_SUCCESS && !flag) {
        ++it;
        continue;
      }
      std::exception_ptr error;
      try {
        check_p2p(rc, status, it->op);
      } catch (...) {
        error = std::current_exception();
      }
      // The tensor is dropped before the caller learns of completion (see run_worker).
      const auto done = std::move(it->done);
      it = pending_.erase(it);
      if (error) {
        done->set_exception(error);
      } else {
        done->set_value();
      }
      progressed = true;
    }
    return progressed;
  }

  // A receive completes with the sender's dtype in its tag and its byte count in the status.
  static void check_p2p(int rc, MPI_Status& status, const P2pOp& op) {
    const std::string what = detail::describe_p2p(op, "mpi");
    int error_class = MPI_SUCCESS;
    if (rc != MPI_SUCCESS) MPI_Error_class(rc, &error_class);
    if (op.kind == P2pOp::Kind::Recv && (rc == MPI_SUCCESS || error_class == MPI_ERR_TRUNCATE)) {
      const auto sent = static_cast<at::ScalarType>(status.MPI_TAG);
      const bool known = status.MPI_TAG >= 0 &&
                         status.MPI_TAG < static_cast<int>(at::ScalarType::NumOptions);
      const std::string dtype = known ? c10::toString(sent) : fmt::format("tag {}", status.MPI_TAG);
      if (error_class == MPI_ERR_TRUNCATE) {
        detail::fail_p2p_mismatch(op, "mpi", fmt::format("more than {} bytes of {}",
                                                         op.tensor.nbytes(), dtype));
      }
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      if (sent != op.tensor.scalar_type() || bytes != static_cast<int64_t>(op.tensor.nbytes())) {
        const int64_t elem = known ? static_cast<int64_t>(c10::elementSize(sent)) : 1;
        detail::fail_p2p_mismatch(op, "mpi", fmt::format("{} x {}", bytes / elem, dtype));
      }
      return;
    }
    if (rc == MPI_SUCCESS) return;
    char message[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(rc, message, &length);
    SHARDOPT_FAIL(Communication, "comm.mpi: {} failed: {}", what, std::string(message, length));
  }

  // Without a worker thread (MPI_THREAD_SINGLE/FUNNELED) the waiting thread polls MPI itself.
  class InlineP2pWork final : public Work {
   public:
    InlineP2pWork(std::string description, Duration timeout, std::shared_future<void> done,
                  MpiCommunicator* comm)
        : Work(std::move(description), timeout), done_(std::move(done)), comm_(comm) {}
    bool is_completed() override {
      comm_->poll_p2p();
      return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    }

   protected:
    bool wait_for(Duration timeout) override {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!is_completed()) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      done_.get();
      return true;
    }

   private:
    std::shared_future<void> done_;
    MpiCommunicator* comm_;
  };

  // A communicator over `sub` (duplicated by make_mpi_communicator), which is then freed.
  static CommunicatorPtr adopt(MPI_Comm sub) {
    if (sub == MPI_COMM_NULL) return nullptr;
    CommunicatorPtr comm = make_mpi_communicator(sub);
    MPI_Comm_free(&sub);
    return comm;
  }

  // Each task's closure, and with it the last reference to its tensors, is destroyed before the
  // caller learns that the task completed: dropping a tensor created in Python takes the GIL, and
  // a caller that got its result may hold the GIL while it destroys the communicator (which joins
  // this thread, releasing the GIL through detail::BlockingRegion). See Note [Freeing without the
  // GIL] in python_bindings/shardopt_py.cpp.
  void run_worker() {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        const auto woken = [this] { return stopping_ || !queue_.empty(); };
        if (pending_.empty()) {
          ready_.wait(lock, woken);
        } else {
          // Messages in flight: poll them, backing off while none completes.
          ready_.wait_for(lock, poll_interval_, woken);
        }
        if (queue_.empty() && stopping_) {
          cancel_p2p();
          return;
        }
        if (queue_.empty()) {
          lock.unlock();
          poll_interval_ = poll_p2p() ? kMinPoll : std::min(poll_interval_ * 2, kMaxPoll);
          continue;
        }
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      shared_->busy = true;
      std::exception_ptr error;
      try {
        task.fn();
      } catch (...) {
        error = std::current_exception();
      }
      task.fn = nullptr;
      shared_->busy = false;
      if (error) {
        task.done.set_exception(error);
      } else {
        task.done.set_value();
      }
      if (!pending_.empty()) {
        poll_p2p();
        poll_interval_ = kMinPoll;
      }
    }
  }

  // At teardown: receives nobody will send are cancelled; sends are left to MPI.
  void cancel_p2p() {
    for (auto& p : pending_) {
      if (p.op.kind == P2pOp::Kind::Recv) MPI_Cancel(&p.request);
      MPI_Request_free(&p.request);
    }
    pending_.clear();
  }

  MPI_Comm comm_;
  MPI_Comm p2p_comm_ = MPI_COMM_NULL;
  bool threaded_;
  static constexpr std::chrono::microseconds kMinPoll{10};
  static constexpr std::chrono::microseconds kMaxPoll{1000};
  std::chrono::microseconds poll_interval_ = kMinPoll;  // worker-only
  std::list<Pending> pending_;                          // worker-only (caller's without one)
  std::thread worker_;
  std::promise<void> exit_signal_;
  std::future<void> exited_;
  std::mutex mutex_;
  std::condition_variable ready_;
  struct Task {
    std::function<void()> fn;
    std::promise<void> done;
  };
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  detail::MpiCollectives collectives_;  // worker-only (the caller's without one)
};

// Finalises MPI at exit when shardopt initialised it.
struct MpiRuntime {
  bool owned = false;
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!owned || finalized) return;
    {
      std::unique_lock<std::mutex> lock(g_live_mutex);
      for (const auto& weak : g_live) {
        const auto s = weak.lock();
        if (s && stuck(*s)) {
          lock.unlock();
          abort_stuck_job("exiting");
        }
      }
    }
    MPI_Finalize();
  }
};
MpiRuntime g_runtime;

}  // namespace

CommunicatorPtr make_mpi_communicator(MPI_Comm comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  SHARDOPT_CHECK(initialized, InvalidArgument,
                 "comm.mpi: MPI is not initialised; call MPI_Init_thread first or use "
                 "init_from_env()");
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  MPI_Comm dup;
  SHARDOPT_MPI_CHECK(MPI_Comm_dup(comm, &dup), "make_mpi_communicator");
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  // Note [One worker per communicator needs MPI_THREAD_MULTIPLE]: each threaded communicator
  // enters MPI from its own worker, and split() makes more of them (hybrid groups, tensor and
  // pipeline groups), so two workers may be inside MPI at once, which MPI_THREAD_SERIALIZED
  // forbids. Serialising them with one lock would deadlock (rank A's worker holds it inside a
  // collective of group X while rank B's holds it inside group Y), so below MULTIPLE collectives
  // run on the calling thread instead.
  return std::make_shared<MpiCommunicator>(dup, rank, size, provided >= MPI_THREAD_MULTIPLE);
}

namespace detail {
namespace {
#if defined(__SANITIZE_ADDRESS__)
using LeakCheckDisabledHere = __lsan::ScopedDisabler;
#else
struct LeakCheckDisabledHere {};
#endif
}  // namespace

CommunicatorPtr make_mpi_world_communicator(Duration timeout) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    {
      // Note [Sanitizers and MPI_Init]: OpenMPI keeps what MPI_Init_thread allocates to exit, and
      // LeakSanitizer's fast unwinder cannot attribute those allocations (stacks end in libc or
      // in components OpenMPI has dlclose'd by then), so no suppression by library could name
      // them: they are left out of the leak check here, on this thread, for this call only.
      LeakCheckDisabledHere no_leak_check;
      SHARDOPT_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided),
                         "init_from_env");
    }
    g_runtime.owned = true;
  }
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm->set_timeout(timeout);
  return comm;
}
}  // namespace detail

}  // namespace shardopt
