// The memory estimator (shardopt/estimate.hpp, Accounting::Engine) against the live optimizer's
// memory() for every stage x {fp32, bf16} x {no offload, CPU offload}: parameters, gradients and
// optimizer state exactly, buffers within the estimate's bound.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "shardopt/estimate.hpp"
#include "shardopt/shardopt.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

// Two layers, every parameter used; one unit each for stage 3.
struct SmallNet {
  torch::OrderedDict<std::string, at::Tensor> named;
  UnitsPtr units = std::make_shared<Units>();
  bool upcast = false;  // mixed precision: parameters in bf16, compute in fp32 on the CPU

  SmallNet() {
    at::manual_seed(7);
    add("fc1.weight", at::randn({8, 24}) * 0.3);
    add("fc1.bias", at::randn({24}) * 0.1);
    add("fc2.weight", at::randn({24, 5}) * 0.3);
    add("fc2.bias", at::randn({5}) * 0.1);
    units->add("fc1", {named["fc1.weight"], named["fc1.bias"]});
    units->add("fc2", {named["fc2.weight"], named["fc2.bias"]});
  }
  void add(const std::string& name, const at::Tensor& t) {
    named.insert(name, t.contiguous().set_requires_grad(true));
  }
  at::Tensor p(const char* name) { return upcast ? named[name].to(at::kFloat) : named[name]; }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = units->run(0, [&] { return at::tanh(at::matmul(x, p("fc1.weight")) + p("fc1.bias")); });
    h = units->run(1, [&] { return at::matmul(h, p("fc2.weight")) + p("fc2.bias"); });
    return at::mse_loss(h, y);
  }
};

TEST(StageMemory, EstimateMatchesLiveMemory) {
  auto comm = test::world();
  const int n = comm->size();
  for (int stage = 0; stage <= 3; ++stage) {
    for (Precision precision : {Precision::FP32, Precision::BF16}) {
      for (Offload offload : {Offload::None, Offload::CPU}) {
        SmallNet net;
        net.upcast = precision != Precision::FP32;
        ZeroOptions zo;
        zo.stage = stage_from_int(stage);
        zo.precision = precision;
        zo.offload = offload;
        // One bucket per unit (stage 3) or for the whole model: the pool's bound (Note [Bucket
        // pool bound]) holds whatever order the gradients arrive in.
        zo.bucket_bytes = 4096;
        zo.units = net.units;
        zo.timeout = std::chrono::seconds(60);
        DistributedOptimizer opt(net.named, AdamW(1e-3), comm, zo);
        at::manual_seed(11);
        for (int s = 0; s < 2; ++s) {
          opt.zero_grad();
          opt.backward(net.loss(at::randn({4, 8}), at::randn({4, 5})));
          opt.step();
        }
        const MemoryReport m = opt.memory();

        estimate::Options o;
        o.params = opt.padded_numel();  // the layout's padding, per bucket
        o.world = n;
        o.stage = stage;
        o.precision = precision;
        o.offload = offload;
        o.params_on_host = true;  // a CPU run
        o.bucket_bytes = zo.bucket_bytes;
        o.align_bytes = zo.align_bytes;
        const estimate::Estimate e = estimate::model_states(o);
        const auto where = ::testing::Message() << "stage " << stage << ", " << to_string(precision)
                                                << ", offload " << detail::offload_name(offload)
                                                << ", N = " << n;
        EXPECT_EQ(e.padded_params, opt.padded_numel()) << where;
        EXPECT_EQ(m.param_bytes, e.device.params + e.host.params) << where;
        EXPECT_EQ(m.grad_bytes, e.device.grads + e.host.grads) << where;
        EXPECT_EQ(m.optimizer_state_bytes, e.device.optimizer_state + e.host.optimizer_state)
            << where;
        // Documented difference: buffers are a bound (the bucket pool's; at stage 3 also the
        // units gathered at a time, none after a step).
        EXPECT_LE(m.buffer_bytes, e.device.buffers + e.host.buffers) << where;
      }
    }
  }
}

// Note [Deferred reduction]: each bucket keeps a buffer of its own size, Ψ elements in all,
// which the estimate counts instead of the pool's two buckets.
TEST(StageMemory, EstimateCountsDeferredBuckets) {
  auto comm = test::world();
  for (int stage : {2, 3}) {
    SmallNet net;
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    zo.bucket_bytes = 4096;
    zo.units = net.units;
    zo.grad_accumulation_steps = 2;
    zo.defer_reduction = true;
    zo.timeout = std::chrono::seconds(60);
    DistributedOptimizer opt(net.named, AdamW(1e-3), comm, zo);
    at::manual_seed(11);
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      for (int m = 0; m < 2; ++m) opt.backward(net.loss(at::randn({4, 8}), at::randn({4, 5})));
      opt.step();
    }
    estimate::Options o;
    o.params = opt.padded_numel();
    o.world = comm->size();
    o.stage = stage;
    o.params_on_host = true;
    o.bucket_bytes = zo.bucket_bytes;
    o.defer_reduction = true;
    const estimate::Estimate e = estimate::model_states(o);
    const int64_t buckets = 4 * opt.padded_numel();  // fp32
    EXPECT_EQ(e.device.buffers - (stage == 3 ? 2 * 4 * e.gathered_units_params : 0), buckets);
    // Stage 3 gathers no unit between steps: the buckets are all its buffers then.
    EXPECT_EQ(opt.memory().buffer_bytes, buckets) << "stage " << stage;
  }
}

}  // namespace
}  // namespace shardopt
