// c10d adapter: any torch ProcessGroup (Gloo here; NCCL/MPI where torch has them) as a
// Communicator. The only TU that includes c10d headers. Gloo has neither reduce_scatter (torch
// 1.13) nor AVG: both are emulated (all_reduce of a scratch copy; Sum then divide). Gloo in torch
// 1.13 also lacks bfloat16: copies move the bits as float16, reductions run on a float32 copy.
//
// Note [c10d across torch versions]: in torch 1.13 ProcessGroupGloo *is* a c10d::ProcessGroup;
// from torch 2.0 it is a c10d::Backend, and a ProcessGroup is a front end that dispatches through
// registered c10d ops to the Backend set for each device. Both types offer the same collective
// calls (allreduce, allgather, broadcast, barrier, _reduce_scatter_base, getBackendName), so one
// adapter template serves both: a group handed in by the user (torch.distributed's, from
// Python) is wrapped as a ProcessGroup on every version, and our own Gloo group is wrapped as what
// ProcessGroupGloo is on this version (GlooGroup below), with no dispatcher in between.
//
// Note [c10d without Gloo]: pip's torch wheels carry ProcessGroupGloo.hpp but not Gloo's own
// headers, so there this TU is built without SHARDOPT_HAS_GLOO: the adapter over a group made by
// torch.distributed (from Python) works, our own Gloo groups (make_gloo_communicator, torchrun's
// variables in init_from_env, split()) do not exist.
#include "shardopt/process_group.hpp"
#include "shardopt/process_group_splitter.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include "shardopt/config.hpp"
#if SHARDOPT_HAS_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <thread>

#include "comm/engines.hpp"
#include "shardopt/error.hpp"

