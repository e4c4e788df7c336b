// The thread engine (shardopt/threads.hpp): N ranks as threads of one process.
//
// Note [Thread engine]
// The ranks of one communicator share a World. A collective is matched across ranks by its
// sequence number on each rank (every rank makes the same collective calls in the same order, as
// on every engine) and meets in a Slot: each rank leaves its tensors there when it issues the call
// and returns at once with a Work. The last rank to arrive checks that every rank made the same
// call (Error{Mismatch} otherwise), computes the results from every rank's input and writes them
// into every rank's output, then marks the slot done; wait() waits for that. Inputs are read only
// once every rank has issued and outputs written only then, so the in-place and aliasing rules of
// comm.hpp hold as they do for NCCL. Sums run in rank order 0, 1, ..., N-1, so a result is bitwise
// what any engine gives that adds in that order. Avg is the front end's: a sum, then a division.
//
// Point-to-point messages are buffered: a send copies its tensor into the (src, dst) mailbox under
// the next sequence number and completes at once; the receiver's k-th receive from src takes
// message k (MPI's non-overtaking rule) and checks its dtype and size (Error{Mismatch}).
//
// CUDA tensors: each rank records an event on its current stream when it issues; the rank that
// computes makes its own current stream wait for all of them, runs the copies and sums there
// (device to device) and records a done event; a rank's wait() makes its current stream wait for
// that event and returns without blocking on the GPU, as NCCL's wait does.
//
// Backward on its own thread: torch's autograd runs the CUDA part of every backward pass of a
// process on one worker thread per device, so a rank whose gradient hook waits for a collective
// would hold up every other rank's backward there, and they could never join it. Each rank thread
// of run_ranks turns autograd's device threads off for itself (torch >= 2.0:
// set_multithreading_enabled(false), torch.autograd.set_multithreading_enabled in Python), so
// its backward runs on the rank's own thread, as a process's does. CPU backward passes run on the
// calling thread already.
//
// Failure: the worlds made by one run_ranks (and their splits) share one Job. A rank whose body
// throws marks the job failed; every wait not yet done then throws Error{Communication} naming that
// rank and its message. A rank whose body returned can no longer join anything: a wait that needs
// it throws at once instead of waiting out the timeout. Otherwise a wait ends in Error{Timeout}.
#include <ATen/ATen.h>
#include <c10/core/AutogradState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#include "comm/engines.hpp"
#include "shardopt/error.hpp"
#include "shardopt/threads.hpp"

namespace shardopt {
namespace {

using Clock = std::chrono::steady_clock;
thread_local int t_thread_rank = -1;

// What every world of one run_ranks shares: one lock and wake-up, and the job's outcome.
struct Job {
  std::mutex mutex;
  std::condition_variable changed;
  int failed_rank = -1;  // the first rank whose body threw
  std::string failure;   // its message
  std::vector<bool> ended;
  explicit Job(int n) : ended(static_cast<size_t>(n), false) {}
};

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

std::shared_ptr<c10::Event> record_on_current_stream(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return nullptr;
  auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  event->record(current_stream(t.device()));
  return event;
}

void current_stream_waits(const std::shared_ptr<c10::Event>& event, const at::Tensor& t) {
  if (event) event->block(current_stream(t.device()));
}

struct World;

// One collective call as the ranks meet in it.
struct Slot {
  std::string signature;  // what the first rank called; the others must call the same
  int first_rank = -1;
  int arrived = 0;
  std::vector<bool> present;
  std::vector<at::Tensor> inputs, outputs;
  std::vector<std::shared_ptr<c10::Event>> issued;
  std::vector<int> colors, keys;                 // split
  std::vector<CommunicatorPtr> split_results;   // split
  std::shared_ptr<c10::Event> done_event;
  bool done = false;
  std::string error;  // the computation failed
};

struct Message {
  at::Tensor data;
  std::shared_ptr<c10::Event> ready;
};

struct World : std::enable_shared_from_this<World> {
  std::shared_ptr<Job> job;
  std::vector<int> members;  // the job rank of each rank here
  Duration timeout;
  // All guarded by job->mutex.
  std::map<uint64_t, std::shared_ptr<Slot>> slots;
  std::vector<std::map<uint64_t, Message>> mailboxes;  // [src * size + dst], by sequence number
  std::vector<uint64_t> sent;                           // [src * size + dst]

