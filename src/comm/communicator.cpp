// Communicator front end: argument validation shared by every engine, Avg emulation, the
// single-process engine and init_from_env().
#include <ATen/ATen.h>
#include <fmt/ranges.h>  // fmt::join

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>

#include "comm/engines.hpp"
#include "plugins.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/config.hpp"
#include "shardopt/error.hpp"
#include "shardopt/threads.hpp"

namespace shardopt {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined tensor";
  return fmt::format("[{}] {} {}", fmt::join(t.sizes(), ", "), c10::toString(t.scalar_type()),
                     t.device().str());
}

namespace {
std::atomic<bool> g_timed_out{false};
// A thread-rank's timeouts are its own (Note [Ranks that are threads] in src/error.cpp): its job
// ends with run_ranks, and the process's next job must not skip its teardown waits.
thread_local bool t_timed_out = false;
}  // namespace

bool detail::collective_timed_out() {
  return thread_rank() >= 0 ? t_timed_out : g_timed_out.load();
}

namespace detail {
namespace {
std::atomic<void* (*)()> g_blocking_enter{nullptr};
std::atomic<void (*)(void*)> g_blocking_exit{nullptr};
}  // namespace

void set_blocking_hooks(BlockingHooks hooks) {
  g_blocking_exit = hooks.exit;
  g_blocking_enter = hooks.enter;
}

BlockingRegion::BlockingRegion() {
  if (auto* enter = g_blocking_enter.load()) token_ = enter();
}

BlockingRegion::~BlockingRegion() {
  if (token_ == nullptr) return;
  if (auto* exit = g_blocking_exit.load()) exit(token_);
}
}  // namespace detail

Duration default_timeout() {
  const char* text = std::getenv("SHARDOPT_TIMEOUT");
  if (text == nullptr || *text == '\0') return kDefaultTimeout;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  SHARDOPT_CHECK(end != text && *end == '\0' && seconds > 0 && seconds < 1e9, InvalidArgument,
                 "comm: SHARDOPT_TIMEOUT must be a positive number of seconds, got '{}'", text);
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(seconds));
}

void Work::wait(Duration timeout) {
  if (done_) return;
  const Duration deadline = timeout > Duration::zero() ? timeout : default_timeout_;
  const bool completed = wait_for(deadline);
  if (!completed && thread_rank() >= 0) {
    t_timed_out = true;
  } else if (!completed) {
    g_timed_out = true;
  }
  SHARDOPT_CHECK(completed, Timeout,
                 "comm: {} did not complete within {} ms; a rank may have died, hung, or not made "
                 "the same call",
                 description_, deadline.count());
  on_complete();
  done_ = true;
}

namespace {

class CompletedWork final : public Work {
 public:
  explicit CompletedWork(std::string description) : Work(std::move(description), kDefaultTimeout) {}
  bool is_completed() override { return true; }

 protected:
  bool wait_for(Duration) override { return true; }
};

// Sum on the engine, then a division by the world size once the result is in.
class AvgWork final : public Work {
 public:
  AvgWork(WorkPtr inner, at::Tensor result, int world, Duration timeout)
      : Work(inner->description(), timeout), inner_(std::move(inner)),
        result_(std::move(result)), world_(world) {}
  bool is_completed() override { return inner_->is_completed(); }

 protected:
  bool wait_for(Duration timeout) override {
    inner_->wait(timeout);
    return true;
  }
  void on_complete() override {
    if (at::isIntegralType(result_.scalar_type(), /*includeBool=*/false)) {
      result_.div_(world_, "trunc");
    } else {
      result_.div_(world_);
    }
  }

 private:
  WorkPtr inner_;
  at::Tensor result_;
  int world_;
};

bool supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kByte:
      return true;
    default:
      return false;
  }
}