namespace shardopt {
namespace {

#if SHARDOPT_HAS_GLOO
#if TORCH_VERSION_MAJOR >= 2
using GlooGroup = c10d::Backend;
#else
using GlooGroup = c10d::ProcessGroup;
#endif
#endif

// torch >= 2.4 defaults TCPStore to its libuv server, which Debian's torch 2.6 is built without
// ("use_libuv was requested but PyTorch was build without libuv support"); the classic server
// exists in every version. The option itself appeared in 2.2: set it where it exists.
template <class Options>
auto use_classic_tcp_store(Options& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <class Options>
void use_classic_tcp_store(Options&, long) {}

// Recent torch names ProcessGroup's flat collectives all_gather_single/reduce_scatter_single and
// deprecates _allgather_base/_reduce_scatter_base; Backend and older releases have only the latter.
template <class Group>
auto all_gather_flat(Group& g, at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o,
                     int) -> decltype(g.all_gather_single(out, in, o)) {
  return g.all_gather_single(out, in, o);
}
template <class Group>
auto all_gather_flat(Group& g, at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o,
                     long) {
  return g._allgather_base(out, in, o);
}
template <class Group>
auto reduce_scatter_flat(Group& g, at::Tensor& out, at::Tensor& in,
                         const c10d::ReduceScatterOptions& o, int)
    -> decltype(g.reduce_scatter_single(out, in, o)) {
  return g.reduce_scatter_single(out, in, o);
}
template <class Group>
auto reduce_scatter_flat(Group& g, at::Tensor& out, at::Tensor& in,
                         const c10d::ReduceScatterOptions& o, long) {
  return g._reduce_scatter_base(out, in, o);
}

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Avg: return c10d::ReduceOp::AVG;
  }
  return c10d::ReduceOp::SUM;
}

// c10's messages end in a C++ stack trace: users get the first line.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

class ProcessGroupWork final : public Work {
 public:
  ProcessGroupWork(std::string description, Duration timeout, c10::intrusive_ptr<c10d::Work> work,
                   std::function<void()> then = {})
      : Work(std::move(description), timeout), work_(std::move(work)), then_(std::move(then)) {}
  bool is_completed() override { return work_->isCompleted(); }
  bool wait_until_for(Duration timeout) { return wait_for(timeout); }

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
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
};

// Gloo (torch 1.13) rejects bfloat16. Same-width float16 carries the bits of pure copies.
at::Tensor transport_bits(const at::Tensor& t, bool gloo) {
  return gloo && t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t;
}

#if SHARDOPT_HAS_GLOO
CommunicatorPtr make_gloo(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                          Duration timeout, const std::string& where);
#endif

// Group: c10d::ProcessGroup, or c10d::Backend on torch >= 2 (Note [c10d across torch versions]).
template <class Group>
class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<Group> group, c10::intrusive_ptr<c10d::Store> store,
                           ProcessGroupSplitter splitter = {})
      : Communicator(group->getRank(), group->getSize()), group_(std::move(group)),
        store_(std::move(store)), splitter_(std::move(splitter)),
        name_(group_->getBackendName()) {}

  // Note [Process groups after a timeout]: a collective that timed out may still be blocked in
  // the group's worker thread, and the group's destructor joins it, which can take as long as the
  // group's own timeout (torch's default: 30 min; torchrun's groups: whatever the user gave at
  // creation), however short ZeroOptions::timeout is. Once a collective of this process timed out,
  // the group and its store are therefore left to the process's exit instead of destroyed, so
  // that the error ends the process promptly (and the launcher tears the job down).
  ~ProcessGroupCommunicator() override {
    {
      // A poster blocked on a header nobody will send is woken by aborting that receive.
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      stopping_ = true;
      for (auto& [peer, poster] : posters_) {
        if (!poster->waiting) continue;
        try {
          poster->waiting->abort();
        } catch (const std::exception&) {  // not abortable: the join waits for its timeout
        }
      }
    }
    for (auto& [peer, poster] : posters_) {
      poster->ready.notify_one();
      poster->thread.join();
    }
    if (!detail::collective_timed_out()) return;
    (void)group_.release();  // leaked on purpose: see above
    (void)store_.release();
  }

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
      return wrap(what, reduce_scatter_flat(*group_, o, i, opts, 0));
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
      return wrap(what, all_gather_flat(*group_, flat_out, i, opts, 0));
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

  // A c10d subgroup, as torch.distributed.new_group makes it: a fresh Gloo group of the members
  // over a PrefixStore of this group's store, unique per split call and color.
  CommunicatorPtr do_split(int color, int key) override {
    if (splitter_) {  // the group's maker makes its subgroups (process_group_splitter.hpp)
      c10::intrusive_ptr<c10d::ProcessGroup> sub = splitter_(color, key);
      if (color < 0) return nullptr;
      SHARDOPT_CHECK(sub, Communication,
                     "comm.split: the {} group's splitter returned no subgroup for color {}",
                     name_, color);
      CommunicatorPtr comm = make_process_group_communicator(std::move(sub));
      comm->set_timeout(timeout());
      return comm;
    }
#if !SHARDOPT_HAS_GLOO
    SHARDOPT_FAIL(Unsupported,
                  "comm.split: sub-groups of a {} process group need Gloo, which this build of "
                  "shardopt lacks (Note [c10d without Gloo])",
                  name_);
#else
    SHARDOPT_CHECK(store_, Unsupported,
                   "comm.split: this {} communicator was made from a ProcessGroup without its "
                   "store; pass the store to make_process_group_communicator(group, store)",
                   name_);
    SHARDOPT_CHECK(name_ == "gloo", Unsupported,
                   "comm.split: sub-groups of a '{}' process group are not supported, only gloo",
                   name_);
    at::Tensor mine = at::tensor({int64_t{color}, int64_t{key}}, at::kLong);
    at::Tensor all = at::empty({2 * size()}, at::kLong);
    all_gather(mine, all);
    const int64_t sequence = splits_++;
    if (color < 0) return nullptr;
    std::vector<std::pair<int64_t, int>> members;  // (key, rank here) of this color
    const auto* a = all.data_ptr<int64_t>();
    for (int r = 0; r < size(); ++r) {
      if (a[2 * r] == color) members.emplace_back(a[2 * r + 1], r);
    }
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), std::make_pair(int64_t{key}, rank()));
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        fmt::format("shardopt.split{}.color{}", sequence, color), store_);
    return make_gloo(prefixed, static_cast<int>(me - members.begin()),
                     static_cast<int>(members.size()), timeout(),
                     fmt::format("the parent group's store (split {}, color {})", sequence, color));