  World(std::shared_ptr<Job> j, std::vector<int> m, Duration t)
      : job(std::move(j)), members(std::move(m)), timeout(t),
        mailboxes(members.size() * members.size()), sent(members.size() * members.size(), 0) {}
  int size() const { return static_cast<int>(members.size()); }

  // Under job->mutex: throws when the job failed, or when `needed` (a rank here) has ended.
  void check_reachable(int needed, const std::string& what) const {
    if (job->failed_rank >= 0) {
      SHARDOPT_FAIL(Communication, "comm: {} cannot complete: rank {} failed: {}", what,
                    job->failed_rank, job->failure);
    }
    if (needed >= 0 && job->ended[static_cast<size_t>(members[static_cast<size_t>(needed)])]) {
      SHARDOPT_FAIL(Communication,
                    "comm: {} cannot complete: rank {} has ended without joining it", what, needed);
    }
  }
};

std::vector<CommunicatorPtr> make_world(const std::shared_ptr<Job>& job, std::vector<int> members,
                                        Duration timeout);

class SlotWork final : public Work {
 public:
  SlotWork(std::string description, Duration timeout, std::shared_ptr<World> world,
           std::shared_ptr<Slot> slot, at::Tensor result)
      : Work(std::move(description), timeout), world_(std::move(world)), slot_(std::move(slot)),
        result_(std::move(result)) {}
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(world_->job->mutex);
    return slot_->done;
  }

 protected:
  bool wait_for(Duration timeout) override {
    {
      detail::BlockingRegion blocking;
      std::unique_lock<std::mutex> lock(world_->job->mutex);
      const auto deadline = Clock::now() + timeout;
      while (!slot_->done) {
        int missing = -1;
        for (int r = 0; r < world_->size() && missing < 0; ++r) {
          if (!slot_->present[static_cast<size_t>(r)]) missing = r;
        }
        world_->check_reachable(missing, description());
        if (world_->job->changed.wait_until(lock, deadline) == std::cv_status::timeout &&
            !slot_->done) {
          return false;
        }
      }
    }
    SHARDOPT_CHECK(slot_->error.empty(), Communication, "comm: {} failed: {}", description(),
                   slot_->error);
    current_stream_waits(slot_->done_event, result_);
    return true;
  }

 private:
  std::shared_ptr<World> world_;
  std::shared_ptr<Slot> slot_;
  at::Tensor result_;  // a tensor on the device whose stream must wait (undefined: none)
};

class RecvWork final : public Work {
 public:
  RecvWork(std::string description, Duration timeout, std::shared_ptr<World> world, P2pOp op,
           int rank, uint64_t sequence)
      : Work(std::move(description), timeout), world_(std::move(world)), op_(std::move(op)),
        rank_(rank), sequence_(sequence) {}
  bool is_completed() override {
    {
      std::lock_guard<std::mutex> lock(world_->job->mutex);
      if (!received_ && !take()) return false;
    }
    deliver();
    return true;
  }

 protected:
  bool wait_for(Duration timeout) override {
    {
      detail::BlockingRegion blocking;
      std::unique_lock<std::mutex> lock(world_->job->mutex);
      const auto deadline = Clock::now() + timeout;
      while (!received_ && !take()) {
        world_->check_reachable(op_.peer, description());
        if (world_->job->changed.wait_until(lock, deadline) == std::cv_status::timeout &&
            !take()) {
          return false;
        }
      }
    }
    deliver();
    return true;
  }

