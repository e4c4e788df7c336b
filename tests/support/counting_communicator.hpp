// A Communicator decorator that counts what each collective moves, to prove the communication
// volume of a step: elements (reduce_scatter: its input; all_gather: its output; all_reduce:
// twice its length, as reduce-scatter + all-gather) and the bytes this rank sends by link class.
// Bytes follow the direct model, which is what the MPI engine's pairwise reduce-scatter does: a
// reduce_scatter or all_gather of S elements per rank sends S to every other rank; an all_reduce
// of n sends 2 * ceil(n / size) to every other rank; a broadcast's root sends n to every other.
// A peer on this rank's host is an intra-host link, any other an inter-host link. Point-to-point
// sends count their bytes on the link to their peer (and in p2p_bytes), no elements. Communicators
// split from it count into the same Traffic.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::test {

struct Traffic {
  int64_t elements = 0;
  int64_t calls = 0;
  int64_t intra_host_bytes = 0;
  int64_t inter_host_bytes = 0;
  int64_t reduction_bytes = 0;  // of summing all_reduce and reduce_scatter (gradients), all links
  int64_t p2p_bytes = 0;        // of point-to-point sends, all links
  int64_t sent_bytes() const { return intra_host_bytes + inter_host_bytes; }
};

class CountingCommunicator final : public Communicator {
 public:
  // host_of[r]: an id of rank r's host, equal for ranks on one host; empty: all on one host.
  explicit CountingCommunicator(CommunicatorPtr inner, std::vector<int> host_of = {},
                                std::shared_ptr<Traffic> traffic = std::make_shared<Traffic>())
      : Communicator(inner->rank(), inner->size()), inner_(std::move(inner)),
        host_of_(std::move(host_of)), traffic_(std::move(traffic)) {
    if (host_of_.empty()) host_of_.assign(size(), 0);
    set_timeout(inner_->timeout());
  }
  // Hosts as the engine sees them (split_by_host). Collective.
  static std::shared_ptr<CountingCommunicator> by_host(CommunicatorPtr inner) {
    return std::make_shared<CountingCommunicator>(inner, host_ids(*inner));
  }
  // The host of each rank of `comm` as the id of the host's lowest rank. Collective.
  static std::vector<int> host_ids(Communicator& comm) {
    CommunicatorPtr local = comm.split_by_host();
    at::Tensor leader = at::full({1}, comm.rank(), at::kInt);
    local->broadcast(leader, 0);
    return gather_ints(comm, leader.item<int>());
  }

  std::string backend() const override { return "counting:" + inner_->backend(); }
  Capabilities capabilities() const override {
    Capabilities caps = inner_->capabilities();
    caps.native_avg = true;  // the inner engine emulates it if needed
    return caps;
  }
  const Traffic& traffic() const { return *traffic_; }
  int host_of(int rank) const { return host_of_.at(rank); }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op) override {
    const int64_t shard = (t.numel() + size() - 1) / size();
    // Max/Min reductions are flags (the engine's non-finite check), not gradients.
    count(2 * t.numel(), 2 * shard * t.element_size(), -1, op == ReduceOp::Sum || op == ReduceOp::Avg);
    return inner_->all_reduce(t, op, true);
  }
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) override {
    count(in.numel(), out.numel() * out.element_size(), -1, true);
    return inner_->reduce_scatter(in, out, op, true);
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    count(out.numel(), in.numel() * in.element_size(), -1);
    return inner_->all_gather(in, out, true);
  }
  WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    count(0, t.numel() * t.element_size(), root);
    return inner_->broadcast(t, root, true);
  }
  void do_barrier() override { inner_->barrier(); }
  WorkPtr do_batch_isend_irecv(const std::vector<P2pOp>& ops) override {
    for (const auto& op : ops) {
      if (op.kind != P2pOp::Kind::Send) continue;
      const int64_t bytes = op.tensor.numel() * op.tensor.element_size();
      (host_of_[op.peer] == host_of_[rank()] ? traffic_->intra_host_bytes
                                             : traffic_->inter_host_bytes) += bytes;
      traffic_->p2p_bytes += bytes;
    }
    return inner_->batch_isend_irecv(ops);
  }
  CommunicatorPtr do_split(int color, int key) override {
    return wrap(inner_->split(color, key));
  }
  CommunicatorPtr do_split_by_host() override { return wrap(inner_->split_by_host()); }

 private:
  static std::vector<int> gather_ints(Communicator& comm, int value) {
    at::Tensor mine = at::full({1}, value, at::kInt);
    at::Tensor all = at::empty({comm.size()}, at::kInt);
    comm.all_gather(mine, all);
    return std::vector<int>(all.data_ptr<int>(), all.data_ptr<int>() + comm.size());
  }
  // The sub-communicator's ranks keep their hosts; it counts into our Traffic.
  CommunicatorPtr wrap(CommunicatorPtr sub) {
    if (!sub) return nullptr;
    return std::make_shared<CountingCommunicator>(sub, gather_ints(*sub, host_of_[rank()]),
                                                  traffic_);
  }
  // `per_peer_bytes` go to every other rank; only `root` sends when root >= 0 (broadcast).
  void count(int64_t elements, int64_t per_peer_bytes, int root, bool reduction = false) {
    traffic_->elements += elements;
    if (root < 0) ++traffic_->calls;
    if (root >= 0 && root != rank()) return;
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) continue;
      (host_of_[p] == host_of_[rank()] ? traffic_->intra_host_bytes : traffic_->inter_host_bytes) +=
          per_peer_bytes;
      if (reduction) traffic_->reduction_bytes += per_peer_bytes;
    }
  }
  CommunicatorPtr inner_;
  std::vector<int> host_of_;
  std::shared_ptr<Traffic> traffic_;
};

// Engine::skip_non_finite all-reduces a one-element fp32 flag each step at the sharded stages
// with more than one rank: counted as 2 elements, and 2 * 4 bytes to every other rank.
inline int64_t nonfinite_flag_elements(int stage, int64_t ranks) {
  return stage >= 1 && ranks > 1 ? 2 : 0;
}
inline int64_t nonfinite_flag_peer_bytes(int stage, int64_t ranks) {
  return stage >= 1 && ranks > 1 ? 2 * 4 : 0;
}

}  // namespace shardopt::test