void check_tensor(const Communicator& comm, const char* op, const char* what, const at::Tensor& t) {
  SHARDOPT_CHECK(t.defined(), InvalidArgument, "comm.{}: {} is an undefined tensor", op, what);
  SHARDOPT_CHECK(t.is_contiguous(), InvalidArgument,
                 "comm.{}: {} must be contiguous, got {} with strides [{}]", op, what, describe(t),
                 fmt::join(t.strides(), ", "));
  SHARDOPT_CHECK(supported_dtype(t.scalar_type()), InvalidArgument,
                 "comm.{}: {} has unsupported dtype {}; expected one of float32, float64, "
                 "float16, bfloat16, int32, int64, uint8",
                 op, what, c10::toString(t.scalar_type()));
  const auto caps = comm.capabilities();
  SHARDOPT_CHECK(t.is_cpu() ? caps.cpu_tensors : (t.is_cuda() && caps.cuda_tensors),
                 InvalidArgument, "comm.{}: {} is on {}, which the {} engine does not serve", op,
                 what, t.device().str(), comm.backend());
}

void check_pair(const char* op, const at::Tensor& in, const at::Tensor& out) {
  SHARDOPT_CHECK(in.scalar_type() == out.scalar_type(), InvalidArgument,
                 "comm.{}: input and output dtypes differ, input {}, output {}", op, describe(in),
                 describe(out));
  SHARDOPT_CHECK(in.device() == out.device(), InvalidArgument,
                 "comm.{}: input and output devices differ, input {}, output {}", op, describe(in),
                 describe(out));
}

// `part` (S elements) may be exactly whole[rank*S, (rank+1)*S) or disjoint from `whole`.
void check_alias(const char* op, const at::Tensor& whole, const at::Tensor& part, int rank) {
  const auto* w0 = static_cast<const char*>(whole.data_ptr());
  const auto* w1 = w0 + whole.nbytes();
  const auto* p0 = static_cast<const char*>(part.data_ptr());
  const auto* p1 = p0 + part.nbytes();
  const bool disjoint = p1 <= w0 || w1 <= p0;
  const bool own_slice = p0 == w0 + rank * part.nbytes();
  SHARDOPT_CHECK(part.numel() == 0 || disjoint || own_slice, InvalidArgument,
                 "comm.{}: the shard overlaps the full buffer but is not rank {}'s slice; "
                 "it must be exactly [rank*S, (rank+1)*S) or not overlap at all",
                 op, rank);
}

// Waits for every part against one deadline (the parts' own errors pass through).
class WorkGroup final : public Work {
 public:
  WorkGroup(std::string description, std::vector<WorkPtr> parts, Duration timeout)
      : Work(std::move(description), timeout), parts_(std::move(parts)) {}
  bool is_completed() override {
    for (const auto& p : parts_) {
      if (!p->is_completed()) return false;
    }
    return true;
  }

 protected:
  bool wait_for(Duration timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (const auto& p : parts_) {
      const auto left = std::chrono::duration_cast<Duration>(deadline -
                                                             std::chrono::steady_clock::now());
      if (left <= Duration::zero() && !p->is_completed()) return false;
      p->wait(std::max(left, Duration(1)));  // a part's Timeout names the message
    }
    return true;
  }

 private:
  std::vector<WorkPtr> parts_;
};

}  // namespace

WorkPtr make_work_group(std::string description, std::vector<WorkPtr> parts, Duration timeout) {
  if (parts.size() == 1) return std::move(parts.front());
  return std::make_shared<WorkGroup>(std::move(description), std::move(parts), timeout);
}

WorkPtr make_completed_work(std::string description) {
  return std::make_shared<CompletedWork>(std::move(description));
}

Communicator::Communicator(int rank, int size) : rank_(rank), size_(size) {
  SHARDOPT_CHECK(size >= 1 && rank >= 0 && rank < size, InvalidArgument,
                 "comm: rank must lie in [0, size), got rank {} of size {}", rank, size);
  set_error_rank(rank, size);
}

void Communicator::set_timeout(Duration timeout) {
  SHARDOPT_CHECK(timeout > Duration::zero(), InvalidArgument,
                 "comm: timeout must be positive, got {} ms", timeout.count());
  timeout_ = timeout;
}

WorkPtr Communicator::finish(WorkPtr work, const at::Tensor& result, ReduceOp requested,
                             bool async) {
  if (requested == ReduceOp::Avg && !capabilities().native_avg) {
    work = std::make_shared<AvgWork>(std::move(work), result, size_, timeout_);
  }
  if (!async) work->wait();
  return work;
}

static ReduceOp engine_op(ReduceOp op, const Capabilities& caps) {
  return op == ReduceOp::Avg && !caps.native_avg ? ReduceOp::Sum : op;
}