 private:
  // Under the lock: moves the awaited message out of the mailbox, when it has come.
  bool take() {
    if (received_) return true;
    auto& box = world_->mailboxes[static_cast<size_t>(op_.peer * world_->size() + rank_)];
    auto it = box.find(sequence_);
    if (it == box.end()) return false;
    message_ = std::move(it->second);
    box.erase(it);
    received_ = true;
    return true;
  }
  void deliver() {
    if (delivered_) return;
    delivered_ = true;
    const at::Tensor& got = message_.data;
    if (got.scalar_type() != op_.tensor.scalar_type() || got.numel() != op_.tensor.numel()) {
      detail::fail_p2p_mismatch(op_, "threads",
                                fmt::format("{} x {}", got.numel(), c10::toString(got.scalar_type())));
    }
    current_stream_waits(message_.ready, op_.tensor);
    op_.tensor.view(-1).copy_(got.view(-1));
    message_ = {};
  }

  std::shared_ptr<World> world_;
  P2pOp op_;
  int rank_;
  uint64_t sequence_;
  bool received_ = false;
  bool delivered_ = false;
  Message message_;
};

at::Tensor reduce(const std::vector<at::Tensor>& parts, ReduceOp op) {
  at::Tensor acc = parts.front().clone();
  for (size_t r = 1; r < parts.size(); ++r) {
    switch (op) {
      case ReduceOp::Sum: acc.add_(parts[r]); break;
      case ReduceOp::Max: acc = at::maximum(acc, parts[r]); break;
      case ReduceOp::Min: acc = at::minimum(acc, parts[r]); break;
      case ReduceOp::Avg:
        SHARDOPT_FAIL(Internal, "comm.threads: Avg reached the engine (the front end divides)");
    }
  }
  return acc;
}

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<World> world, int rank)
      : Communicator(rank, world->size()), world_(std::move(world)) {
    set_timeout(world_->timeout);
  }

  std::string backend() const override { return "threads"; }
  Capabilities capabilities() const override {
    Capabilities caps;
    caps.cuda_tensors = true;
    return caps;
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    return collective(fmt::format("all_reduce({}, {})", describe(tensor), to_string(op)), tensor,
                      tensor, [op](Slot& s) {
                        const at::Tensor sum = reduce(s.inputs, op);
                        for (auto& out : s.outputs) out.copy_(sum);
                      });
  }

  WorkPtr do_reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                            ReduceOp op) override {
    return collective(
        fmt::format("reduce_scatter({} -> {}, {})", describe(input), describe(output),
                    to_string(op)),
        input, output, [op](Slot& s) {
          const int64_t shard = s.outputs.front().numel();
          std::vector<at::Tensor> results;  // all read before any output is written (aliasing)
          for (size_t q = 0; q < s.outputs.size(); ++q) {
            std::vector<at::Tensor> parts;
            for (const auto& in : s.inputs) {
              parts.push_back(in.view(-1).narrow(0, static_cast<int64_t>(q) * shard, shard));
            }
            results.push_back(reduce(parts, op));
          }
          for (size_t q = 0; q < s.outputs.size(); ++q) s.outputs[q].view(-1).copy_(results[q]);
        });
  }

  WorkPtr do_all_gather(const at::Tensor& input, const at::Tensor& output) override {
    return collective(
        fmt::format("all_gather({} -> {})", describe(input), describe(output)), input, output,
        [](Slot& s) {
          const int64_t shard = s.inputs.front().numel();
          for (size_t q = 0; q < s.outputs.size(); ++q) {
            for (size_t r = 0; r < s.inputs.size(); ++r) {
              at::Tensor dst = s.outputs[q].view(-1).narrow(0, static_cast<int64_t>(r) * shard, shard);
              if (dst.data_ptr() != s.inputs[r].data_ptr()) dst.copy_(s.inputs[r].view(-1));
            }
          }
        });
  }

  WorkPtr do_broadcast(const at::Tensor& tensor, int root) override {
    return collective(fmt::format("broadcast({}, root {})", describe(tensor), root), tensor,
                      tensor, [root](Slot& s) {
                        for (size_t r = 0; r < s.outputs.size(); ++r) {
                          if (static_cast<int>(r) != root) {
                            s.outputs[r].copy_(s.inputs[static_cast<size_t>(root)]);
                          }
                        }
                      });
  }

  void do_barrier() override {
    collective("barrier()", at::Tensor(), at::Tensor(), [](Slot&) {})->wait();
  }

  WorkPtr do_batch_isend_irecv(const std::vector<P2pOp>& ops) override {
    std::vector<WorkPtr> parts;
    for (const auto& op : ops) {
      const std::string what = detail::describe_p2p(op, "threads");
      if (op.kind == P2pOp::Kind::Send) {
        Message m{op.tensor.detach().clone(), nullptr};
        m.ready = record_on_current_stream(m.data);
        {
          std::lock_guard<std::mutex> lock(world_->job->mutex);
          const auto box = static_cast<size_t>(rank() * size() + op.peer);
          world_->mailboxes[box].emplace(world_->sent[box]++, std::move(m));
        }
        world_->job->changed.notify_all();
        parts.push_back(make_completed_work(what));
      } else {
        const uint64_t sequence = received_[op.peer]++;
        parts.push_back(std::make_shared<RecvWork>(what, timeout(), world_, op, rank(), sequence));
      }
    }
    return make_work_group(fmt::format("batch_isend_irecv({} ops) on threads", ops.size()),
                           std::move(parts), timeout());
  }

  CommunicatorPtr do_split(int color, int key) override {
    auto work = collective(
        "split()", at::Tensor(), at::Tensor(),
        [this](Slot& s) {
          std::map<int, std::vector<std::pair<int, int>>> groups;  // color -> (key, rank here)
          for (int r = 0; r < size(); ++r) {
            if (s.colors[static_cast<size_t>(r)] >= 0) {
              groups[s.colors[static_cast<size_t>(r)]].emplace_back(s.keys[static_cast<size_t>(r)], r);
            }
          }
          s.split_results.assign(static_cast<size_t>(size()), nullptr);
          for (auto& [color, ranks] : groups) {
            std::sort(ranks.begin(), ranks.end());
            std::vector<int> members;
            for (const auto& kr : ranks) members.push_back(world_->members[static_cast<size_t>(kr.second)]);
            auto comms = make_world(world_->job, members, timeout());
            for (size_t i = 0; i < ranks.size(); ++i) {
              s.split_results[static_cast<size_t>(ranks[i].second)] = comms[i];
            }
          }
        },
        [&](Slot& s) {
          s.colors[static_cast<size_t>(rank())] = color;
          s.keys[static_cast<size_t>(rank())] = key;
        });
    work->wait();
    std::lock_guard<std::mutex> lock(world_->job->mutex);
    return std::exchange(split_slot_, nullptr)->split_results[static_cast<size_t>(rank())];
  }

 private:
  // Leaves this rank's part of one collective in its slot; the last rank computes (Note [Thread
  // engine]). `deposit` adds what else this rank brings (split's color and key).
  WorkPtr collective(const std::string& call, const at::Tensor& input, const at::Tensor& output,
                     const std::function<void(Slot&)>& compute,
                     const std::function<void(Slot&)>& deposit = nullptr) {
    const std::string description = call + " on threads";
    const auto issued = record_on_current_stream(input);
    std::shared_ptr<Slot> slot;
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(world_->job->mutex);
      world_->check_reachable(-1, description);
      const uint64_t sequence = sequence_++;
      auto& entry = world_->slots[sequence];
      if (!entry) {
        entry = std::make_shared<Slot>();
        entry->signature = call;
        entry->first_rank = rank();
        const auto n = static_cast<size_t>(size());
        entry->present.assign(n, false);
        entry->inputs.resize(n);
        entry->outputs.resize(n);
        entry->issued.resize(n);
        entry->colors.assign(n, -1);
        entry->keys.assign(n, 0);
      }
      slot = entry;
      SHARDOPT_CHECK(slot->signature == call, Mismatch,
                     "comm: the ranks' collective calls differ: collective #{} is {} on rank {} "
                     "but {} on rank {} (threads)",
                     sequence, slot->signature, slot->first_rank, call, rank());
      const auto me = static_cast<size_t>(rank());
      slot->present[me] = true;
      slot->inputs[me] = input;
      slot->outputs[me] = output;
      slot->issued[me] = issued;
      if (deposit) deposit(*slot);
      if (call == "split()") split_slot_ = slot;
      last = ++slot->arrived == size();
      if (last) world_->slots.erase(sequence);
    }
    // A rank waiting in this slot may be waiting on this one; now another may be the one missing
    // (one that has ended: its wait must throw, not sleep to the timeout).
    if (!last) world_->job->changed.notify_all();
    if (last) complete(*slot, compute);
    return std::make_shared<SlotWork>(description, timeout(), world_, slot, output);
  }

  // On the last rank to arrive: every input is there; compute every output.
  void complete(Slot& slot, const std::function<void(Slot&)>& compute) {
    std::string error;
    try {
      const at::Tensor& any = slot.inputs.front();
      c10::OptionalDeviceGuard guard;
      if (any.defined() && any.is_cuda()) {
        guard.reset_device(any.device());
        const c10::Stream stream = current_stream(any.device());
        for (const auto& e : slot.issued) {
          if (e) e->block(stream);
        }
      }
      compute(slot);
      if (any.defined() && any.is_cuda()) {
        slot.done_event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
        slot.done_event->record(current_stream(any.device()));
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(world_->job->mutex);
      slot.error = std::move(error);
      slot.inputs.clear();   // the ranks own their tensors again
      slot.outputs.clear();
      slot.issued.clear();
      slot.done = true;
    }
    world_->job->changed.notify_all();
  }

  std::shared_ptr<World> world_;
  uint64_t sequence_ = 0;                 // this rank's next collective
  std::map<int, uint64_t> received_;      // receives issued per source
  std::shared_ptr<Slot> split_slot_;      // the slot of the split in progress
};

