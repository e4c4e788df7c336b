// Asynchronous grid checkpoints (Note [Asynchronous saves] in shardopt/async_checkpoint.hpp): a
// snapshot of the optimizer's ShardAccess in reused host buffers, saved by the ordinary save path
// on a background thread over private communicators.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>

#ifdef __linux__
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#endif
#include <chrono>
#include <ctime>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/saving.hpp"
#include "checkpoint/shard_image.hpp"
#include "checkpoint/staging.hpp"
#include "comm/polite_waits.hpp"
#include "shardopt/async_checkpoint.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

namespace {

using detail::ShardAccess;

// The optimizer as it was at the snapshot: what changes with steps (owned slices, step count,
// rules, loss scaler) from the snapshot, the rest (layout, names, shapes, the tensors' split
// records) from the optimizer, whose answers do not change; its own communicators.
class SnapshotAccess final : public ShardAccess, public detail::ShardImageSource {
 public:
  SnapshotAccess(ShardAccess& real, CommunicatorPtr comm, CommunicatorPtr world)
      : real_(real), comm_(std::move(comm)), world_(std::move(world)) {}

  // Main thread, no save in flight: copies the owned slices into the (reused) host buffers: the
  // shard file's image where the slices are host tensors (Note [Shard images]), else a tensor per
  // section.
  void take() {
    at::NoGradGuard no_grad;
    const auto& layout = real_.layout();
    const int sections = 1 + real_.state_buffer_count();
    if (!image_ && sections_.empty() && detail::ShardImage::fits(real_)) {
      image_ = std::make_unique<detail::ShardImage>(real_);
    }
    if (image_) {
      image_->take(real_);
    } else if (sections_.empty()) {
      // Note [Quantised state in checkpoints]: a state section's length and dtype are its own.
      state_ = detail::state_sections(real_);
      const bool device = !layout.buckets.empty() && real_.owned_param_slice(0).is_cuda();
      const auto options = at::TensorOptions().dtype(real_.master_dtype()).pinned_memory(device);
      sections_.push_back(at::empty({layout.shard_numel}, options));
      for (int k = 1; k < sections; ++k) {
        const auto s = static_cast<size_t>(k - 1);
        sections_.push_back(at::empty({state_.maps[s].size()}, options.dtype(state_.dtypes[s])));
      }
    }
    for (size_t b = 0; !image_ && b < layout.buckets.size(); ++b) {
      const int bucket = static_cast<int>(b);
      slice(0, bucket).copy_(real_.owned_param_slice(bucket));
      for (int k = 1; k < sections; ++k) {
        slice(k, bucket).copy_(real_.owned_state_slice(k - 1, bucket));
      }
    }
    if (shapes_.empty()) {  // read here: the training thread may touch the tensors later
      for (size_t i = 0; i < layout.slots.size(); ++i) {
        shapes_.push_back(real_.param_shape(static_cast<int>(i)));
      }
    }
    steps_ = real_.step_count();
    rules_.clear();
    for (int g = 0; g < real_.group_count(); ++g) rules_.push_back(real_.group_rule(g));
    scaler_ = real_.loss_scaler_state();
  }
  // The state's bytes (an image's header and padding, under 64 bytes a section, not counted).
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto& t : sections_) n += static_cast<int64_t>(t.nbytes());
    if (image_) {
      for (const auto& s : image_->sections()) {
        n += s.entries * static_cast<int64_t>(c10::elementSize(s.dtype));
      }
    }
    return n;
  }
  const detail::ShardImage* shard_image() const override { return image_.get(); }

  const detail::FlatLayout& layout() const override { return real_.layout(); }
  const ZeroOptions& zero_options() const override { return real_.zero_options(); }
  const CommunicatorPtr& comm() const override { return comm_; }
  const CommunicatorPtr& world_comm() const override { return world_; }
  int replica() const override { return real_.replica(); }
  int replicas() const override { return real_.replicas(); }
  const std::string& param_name(int index) const override { return real_.param_name(index); }
  std::vector<int64_t> param_shape(int index) const override {
    return shapes_.at(static_cast<size_t>(index));
  }
  const at::Tensor& param_tensor(int index) const override { return real_.param_tensor(index); }
  int64_t param_order(int index) const override { return real_.param_order(index); }
  at::ScalarType master_dtype() const override { return real_.master_dtype(); }
  bool has_factory_optimizer() const override { return real_.has_factory_optimizer(); }
  int state_buffer_count() const override { return real_.state_buffer_count(); }
  at::Tensor owned_param_slice(int bucket) override { return slice(0, bucket); }
  at::Tensor owned_state_slice(int state, int bucket) override { return slice(state + 1, bucket); }
  int64_t step_count() const override { return steps_; }
  void set_step_count(int64_t) override { refuse("set_step_count"); }
  int group_count() const override { return static_cast<int>(rules_.size()); }
  Rule group_rule(int group) const override { return rules_.at(static_cast<size_t>(group)); }
  void set_group_rule(int, const Rule&) override { refuse("set_group_rule"); }
  std::optional<LossScaler::State> loss_scaler_state() const override { return scaler_; }
  void set_loss_scaler_state(const LossScaler::State&) override { refuse("set_loss_scaler"); }
  void after_load() override { refuse("after_load"); }
  void set_snapshot_host_bytes(int64_t) override { refuse("set_snapshot_host_bytes"); }
  int64_t snapshot_host_bytes() const override { return real_.snapshot_host_bytes(); }

 private:
  at::Tensor slice(int section, int bucket) {
    if (image_) return image_->slice(section, bucket);
    const auto& bl = real_.layout().buckets[static_cast<size_t>(bucket)];
    if (section == 0) return sections_[0].narrow(0, bl.shard_offset, bl.shard);
    const auto [first, count] = state_.slice(real_.layout(), section - 1, bucket);
    return sections_[static_cast<size_t>(section)].narrow(0, first, count);
  }
  [[noreturn]] static void refuse(const char* what) {
    SHARDOPT_INTERNAL_ASSERT(false, "a checkpoint snapshot is read-only ({})", what);
    std::terminate();
  }

  ShardAccess& real_;
  CommunicatorPtr comm_, world_;
  std::unique_ptr<detail::ShardImage> image_;  // Note [Shard images]; or:
  std::vector<at::Tensor> sections_;  // param, then each state buffer: shard coordinates
  detail::StateSections state_;       // where each state section's bucket slices are
  std::vector<std::vector<int64_t>> shapes_;
  int64_t steps_ = 0;
  std::vector<Rule> rules_;
  std::optional<LossScaler::State> scaler_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The calling thread's CPU time (0 where the clock is missing).