WorkPtr Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op, bool async) {
  check_tensor(*this, "all_reduce", "tensor", tensor);
  return finish(do_all_reduce(tensor, engine_op(op, capabilities())), tensor, op, async);
}

WorkPtr Communicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                     ReduceOp op, bool async) {
  check_tensor(*this, "reduce_scatter", "input", input);
  check_tensor(*this, "reduce_scatter", "output", output);
  check_pair("reduce_scatter", input, output);
  SHARDOPT_CHECK(input.numel() == output.numel() * size_, InvalidArgument,
                 "comm.reduce_scatter: input must hold world size x output elements, expected "
                 "{} x {} = {}, got {} (input {}, output {})",
                 size_, output.numel(), size_ * output.numel(), input.numel(), describe(input),
                 describe(output));
  check_alias("reduce_scatter", input, output, rank_);
  return finish(do_reduce_scatter(input, output, engine_op(op, capabilities())), output, op,
                async);
}

WorkPtr Communicator::all_gather(const at::Tensor& input, const at::Tensor& output, bool async) {
  check_tensor(*this, "all_gather", "input", input);
  check_tensor(*this, "all_gather", "output", output);
  check_pair("all_gather", input, output);
  SHARDOPT_CHECK(output.numel() == input.numel() * size_, InvalidArgument,
                 "comm.all_gather: output must hold world size x input elements, expected "
                 "{} x {} = {}, got {} (input {}, output {})",
                 size_, input.numel(), size_ * input.numel(), output.numel(), describe(input),
                 describe(output));
  check_alias("all_gather", output, input, rank_);
  return finish(do_all_gather(input, output), output, ReduceOp::Sum, async);
}

WorkPtr Communicator::broadcast(const at::Tensor& tensor, int root, bool async) {
  check_tensor(*this, "broadcast", "tensor", tensor);
  SHARDOPT_CHECK(root >= 0 && root < size_, InvalidArgument,
                 "comm.broadcast: root must lie in [0, {}), got {}", size_, root);
  return finish(do_broadcast(tensor, root), tensor, ReduceOp::Sum, async);
}

void Communicator::barrier() { do_barrier(); }

void Communicator::send(const at::Tensor& tensor, int dst) { isend(tensor, dst)->wait(); }
void Communicator::recv(const at::Tensor& tensor, int src) { irecv(tensor, src)->wait(); }
WorkPtr Communicator::isend(const at::Tensor& tensor, int dst) {
  return batch_isend_irecv({P2pOp::send(tensor, dst)});
}
WorkPtr Communicator::irecv(const at::Tensor& tensor, int src) {
  return batch_isend_irecv({P2pOp::recv(tensor, src)});
}

WorkPtr Communicator::batch_isend_irecv(const std::vector<P2pOp>& ops) {
  for (const auto& op : ops) {
    const bool send = op.kind == P2pOp::Kind::Send;
    const char* name = send ? "send" : "recv";
    check_tensor(*this, name, "tensor", op.tensor);
    SHARDOPT_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, InvalidArgument,
                   "comm.{}: the peer must be another rank of this communicator, in [0, {}) and "
                   "not {} (this rank), got {} ({} on {})",
                   name, size_, rank_, op.peer, describe(op.tensor), backend());
  }
  if (ops.empty()) return make_completed_work("empty batch_isend_irecv");
  return do_batch_isend_irecv(ops);
}

std::string detail::describe_p2p(const P2pOp& op, const std::string& backend) {
  const bool send = op.kind == P2pOp::Kind::Send;
  return fmt::format("{}({} {} rank {}) on {}", send ? "send" : "recv", describe(op.tensor),
                     send ? "to" : "from", op.peer, backend);
}

void detail::fail_p2p_mismatch(const P2pOp& op, const std::string& backend,
                               const std::string& got) {
  SHARDOPT_FAIL(Mismatch,
                "comm.recv: the message from rank {} does not match the receiving tensor, "
                "expected {} x {} ({} bytes), got {} ({}); the ranks' sends and receives "
                "disagree",
                op.peer, op.tensor.numel(), c10::toString(op.tensor.scalar_type()),
                op.tensor.nbytes(), got, describe_p2p(op, backend));
}

