// A Communicator decorator that counts the elements each collective moves, to prove the
// communication volume of a step (reduce_scatter: its input; all_gather: its output; all_reduce:
// twice its length, as reduce-scatter + all-gather).
#pragma once

#include "shardopt/comm.hpp"

namespace shardopt::test {

class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(CommunicatorPtr inner)
      : Communicator(inner->rank(), inner->size()), inner_(std::move(inner)) {}
  std::string backend() const override { return "counting:" + inner_->backend(); }
  Capabilities capabilities() const override {
    Capabilities caps = inner_->capabilities();
    caps.native_avg = true;  // the inner engine emulates it if needed
    return caps;
  }
  int64_t elements = 0;
  int64_t calls = 0;

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op) override {
    count(2 * t.numel());
    return inner_->all_reduce(t, op, true);
  }
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) override {
    count(in.numel());
    return inner_->reduce_scatter(in, out, op, true);
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    count(out.numel());
    return inner_->all_gather(in, out, true);
  }
  WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    return inner_->broadcast(t, root, true);
  }
  void do_barrier() override { inner_->barrier(); }

 private:
  void count(int64_t n) {
    elements += n;
    ++calls;
  }
  CommunicatorPtr inner_;
};

}  // namespace shardopt::test
