// step() after gradients set by hand (no backward through the hooks: tests, gradient surgery, RL):
// the same update as torch's optimizer on the rank-averaged gradients at every stage, and the
// bucket pool within its bound (Note [Bucket pool bound] in shardopt/detail/plan.hpp): after such
// a step it holds exactly what it holds after a backward step.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <map>
#include <string>
#include <vector>

#include "shardopt/detail/plan.hpp"
#include "shardopt/optimizer.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

constexpr int64_t kWidth = 8, kRows = 4, kSteps = 6;
// 64 floats a bucket: the six parameters (216 elements) make three to five buckets at N = 1..4,
// two of the weights spanning two buckets each at some N.
constexpr int64_t kBucketBytes = 256;

// Three layers, parameters made from a fixed seed so every rank and the reference start equal.
struct Mlp {
  std::vector<std::pair<std::string, at::Tensor>> named;
  Mlp() {
    at::manual_seed(77);
    for (const char* layer : {"l1", "l2", "l3"}) {
      named.emplace_back(std::string(layer) + ".weight",
                         (at::randn({kWidth, kWidth}) * 0.3).set_requires_grad(true));
      named.emplace_back(std::string(layer) + ".bias",
                         (at::randn({kWidth}) * 0.1).set_requires_grad(true));
    }
  }
  std::vector<ParamGroup> groups() {
    ParamGroup g;
    for (auto& [name, t] : named) g.params.push_back({name, t});
    return {g};
  }
  at::Tensor loss(int64_t step, int rank) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + step * 16 + rank);
    at::Tensor h = at::randn({kRows, kWidth}, gen);
    for (size_t l = 0; l < named.size(); l += 2) {
      h = at::linear(h, named[l].second, named[l + 1].second);
      if (l + 2 < named.size()) h = at::tanh(h);
    }
    return (h - at::randn({kRows, kWidth}, gen)).pow(2).mean();
  }
};

// Rank `rank`'s hand-made gradient of parameter `p` in step `step`.
at::Tensor hand_gradient(int64_t step, int rank, size_t p, const at::Tensor& like) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9000 + step * 256 + rank * 16 +
                                                               static_cast<int64_t>(p));
  return at::randn(like.sizes(), gen);
}

AdamW rule() { return AdamW(0.02).weight_decay(0.05); }

ZeroOptions options(int stage, bool overlap = true) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = kBucketBytes;
  zo.overlap_comm = overlap;
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

// torch's AdamW in one process, each step on the mean of every rank's hand-made gradients.
std::map<std::string, at::Tensor> reference(int world) {
  Mlp net;
  std::vector<at::Tensor> params;
  for (auto& [name, t] : net.named) params.push_back(t);
  const AdamW a = rule();
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(a.lr())
                                      .betas({a.beta1(), a.beta2()})
                                      .eps(a.eps())
                                      .weight_decay(a.weight_decay()));
  for (int64_t s = 0; s < kSteps; ++s) {
    for (size_t p = 0; p < params.size(); ++p) {
      at::Tensor sum = at::zeros_like(params[p]);
      for (int r = 0; r < world; ++r) sum += hand_gradient(s, r, p, params[p]);
      params[p].mutable_grad() = sum / world;
    }
    opt.step();
  }
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : net.named) out[name] = t.detach().clone();
  return out;
}

// Sets this rank's hand-made gradients of step `step` (no backward).
void set_gradients(Mlp& net, int64_t step, int rank) {
  for (size_t p = 0; p < net.named.size(); ++p) {
    at::Tensor& t = net.named[p].second;
    t.mutable_grad() = hand_gradient(step, rank, p, t);
  }
}

TEST(HandSetGradients, StepMatchesTorchAtEveryStage) {
  auto comm = test::world();
  const auto expected = reference(comm->size());
  for (int stage : {0, 1, 2, 3}) {
    Mlp net;
    DistributedOptimizer opt(net.groups(), rule(), comm, options(stage));
    for (int64_t s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      set_gradients(net, s, comm->rank());
      opt.step();
    }
    opt.gather_full_parameters();
    double diff = 0;
    std::string worst;
    for (auto& [name, t] : net.named) {
      const double d = (t.detach() - expected.at(name)).abs().max().item<double>();
      if (d > diff) {
        diff = d;
        worst = name;
      }
    }
    EXPECT_LE(diff, 1e-6) << "stage " << stage << ", worst " << worst;
    EXPECT_TRUE(test::all_ranks(diff <= 1e-6)) << "stage " << stage;
  }
}