#endif
  }

  // Note [Point-to-point on process groups]: a Gloo receive must not be posted before the size
  // is known (a larger message aborts Gloo's device thread; a smaller one completes silently), so
  // each message is a 2 x int64 header {dtype, numel} (tag 0) then the payload (tag 1). Sends
  // post both at once. A receive posts its header; the peer's poster thread waits for the
  // oldest header, checks it and posts the payload into the tensor, or, on a mismatch, into
  // a scratch tensor of the announced size (so the sender completes and later messages stay in
  // step) and fails the receive with Error{Mismatch}. NCCL groups send the payload alone.
  WorkPtr do_batch_isend_irecv(const std::vector<P2pOp>& ops) override {
    std::vector<WorkPtr> parts;
    for (const auto& op : ops) {
      const std::string what = detail::describe_p2p(op, name_);
      std::vector<at::Tensor> payload{transport_bits(op.tensor, name_ == "gloo")};
      if (op.kind == P2pOp::Kind::Send) {
        if (headers()) {
          std::vector<at::Tensor> header{
              at::tensor({static_cast<int64_t>(op.tensor.scalar_type()), op.tensor.numel()},
                         at::kLong)};
          parts.push_back(wrap(what + " (header)", group_->send(header, op.peer, kHeaderTag)));
        }
        parts.push_back(wrap(what, group_->send(payload, op.peer, kPayloadTag)));
      } else if (!headers()) {
        parts.push_back(wrap(what, group_->recv(payload, op.peer, kPayloadTag)));
      } else {
        parts.push_back(post_header_recv(op));
      }
    }
    return make_work_group(fmt::format("batch_isend_irecv of {} messages on {}", ops.size(), name_),
                           std::move(parts), timeout());
  }

 private:
  static constexpr int kHeaderTag = 0;
  static constexpr int kPayloadTag = 1;
  bool headers() const { return name_ != "nccl"; }

  // A receive in flight: its header posted, its payload posted by the poster once checked.
  struct PendingRecv {
    P2pOp op;
    std::vector<at::Tensor> header;
    c10::intrusive_ptr<c10d::Work> header_work;
    std::shared_ptr<std::promise<c10::intrusive_ptr<c10d::Work>>> payload;
  };

  // Completes when the poster has posted the payload and that receive has completed.
  class HeaderedRecvWork final : public Work {
   public:
    HeaderedRecvWork(std::string description, Duration timeout,
                     std::shared_future<c10::intrusive_ptr<c10d::Work>> payload)
        : Work(std::move(description), timeout), payload_(std::move(payload)) {}
    bool is_completed() override {
      if (payload_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
      try {
        return payload_.get()->isCompleted();
      } catch (const Error&) {
        return true;  // failed (a Mismatch): wait() reports it
      }
    }

   protected:
    bool wait_for(Duration timeout) override {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      if (payload_.wait_for(timeout) != std::future_status::ready) return false;
      c10::intrusive_ptr<c10d::Work> work = payload_.get();  // rethrows a Mismatch
      const auto left = std::chrono::duration_cast<Duration>(deadline -
                                                             std::chrono::steady_clock::now());
      ProcessGroupWork inner(description(), timeout, work);
      return inner.wait_until_for(std::max(left, Duration(1)));
    }

   private:
    std::shared_future<c10::intrusive_ptr<c10d::Work>> payload_;
  };

  WorkPtr post_header_recv(const P2pOp& op) {
    PendingRecv pending{op, {at::empty({2}, at::kLong)}, {}, {}};
    pending.header_work = group_->recv(pending.header, op.peer, kHeaderTag);
    pending.payload = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Work>>>();
    auto future = pending.payload->get_future().share();
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      auto& poster = posters_[op.peer];
      if (!poster) {
        poster = std::make_unique<Poster>();
        Poster* raw = poster.get();
        raw->thread = std::thread([this, raw] { run_poster(*raw); });
      }
      poster->queue.push_back(std::move(pending));
      poster->ready.notify_one();
    }
    return std::make_shared<HeaderedRecvWork>(detail::describe_p2p(op, name_), timeout(),
                                              std::move(future));
  }

  // One poster thread per peer received from, so that a header awaited from one peer never
  // holds up another's (c10d's Gloo receives report completion only through a blocking wait,
  // and a wait that timed out leaves the receive failed: no polling).
  struct Poster {
    std::deque<PendingRecv> queue;  // oldest first
    c10::intrusive_ptr<c10d::Work> waiting;  // the header being waited for
    std::condition_variable ready;
    std::thread thread;
  };

  void run_poster(Poster& poster) {
    std::unique_lock<std::mutex> lock(p2p_mutex_);
    for (;;) {
      poster.ready.wait(lock, [&] { return stopping_ || !poster.queue.empty(); });
      if (stopping_) return;
      PendingRecv p = std::move(poster.queue.front());
      poster.queue.pop_front();
      poster.waiting = p.header_work;
      lock.unlock();
      post_payload(p);
      lock.lock();
      poster.waiting.reset();
    }
  }

  void post_payload(PendingRecv& p) {
    try {
      ProcessGroupWork header(detail::describe_p2p(p.op, name_) + " (header)", timeout(),
                              p.header_work);
      SHARDOPT_CHECK(header.wait_until_for(timeout()), Timeout,
                     "comm: {} did not complete within {} ms; the peer may have died, hung, or "
                     "not sent",
                     detail::describe_p2p(p.op, name_), timeout().count());
      const int64_t code = p.header[0][0].template item<int64_t>();
      const int64_t numel = p.header[0][1].template item<int64_t>();
      const bool known = code >= 0 && code < static_cast<int64_t>(at::ScalarType::NumOptions);
      const auto dtype = static_cast<at::ScalarType>(known ? code : 0);
      if (known && dtype == p.op.tensor.scalar_type() && numel == p.op.tensor.numel()) {
        std::vector<at::Tensor> payload{transport_bits(p.op.tensor, name_ == "gloo")};
        auto work = group_->recv(payload, p.op.peer, kPayloadTag);
        // Our references go before the caller learns of completion (the work keeps its own):
        // see Note [Freeing without the GIL] in python_bindings/shardopt_py.cpp.
        payload.clear();
        p.op.tensor.reset();
        p.payload->set_value(std::move(work));
        return;
      }
      SHARDOPT_CHECK(known && numel >= 0, Communication,
                     "comm: {} got a corrupt header (dtype code {}, {} elements)",
                     detail::describe_p2p(p.op, name_), code, numel);
      // Drained into scratch, kept alive until the process group is done with it.
      std::vector<at::Tensor> scratch{transport_bits(at::empty({numel}, dtype), true)};
      auto drain = group_->recv(scratch, p.op.peer, kPayloadTag);
      {
        std::lock_guard<std::mutex> lock(p2p_mutex_);
        drains_.push_back(std::move(drain));
      }
      detail::fail_p2p_mismatch(p.op, name_, fmt::format("{} x {}", numel, c10::toString(dtype)));
    } catch (...) {
      p.op.tensor.reset();
      p.payload->set_exception(std::current_exception());
    }
  }

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

  c10::intrusive_ptr<Group> group_;
  c10::intrusive_ptr<c10d::Store> store_;  // null when the caller gave none: no split()
  ProcessGroupSplitter splitter_;            // set: split() asks it (before the store)
  std::string name_;
  int64_t splits_ = 0;
  // Point-to-point receives (Note [Point-to-point on process groups]).
  std::mutex p2p_mutex_;
  std::map<int, std::unique_ptr<Poster>> posters_;  // by peer
  std::vector<c10::intrusive_ptr<c10d::Work>> drains_;  // guarded by p2p_mutex_
  bool stopping_ = false;
};