WorkPtr Communicator::do_batch_isend_irecv(const std::vector<P2pOp>&) {
  SHARDOPT_FAIL(Unsupported, "comm.send/recv: the {} engine has no point-to-point messages",
                backend());
}

CommunicatorPtr Communicator::split(int color, int key) {
  CommunicatorPtr sub = do_split(color < 0 ? -1 : color, key);
  SHARDOPT_INTERNAL_ASSERT((color < 0) == (sub == nullptr),
                           "comm.split on {}: color {} gave {} communicator", backend(), color,
                           sub ? "a" : "no");
  if (sub) sub->set_timeout(timeout_);
  return sub;
}

CommunicatorPtr Communicator::split_by_host() {
  CommunicatorPtr sub = do_split_by_host();
  SHARDOPT_INTERNAL_ASSERT(sub != nullptr, "comm.split_by_host on {} gave no communicator",
                           backend());
  sub->set_timeout(timeout_);
  return sub;
}

void Communicator::abort(int exit_code) {
  do_abort(exit_code);
  std::_Exit(exit_code);
}

void Communicator::do_abort(int) {}

CommunicatorPtr Communicator::do_split(int, int) {
  SHARDOPT_FAIL(Unsupported, "comm.split: the {} engine cannot make sub-communicators", backend());
}

// Hostnames travel as fixed 256-byte records; a rank's color is the first rank with its name.
CommunicatorPtr Communicator::do_split_by_host() {
  constexpr int64_t kName = 256;
  char name[kName] = {};
  SHARDOPT_CHECK(gethostname(name, kName - 1) == 0, Communication,
                 "comm.split_by_host: gethostname failed with errno {}", errno);
  at::Tensor mine = at::from_blob(name, {kName}, at::kByte).clone();
  at::Tensor all = at::empty({kName * size_}, at::kByte);
  all_gather(mine, all);
  int color = rank_;
  for (int r = 0; r < rank_; ++r) {
    if (all.narrow(0, r * kName, kName).equal(mine)) {
      color = r;
      break;
    }
  }
  return split(color, rank_);
}

namespace {

class SingleCommunicator final : public Communicator {
 public:
  SingleCommunicator() : Communicator(0, 1) {}
  std::string backend() const override { return "single"; }
  Capabilities capabilities() const override {
    Capabilities caps;
    caps.native_avg = true;
    caps.overlaps_caller = false;
    caps.cuda_tensors = true;
    return caps;
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor&, ReduceOp) override { return done("all_reduce"); }
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp) override {
    if (in.data_ptr() != out.data_ptr()) out.copy_(in);
    return done("reduce_scatter");
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    if (in.data_ptr() != out.data_ptr()) out.copy_(in);
    return done("all_gather");
  }
  WorkPtr do_broadcast(const at::Tensor&, int) override { return done("broadcast"); }
  void do_barrier() override {}
  CommunicatorPtr do_split(int color, int) override {
    return color < 0 ? nullptr : make_single_communicator();
  }
  CommunicatorPtr do_split_by_host() override { return make_single_communicator(); }

 private:
  static WorkPtr done(const char* op) { return make_completed_work(fmt::format("{} on single", op)); }
};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (!env(var).empty()) return true;
  }
  // srun sets SLURM_PROCID for every task; only a multi-task step is an MPI job.
  return !env("SLURM_PROCID").empty() && !env("SLURM_NTASKS").empty() && env("SLURM_NTASKS") != "1";
}

int env_int(const char* name) {
  const std::string v = env(name);
  char* end = nullptr;
  const long value = std::strtol(v.c_str(), &end, 10);
  SHARDOPT_CHECK(!v.empty() && end && *end == '\0', InvalidArgument,
                 "init_from_env: environment variable {} must be an integer, got '{}'", name, v);
  return static_cast<int>(value);
}

// torchrun's agent serves the store on MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True,
// static rendezvous): like torch's env:// rendezvous, connect as a client, with keys under the
// restart attempt's prefix, so that a restarted job never reads its previous attempt's keys.
[[maybe_unused]] std::optional<std::string> agent_store_prefix() {
  if (env("TORCHELASTIC_USE_AGENT_STORE") != "True") return std::nullopt;
  const std::string attempt = env("TORCHELASTIC_RESTART_COUNT");
  return fmt::format("/worker/attempt_{}", attempt.empty() ? "0" : attempt);
}