// The pool's bytes after `steps` steps of backward (hand = false) or hand-set gradients.
int64_t pool_after(int stage, bool hand, bool overlap, CommunicatorPtr comm) {
  Mlp net;
  DistributedOptimizer opt(net.groups(), rule(), comm, options(stage, overlap));
  for (int64_t s = 0; s < 3; ++s) {
    opt.zero_grad();
    if (hand) {
      set_gradients(net, s, comm->rank());
    } else {
      opt.backward(net.loss(s, comm->rank()));
    }
    opt.step();
  }
  return opt.memory().buffer_bytes;
}

// Before, a hand-set step filled every bucket before launching any, so the pool grew to one
// buffer per bucket (196,608 bytes against 131,072 after a backward step on a three-bucket model)
// and never shrank.
TEST(HandSetGradients, BucketPoolAsAfterBackward) {
  auto comm = test::world();
  const int64_t n = comm->size();
  // Buckets of 64 floats, rounded down to whole shards of 16 floats per rank (at least one).
  const int64_t bucket = std::max<int64_t>(16 * n, kBucketBytes / 4 / (16 * n) * (16 * n));
  const int64_t bound = detail::kBucketPoolBuffers * 4 * bucket;
  for (int stage : {0, 1, 2, 3}) {
    for (bool overlap : {true, false}) {
      const int64_t backward = pool_after(stage, false, overlap, comm);
      const int64_t hand = pool_after(stage, true, overlap, comm);
      EXPECT_EQ(hand, backward) << "stage " << stage << (overlap ? "" : ", no overlap");
      EXPECT_LE(backward, bound) << "stage " << stage << (overlap ? "" : ", no overlap");
      if (stage >= 2) {
        EXPECT_GT(hand, 0) << "stage " << stage;
      } else {
        EXPECT_EQ(hand, 0) << "stage " << stage;  // fp32 stages 0-1 reduce in place
      }
      EXPECT_TRUE(test::all_ranks(hand == backward && backward <= bound));
    }
  }
}

// A hand-set step after backward steps (and backward after it) leaves the pool as it was.
TEST(HandSetGradients, MixedStepsKeepThePool) {
  auto comm = test::world();
  for (int stage : {2, 3}) {
    Mlp net;
    DistributedOptimizer opt(net.groups(), rule(), comm, options(stage));
    opt.zero_grad();
    opt.backward(net.loss(0, comm->rank()));
    opt.step();
    const int64_t after_backward = opt.memory().buffer_bytes;
    for (int64_t s = 1; s < 4; ++s) {
      opt.zero_grad();
      if (s % 2 == 1) {
        set_gradients(net, s, comm->rank());
      } else {
        opt.backward(net.loss(s, comm->rank()));
      }
      opt.step();
      EXPECT_EQ(opt.memory().buffer_bytes, after_backward) << "stage " << stage << ", step " << s;
    }
    EXPECT_TRUE(test::all_ranks(opt.memory().buffer_bytes == after_backward));
  }
}

// zero_grad() discards a backward's gradients (Note [step() consumes the gradients]): a backward
// whose reductions may still be in flight, then zero_grad(), then the real backward and step(),
// ends where the real backward and step() alone do, at every stage.
TEST(ZeroGrad, DiscardsABackwardInFlight) {
  auto comm = test::world();
  for (int stage : {0, 1, 2, 3}) {
    Mlp discarding, plain;
    DistributedOptimizer a(discarding.groups(), rule(), comm, options(stage));
    DistributedOptimizer b(plain.groups(), rule(), comm, options(stage));
    for (int64_t s = 0; s < 3; ++s) {
      a.zero_grad();
      a.backward(discarding.loss(100 + s, comm->rank()));
      a.zero_grad();
      a.backward(discarding.loss(s, comm->rank()));
      a.step();
      b.zero_grad();
      b.backward(plain.loss(s, comm->rank()));
      b.step();
    }
    a.gather_full_parameters();
    b.gather_full_parameters();
    double diff = 0;
    for (size_t p = 0; p < plain.named.size(); ++p) {
      diff = std::max(diff, (discarding.named[p].second.detach() - plain.named[p].second.detach())
                                .abs().max().item<double>());
    }
    EXPECT_LE(diff, 1e-6) << "stage " << stage;
    EXPECT_TRUE(test::all_ranks(diff <= 1e-6)) << "stage " << stage;
  }
}

}  // namespace
}  // namespace shardopt