double thread_cpu_seconds() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0.0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

TrainerState copied(const TrainerState& t) {
  TrainerState out{t.json, {}};
  for (const auto& [key, value] : t.tensors) {
    out.tensors[key] = value.defined() ? value.detach().to(at::kCPU).clone() : value;
  }
  return out;
}

}  // namespace

struct AsyncCheckpoint::State {
  ShardAccess& real;
  ParallelGroups groups;  // the grid and this rank's place (its communicators are not used)
  CommunicatorPtr world;  // the background's copy of groups.world
  std::unique_ptr<SnapshotAccess> snapshot;
  std::thread thread;
  mutable std::mutex mutex;  // guards timing
  std::exception_ptr failure;
  AsyncSaveTiming timing;

  AsyncCheckpointOptions options;

  State(ShardAccess& a, const ParallelGroups& g, AsyncCheckpointOptions o)
      : real(a), groups(g), options(o) {}
  void join() {
    if (thread.joinable()) thread.join();
  }
};

AsyncCheckpoint::AsyncCheckpoint(DistributedOptimizer& optimizer, const ParallelGroups& groups,
                                 const AsyncCheckpointOptions& options)
    : state_(std::make_unique<State>(detail::shard_access(optimizer), groups, options)) {
  SHARDOPT_CHECK(options.writer_niceness >= 0 && options.writer_niceness <= 19, InvalidArgument,
                 "checkpoint: AsyncCheckpointOptions::writer_niceness must be in [0, 19], got {}",
                 options.writer_niceness);
  SHARDOPT_CHECK(groups.world != nullptr, InvalidArgument,
                 "checkpoint: AsyncCheckpoint needs ParallelGroups::world (make_parallel_groups)");
  ShardAccess& a = state_->real;
  // Private copies, split in one order on every rank: the world, the data-parallel group, and
  // the shard group where hybrid sharding makes it another one.
  state_->world = groups.world->split(0, groups.world->rank());
  CommunicatorPtr dp = a.world_comm()->split(0, a.world_comm()->rank());
  CommunicatorPtr shard = a.comm() == a.world_comm() ? dp : a.comm()->split(0, a.comm()->rank());
  state_->snapshot = std::make_unique<SnapshotAccess>(a, shard, dp);
}

AsyncCheckpoint::~AsyncCheckpoint() { state_->join(); }

void AsyncCheckpoint::save_checkpoint_async(const std::string& base, const TrainerState& trainer,
                                            const SaveOptions& options,
                                            const GridSaveOptions& grid) {
  const auto t0 = std::chrono::steady_clock::now();
  wait();
  State& s = *state_;
  s.snapshot->take();
  SaveOptions saved = options;  // the module's tensors as they are now
  for (auto& [name, t] : saved.module_state) t = t.detach().to(at::kCPU).clone();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.timing = {seconds_since(t0), 0};
  }
  s.thread = std::thread([&s, base, trainer = copied(trainer), saved, grid] {
    const auto start = std::chrono::steady_clock::now();
#ifdef __linux__
    pthread_setname_np(pthread_self(), "ckpt-writer");  // for profilers (perf --comm ckpt-writer)
    // Linux's nice value is per thread: the step's threads keep theirs (best effort: a refused
    // change leaves the writer at the training's priority).
    if (s.options.writer_niceness != 0) {
      const auto tid = static_cast<id_t>(syscall(SYS_gettid));
      errno = 0;
      const int now = getpriority(PRIO_PROCESS, tid);
      if (errno == 0) setpriority(PRIO_PROCESS, tid, std::min(19, now + s.options.writer_niceness));
    }
#endif
    // The writer waits for the other ranks for much of the save (world rank 0's manifest and
    // commit): its collectives must not spin on a core the steps need (Note [Polite waits]).
    detail::PoliteWaits polite;
    try {
      detail::save_grid(*s.snapshot, *s.world, s.groups, base, trainer, saved, grid);
    } catch (...) {
      s.failure = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(s.mutex);
    s.timing.background_s = seconds_since(start);
    s.timing.background_cpu_s = thread_cpu_seconds();
  });
}

void AsyncCheckpoint::wait() {
  State& s = *state_;
  s.join();
  if (s.failure) std::rethrow_exception(std::exchange(s.failure, nullptr));
}

bool AsyncCheckpoint::in_flight() const { return state_->thread.joinable(); }

AsyncSaveTiming AsyncCheckpoint::last_timing() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->timing;
}

int64_t AsyncCheckpoint::snapshot_bytes() const { return state_->snapshot->bytes(); }

}  // namespace shardopt