#if SHARDOPT_HAS_GLOO
// GLOO_SOCKET_IFNAME=eth0[,eth1] picks the interfaces, as torch.distributed does; otherwise
// Gloo binds to the address the hostname resolves to.
std::vector<std::shared_ptr<::gloo::transport::Device>> gloo_devices() {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  const char* names = std::getenv("GLOO_SOCKET_IFNAME");
  std::stringstream list(names ? names : "");
  for (std::string name; std::getline(list, name, ',');) {
    if (!name.empty()) devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  }
  if (devices.empty()) devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return devices;
}

CommunicatorPtr make_gloo(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                          Duration timeout, const std::string& where) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices = gloo_devices();
  c10::intrusive_ptr<GlooGroup> group;
  try {
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  } catch (const std::exception& e) {  // c10's message carries a C++ stack trace: first line only
    SHARDOPT_FAIL(Communication,
                  "comm.gloo: rank {} of {} could not connect to its peers through the store at "
                  "{} within {} ms: {}",
                  rank, size, where, timeout.count(), first_line(e.what()));
  }
  CommunicatorPtr comm =
      std::make_shared<ProcessGroupCommunicator<GlooGroup>>(std::move(group), store);
  comm->set_timeout(timeout);
  return comm;
}
#endif  // SHARDOPT_HAS_GLOO

}  // namespace

CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                c10::intrusive_ptr<c10d::Store> store) {
  SHARDOPT_CHECK(group, InvalidArgument, "comm: make_process_group_communicator got a null group");
  return std::make_shared<ProcessGroupCommunicator<c10d::ProcessGroup>>(std::move(group),
                                                                      std::move(store));
}

CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return make_process_group_communicator(std::move(group), c10::intrusive_ptr<c10d::Store>{});
}

CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                ProcessGroupSplitter splitter) {
  SHARDOPT_CHECK(group, InvalidArgument, "comm: make_process_group_communicator got a null group");
  return std::make_shared<ProcessGroupCommunicator<c10d::ProcessGroup>>(
      std::move(group), c10::intrusive_ptr<c10d::Store>{}, std::move(splitter));
}

#if SHARDOPT_HAS_GLOO
CommunicatorPtr make_gloo_communicator(const GlooOptions& options) {
  SHARDOPT_CHECK(options.size >= 1 && options.rank >= 0 && options.rank < options.size,
                 InvalidArgument, "comm.gloo: rank must lie in [0, size), got rank {} of size {}",
                 options.rank, options.size);
  const std::string& spec = options.store;
  if (spec.rfind("file:", 0) == 0) {
    auto store = c10::make_intrusive<c10d::FileStore>(spec.substr(5), options.size);
    return make_gloo(store, options.rank, options.size, options.timeout, spec);
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

namespace {
// Every rank checks in under its own key; rank 0 waits for all of them and names the ranks that
// never came (a rank that never started, or one pointed at another address).
void rendezvous(c10d::Store& store, int rank, int size, Duration timeout, const std::string& where) {
  const auto key = [](int r) { return fmt::format("shardopt/joined/{}", r); };
  store.set(key(rank), std::vector<uint8_t>{1});
  if (rank != 0) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int r = 1; r < size; ++r) {
      if (!store.check({key(r)})) missing.push_back(r);
    }
    if (missing.empty()) return;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  SHARDOPT_FAIL(Timeout,
                "comm.gloo: rendezvous at {} timed out after {} ms: rank{} {} of {} never joined "
                "(not started, crashed, or given another MASTER_ADDR/MASTER_PORT)",
                where, timeout.count(), missing.size() > 1 ? "s" : "", fmt::join(missing, ", "),
                size);
}
}  // namespace

namespace detail {
CommunicatorPtr make_gloo_tcp_communicator(int rank, int size, const std::string& host, int port,
                                           Duration timeout,
                                           const std::optional<std::string>& agent_prefix) {
  SHARDOPT_CHECK(port > 0 && port < 65536, InvalidArgument,
                 "comm.gloo: port must lie in (0, 65536), got {}", port);
  const bool agent = agent_prefix.has_value();
  const std::string where = fmt::format("{}:{}", host, port);
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = rank == 0 && !agent;
  opts.numWorkers = size;
  opts.waitWorkers = false;  // rank 0 waits below, to name the ranks that are missing
  opts.timeout = timeout;
  use_classic_tcp_store(opts, 0);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const std::exception& e) {  // c10's message carries a C++ stack trace: first line only
    SHARDOPT_CHECK(!opts.isServer, Communication,
                   "comm.gloo: rank 0 could not serve the rendezvous store at {} (within {} ms): "
                   "{}; is the port in use?",
                   where, timeout.count(), first_line(e.what()));
    SHARDOPT_FAIL(Communication,
                  "comm.gloo: rank {} could not reach the rendezvous store at {}, served by {}, "
                  "within {} ms: {}",
                  rank, where,
                  agent ? "torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True)" : "rank 0",
                  timeout.count(), first_line(e.what()));
  }
  // The agent's store outlives restarts: this attempt's keys go under their own prefix.
  if (agent) store = c10::make_intrusive<c10d::PrefixStore>(*agent_prefix, store);
  rendezvous(*store, rank, size, timeout, where);
  return make_gloo(store, rank, size, timeout, where);
}
}  // namespace detail
#endif  // SHARDOPT_HAS_GLOO

}  // namespace shardopt
