// Hybrid sharding as a communicator (shardopt/comm.hpp, make_hybrid_communicator): the shard
// group's view of the world. Composite collectives run in submission order on one worker thread
// that issues every step to the intra- and inter-group communicators, so both see the same order
// of calls on every rank while the caller computes.
#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"

namespace shardopt {
namespace {

class ChainWork final : public Work {
 public:
  ChainWork(std::string description, Duration timeout, std::shared_future<void> done,
            std::shared_ptr<std::atomic<bool>> timed_out)
      : Work(std::move(description), timeout), done_(std::move(done)),
        timed_out_(std::move(timed_out)) {}
  bool is_completed() override {
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

 protected:
  bool wait_for(Duration timeout) override {
    if (done_.wait_for(timeout) != std::future_status::ready) {
      *timed_out_ = true;
      return false;
    }
    done_.get();  // rethrows the inner engines' errors
    return true;
  }

 private:
  std::shared_future<void> done_;
  std::shared_ptr<std::atomic<bool>> timed_out_;
};

class HybridCommunicator final : public Communicator {
 public:
  HybridCommunicator(CommunicatorPtr world, CommunicatorPtr intra, CommunicatorPtr inter)
      : Communicator(intra->rank(), intra->size()), world_(std::move(world)),
        intra_(std::move(intra)), inter_(std::move(inter)) {
    set_timeout(world_->timeout());
    worker_ = std::thread([this] { run_worker(); });
  }
  ~HybridCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    // After a timeout the worker may wait inside an engine for good (Note [MPI timeouts]).
    if (*timed_out_) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }

  std::string backend() const override {
    return fmt::format("hybrid({}x{} {})", inter_->size(), intra_->size(), intra_->backend());
  }
  Capabilities capabilities() const override {
    const Capabilities a = intra_->capabilities(), b = inter_->capabilities();
    Capabilities caps;
    caps.native_avg = false;  // Avg = Sum / size(): the world mean (see make_hybrid_communicator)
    caps.native_reduce_scatter = a.native_reduce_scatter;
    caps.overlaps_caller = true;
    caps.cpu_tensors = a.cpu_tensors && b.cpu_tensors;
    caps.cuda_tensors = a.cuda_tensors && b.cuda_tensors;
    caps.can_time_out = a.can_time_out && b.can_time_out;
    return caps;
  }

 protected:
  // Within the group, then the shard's all-reduce across replicas.
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) override {
    return submit(fmt::format("reduce_scatter({} -> {}, {}) on {}", describe(in), describe(out),
                              to_string(op), backend()),
                  [this, in, out, op] {
                    intra_->reduce_scatter(in, out, op, true)->wait();
                    inter_->all_reduce(out, across(op), true)->wait();
                  });
  }
  // Reduce-scatter within, all-reduce of the shard across, all-gather within: the 1/L of the
  // bytes crosses; lengths that do not divide by L take two all-reduces.
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op) override {
    return submit(fmt::format("all_reduce({}, {}) on {}", describe(t), to_string(op), backend()),
                  [this, t, op] {
                    const int64_t l = intra_->size();
                    if (t.numel() % l != 0 || l == 1) {
                      intra_->all_reduce(t, op, true)->wait();
                      inter_->all_reduce(t, across(op), true)->wait();
                      return;
                    }
                    at::Tensor flat = t.view(-1);
                    at::Tensor own = flat.narrow(0, intra_->rank() * (t.numel() / l), t.numel() / l);
                    intra_->reduce_scatter(flat, own, op, true)->wait();
                    inter_->all_reduce(own, across(op), true)->wait();
                    intra_->all_gather(own, flat, true)->wait();
                  });
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    return submit(fmt::format("all_gather({} -> {}) on {}", describe(in), describe(out), backend()),
                  [this, in, out] { intra_->all_gather(in, out, true)->wait(); });
  }
  // From world rank `root` (in the first group) to its peers across replicas, then within.
  WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    return submit(fmt::format("broadcast({}, root {}) on {}", describe(t), root, backend()),
                  [this, t, root] {
                    if (intra_->rank() == root) inter_->broadcast(t, 0, true)->wait();
                    intra_->broadcast(t, root, true)->wait();
                  });
  }
  void do_barrier() override {
    submit("barrier on " + backend(), [this] { world_->barrier(); })->wait();
  }
  void do_abort(int exit_code) override { world_->abort(exit_code); }

 private:
  // Sum within the group, mean across replicas: the optimizer divides by size() (the group's).
  static ReduceOp across(ReduceOp op) { return op == ReduceOp::Sum ? ReduceOp::Avg : op; }

  WorkPtr submit(std::string description, std::function<void()> fn) {
    std::packaged_task<void()> task(std::move(fn));
    std::shared_future<void> done = task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
    return std::make_shared<ChainWork>(std::move(description), timeout(), std::move(done),
                                       timed_out_);
  }

  void run_worker() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  CommunicatorPtr world_, intra_, inter_;
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::shared_ptr<std::atomic<bool>> timed_out_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace

CommunicatorPtr make_hybrid_communicator(const CommunicatorPtr& world, int shard_group_size) {
  SHARDOPT_CHECK(world, InvalidArgument, "comm.hybrid: the world communicator is null");
  const int n = world->size(), r = world->rank();
  SHARDOPT_CHECK(shard_group_size >= 1 && shard_group_size <= n && n % shard_group_size == 0,
                 InvalidArgument,
                 "comm.hybrid: shard_group_size must divide the world size {} (one group per "
                 "host: the ranks per host), got {}",
                 n, shard_group_size);
  if (shard_group_size == n) return world;
  CommunicatorPtr intra = world->split(r / shard_group_size, r);
  CommunicatorPtr inter = world->split(r % shard_group_size, r);
  return std::make_shared<HybridCommunicator>(world, std::move(intra), std::move(inter));
}

}  // namespace shardopt