std::vector<CommunicatorPtr> make_world(const std::shared_ptr<Job>& job, std::vector<int> members,
                                        Duration timeout) {
  auto world = std::make_shared<World>(job, std::move(members), timeout);
  std::vector<CommunicatorPtr> comms;
  for (int r = 0; r < world->size(); ++r) comms.push_back(std::make_shared<ThreadCommunicator>(world, r));
  return comms;
}

std::vector<int> iota(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

}  // namespace

int thread_rank() { return t_thread_rank; }

std::vector<CommunicatorPtr> make_thread_communicators(int n, const ThreadRanksOptions& options) {
  SHARDOPT_CHECK(n >= 1, InvalidArgument, "make_thread_communicators: n must be at least 1, got {}",
                 n);
  return make_world(std::make_shared<Job>(n), iota(n), options.timeout);
}

void run_ranks(int n, const std::function<void(const CommunicatorPtr&)>& body,
               const ThreadRanksOptions& options) {
  SHARDOPT_CHECK(n >= 1, InvalidArgument, "run_ranks: n must be at least 1, got {}", n);
  SHARDOPT_CHECK(static_cast<bool>(body), InvalidArgument, "run_ranks: the body is empty");
  auto job = std::make_shared<Job>(n);
  auto comms = make_world(job, iota(n), options.timeout);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      t_thread_rank = r;
      detail::set_thread_error_rank(r, n);
#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
      c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
#endif
      try {
        body(comms[static_cast<size_t>(r)]);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        std::string message = "an exception that is not a std::exception";
        try {
          throw;
        } catch (const std::exception& e) {
          message = e.what();
        } catch (...) {
        }
        std::lock_guard<std::mutex> lock(job->mutex);
        if (job->failed_rank < 0) {
          job->failed_rank = r;
          job->failure = std::move(message);
        }
      }
      {
        std::lock_guard<std::mutex> lock(job->mutex);
        job->ended[static_cast<size_t>(r)] = true;
      }
      job->changed.notify_all();
      detail::set_thread_error_rank(-1, 0);
      t_thread_rank = -1;
    });
  }
  {
    detail::BlockingRegion blocking;  // Python: the ranks' bodies need the interpreter
    for (auto& t : threads) t.join();
  }
  comms.clear();
  if (job->failed_rank >= 0) std::rethrow_exception(errors[static_cast<size_t>(job->failed_rank)]);
}

}  // namespace shardopt
