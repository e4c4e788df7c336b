// c10d adapter: any torch ProcessGroup (Gloo here; NCCL/MPI where torch has them) as a
// Communicator. The only TU that includes c10d headers. Gloo in torch 1.13 has neither
// reduce_scatter nor AVG: both are emulated (all_reduce of a scratch copy; Sum then divide). Its
// Gloo also lacks bfloat16: copies move the bits as float16, reductions run on a float32 copy.
#include "shardopt/process_group.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/engines.hpp"
#include "shardopt/error.hpp"

namespace shardopt {
namespace {

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Avg: return c10d::ReduceOp::AVG;
  }
  return c10d::ReduceOp::SUM;
}

class ProcessGroupWork final : public Work {
 public:
  ProcessGroupWork(std::string description, Duration timeout, c10::intrusive_ptr<c10d::Work> work,
                   std::function<void()> then = {})
      : Work(std::move(description), timeout), work_(std::move(work)), then_(std::move(then)) {}
  bool is_completed() override { return work_->isCompleted(); }

 protected:
  bool wait_for(Duration timeout) override {
    try {
      work_->wait(timeout);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      // c10d reports both deadlines (ours and Gloo's own) as exceptions; returning false lets
      // Work::wait raise the Timeout (and record it, so teardown stops waiting).
      if (what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos) {
        return false;
      }
      SHARDOPT_FAIL(Communication, "comm: {} failed: {}", description(), first_line(what));
    }
    return true;
  }
  void on_complete() override {
    if (then_) then_();
  }

 private:
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
};

// Gloo (torch 1.13) rejects bfloat16. Same-width float16 carries the bits of pure copies.
at::Tensor transport_bits(const at::Tensor& t, bool gloo) {
  return gloo && t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t;
}

class ProcessGroupCommunicator final : public Communicator {
 public:
  explicit ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : Communicator(group->getRank(), group->getSize()), group_(std::move(group)),
        name_(group_->getBackendName()) {}

  std::string backend() const override { return name_; }
  Capabilities capabilities() const override {
    Capabilities caps;
    caps.native_avg = name_ == "nccl";
    caps.native_reduce_scatter = name_ == "nccl";
    caps.cuda_tensors = name_ == "nccl" || name_ == "gloo";
    caps.cpu_tensors = name_ != "nccl";
    return caps;
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op) override {
    const std::string what = fmt::format("all_reduce({}, {})", describe(t), to_string(op));
    if (needs_widening(t)) {
      at::Tensor wide = t.to(at::kFloat);
      return wrap(what, issue_all_reduce(wide, op), [t, wide] { t.copy_(wide); });
    }
    return wrap(what, issue_all_reduce(t, op));
  }

  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) override {
    const std::string what =
        fmt::format("reduce_scatter({} -> {}, {})", describe(in), describe(out), to_string(op));
    if (capabilities().native_reduce_scatter) {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = c10d_op(op);
      opts.timeout = timeout();
      at::Tensor o = out, i = in;
      return wrap(what, group_->_reduce_scatter_base(o, i, opts));
    }
    // Emulation: all_reduce a copy (the input must stay unchanged), keep our slice.
    at::Tensor copy = needs_widening(in) ? in.reshape(-1).to(at::kFloat) : in.reshape(-1).clone();
    const int64_t shard = out.numel();
    const int r = rank();
    return wrap(what, issue_all_reduce(copy, op), [copy, out, shard, r] {
      out.view(-1).copy_(copy.narrow(0, r * shard, shard));
    });
  }

  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    const std::string what = fmt::format("all_gather({} -> {})", describe(in), describe(out));
    c10d::AllgatherOptions opts;
    opts.timeout = timeout();
    at::Tensor flat_out = out.view(-1);
    if (name_ == "nccl") {
      at::Tensor i = in;
      return wrap(what, group_->_allgather_base(flat_out, i, opts));
    }
    // Gloo writes each rank's piece into a list of outputs: views into `out`. Our own input may
    // alias its slot, so it travels as a copy.
    const int64_t shard = in.numel();
    at::Tensor out_bits = transport_bits(flat_out, true);
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int j = 0; j < size(); ++j) outputs[0].push_back(out_bits.narrow(0, j * shard, shard));
    std::vector<at::Tensor> inputs{transport_bits(in.reshape(-1).clone(), true)};
    return wrap(what, group_->allgather(outputs, inputs, opts));
  }

  WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    std::vector<at::Tensor> tensors{transport_bits(t, name_ == "gloo")};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeout();
    return wrap(fmt::format("broadcast({}, root {})", describe(t), root),
                group_->broadcast(tensors, opts));
  }

  void do_barrier() override {
    c10d::BarrierOptions opts;
    opts.timeout = timeout();
    wrap("barrier", group_->barrier(opts))->wait();
  }

 private:
  bool needs_widening(const at::Tensor& t) const {
    return name_ == "gloo" && t.scalar_type() == at::kBFloat16;
  }
  c10::intrusive_ptr<c10d::Work> issue_all_reduce(const at::Tensor& t, ReduceOp op) {
    std::vector<at::Tensor> tensors{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d_op(op);
    opts.timeout = timeout();
    return group_->allreduce(tensors, opts);
  }

  WorkPtr wrap(const std::string& what, c10::intrusive_ptr<c10d::Work> work,
               std::function<void()> then = {}) {
    return std::make_shared<ProcessGroupWork>(fmt::format("{} on {}", what, name_), timeout(),
                                              std::move(work), std::move(then));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string name_;
};

CommunicatorPtr make_gloo(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                          Duration timeout) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(std::move(store), rank, size, opts);
  auto comm = make_process_group_communicator(group);
  comm->set_timeout(timeout);
  return comm;
}

}  // namespace

CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  SHARDOPT_CHECK(group, InvalidArgument, "comm: make_process_group_communicator got a null group");
  return std::make_shared<ProcessGroupCommunicator>(std::move(group));
}

CommunicatorPtr make_gloo_communicator(const GlooOptions& options) {
  SHARDOPT_CHECK(options.size >= 1 && options.rank >= 0 && options.rank < options.size,
                 InvalidArgument, "comm.gloo: rank must lie in [0, size), got rank {} of size {}",
                 options.rank, options.size);
  const std::string& spec = options.store;
  if (spec.rfind("file:", 0) == 0) {
    auto store = c10::make_intrusive<c10d::FileStore>(spec.substr(5), options.size);
    return make_gloo(store, options.rank, options.size, options.timeout);
  }
  if (spec.rfind("tcp://", 0) == 0) {
    const auto colon = spec.rfind(':');
    SHARDOPT_CHECK(colon != std::string::npos && colon > 6, InvalidArgument,
                   "comm.gloo: store '{}' must look like tcp://host:port", spec);
    return detail::make_gloo_tcp_communicator(options.rank, options.size,
                                              spec.substr(6, colon - 6),
                                              std::stoi(spec.substr(colon + 1)), options.timeout);
  }
  SHARDOPT_FAIL(InvalidArgument, "comm.gloo: store must be 'file:/path' or 'tcp://host:port', got '{}'",
                spec);
}

namespace detail {
CommunicatorPtr make_gloo_tcp_communicator(int rank, int size, const std::string& host, int port,
                                           Duration timeout) {
  SHARDOPT_CHECK(port > 0 && port < 65536, InvalidArgument,
                 "comm.gloo: port must lie in (0, 65536), got {}", port);
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = rank == 0;
  opts.numWorkers = size;
  opts.timeout = timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  return make_gloo(store, rank, size, timeout);
}
}  // namespace detail

}  // namespace shardopt