// The GPU of this process on its node: LOCAL_RANK (torchrun), else the launcher's local rank.
int local_rank() {
  for (const char* var : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                          "SLURM_LOCALID", "PMI_LOCAL_RANK"}) {
    if (!env(var).empty()) return env_int(var);
  }
  return 0;
}

}  // namespace

CommunicatorPtr make_single_communicator() { return std::make_shared<SingleCommunicator>(); }

CommunicatorPtr init_from_env(const InitOptions& options) {
  std::string backend = options.backend.empty() ? env("SHARDOPT_BACKEND") : options.backend;
  const bool torchrun = !env("RANK").empty() && !env("WORLD_SIZE").empty() &&
                        !env("MASTER_ADDR").empty() && !env("MASTER_PORT").empty();
  const bool cuda = options.device == "cuda";
  SHARDOPT_CHECK(cuda || options.device == "cpu", InvalidArgument,
                 "init_from_env: device must be 'cpu' or 'cuda', got '{}'", options.device);
  if (backend.empty()) {
    // CUDA tensors take NCCL wherever it was built; MPI or Gloo only bootstrap it.
    const bool nccl = cuda && SHARDOPT_HAS_NCCL;
    if (launched_by_mpi()) {
      backend = nccl ? "nccl" : "mpi";
    } else if (torchrun) {
      backend = nccl ? "nccl" : "gloo";
    } else {
      backend = "single";
    }
  }
  CommunicatorPtr comm;
  if (backend == "nccl") {
    SHARDOPT_CHECK(SHARDOPT_HAS_NCCL, Unsupported,
                   "init_from_env: backend 'nccl' requested, but this build of shardopt has no "
                   "NCCL (configure where CUDA and NCCL are found, SHARDOPT_WITH_NCCL=ON)");
    // The ncclUniqueId travels over the launcher's engine, which then carries host tensors.
    InitOptions boot = options;
    boot.device = "cpu";
    boot.backend = launched_by_mpi() ? "mpi" : torchrun ? "gloo" : "single";
    comm = detail::nccl_factory()(init_from_env(boot), local_rank());
  } else if (backend == "single") {
    comm = make_single_communicator();
  } else if (backend == "mpi") {
#if SHARDOPT_HAS_MPI
    comm = detail::make_mpi_world_communicator(options.timeout);
#else
    SHARDOPT_FAIL(Unsupported, "init_from_env: backend 'mpi' requested, but this build of shardopt "
                               "has no MPI (configure with SHARDOPT_WITH_MPI=ON)");
#endif
  } else if (backend == "gloo") {
#if SHARDOPT_HAS_GLOO
    SHARDOPT_CHECK(torchrun, InvalidArgument,
                   "init_from_env: backend 'gloo' needs RANK, WORLD_SIZE, MASTER_ADDR and "
                   "MASTER_PORT in the environment (torchrun sets them)");
    comm = detail::make_gloo_tcp_communicator(env_int("RANK"), env_int("WORLD_SIZE"),
                                              env("MASTER_ADDR"), env_int("MASTER_PORT"),
                                              options.timeout, agent_store_prefix());
#else
    SHARDOPT_FAIL(Unsupported, "init_from_env: backend 'gloo' requested, but this build of "
                               "shardopt has no Gloo (configure with SHARDOPT_WITH_GLOO=ON)");
#endif
  } else if (backend.rfind("threads", 0) == 0) {
    SHARDOPT_FAIL(InvalidArgument,
                  "init_from_env: backend '{}' runs several ranks in this one process, which one "
                  "communicator cannot stand for: call shardopt::run_ranks(n, body) (threads.hpp; "
                  "Python: shardopt.run_ranks), which gives each rank thread its own",
                  backend);
  } else {
    SHARDOPT_FAIL(InvalidArgument,
                  "init_from_env: unknown backend '{}'; expected one of single, mpi, gloo{}",
                  backend, SHARDOPT_HAS_NCCL ? ", nccl" : "");
  }
  comm->set_timeout(options.timeout);
  return comm;
}

}  // namespace shardopt
