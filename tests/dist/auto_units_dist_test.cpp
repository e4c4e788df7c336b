// Stage 3 with automatic units (Note [Automatic units] in src/engine/auto_gather.cpp) on models
// nobody here wrote and nobody changed: torch's own nn.TransformerEncoder with a decoder tied to
// the embedding, scripted in Python (tests/python/make_scripted_lm.py, path in
// $SHARDOPT_SCRIPTED_LM) and torch::jit::load'ed, and libtorch's C++ TransformerEncoder as a plain
// nn::Module. No Units object, no units->run: after 8 steps every parameter is within 1e-6 of
// single-process torch on the global batch (AdamW, SGD with momentum), every rank holds the same
// bits, an evaluation forward under NoGradGuard matches, and the peak tracked CPU bytes during a
// step are below stage 2's by at least a quarter of (N-1)/N of the parameter bytes.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>

#include "shardopt/memory_tracker.hpp"
#include "shardopt/optimizer.hpp"
#include "support/dist_env.hpp"

namespace shardopt {
namespace {

constexpr int64_t kVocab = 23, kDim = 16, kHeads = 2, kFF = 32, kLayers = 12;  // as the script
constexpr int64_t kBatch = 12, kSeq = 5, kSteps = 8;

// A model as the tests see it: parameters by name as the module lists them, and its forward.
struct Model {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::function<at::Tensor(const at::Tensor&)> forward;  // tokens (B, S) -> logits (B, S, V)
};

Model scripted() {
  const char* path = std::getenv("SHARDOPT_SCRIPTED_LM");
  if (path == nullptr) throw std::runtime_error("SHARDOPT_SCRIPTED_LM is not set (CTest sets it)");
  torch::jit::Module module = torch::jit::load(path);
  module.train();
  Model m;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) m.named.emplace_back(p.name, p.value);
  m.forward = [module](const at::Tensor& x) mutable {
    return module.forward({x}).toTensor();
  };
  return m;
}

// libtorch's own modules, written as a user would (no shardopt in it).
struct NativeLMImpl : torch::nn::Module {
  NativeLMImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(kVocab, kDim));
    encoder = register_module(
        "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                       torch::nn::TransformerEncoderLayerOptions(kDim, kHeads)
                           .dim_feedforward(kFF)
                           .dropout(0.0),
                       kLayers)));
    decoder_bias = register_parameter("decoder_bias", torch::zeros({kVocab}));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = encoder(embedding(tokens).transpose(0, 1)).transpose(0, 1);
    return torch::nn::functional::linear(h, embedding->weight, decoder_bias);  // tied decoder
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::TransformerEncoder encoder{nullptr};
  at::Tensor decoder_bias;
};
TORCH_MODULE(NativeLM);

Model native() {
  torch::manual_seed(0);
  NativeLM module;
  Model m;
  for (const auto& p : module->named_parameters()) m.named.emplace_back(p.key(), p.value());
  m.forward = [module](const at::Tensor& x) mutable { return module->forward(x); };
  return m;
}

// The attention's in_proj_bias is frozen: its key third has a gradient of exactly zero in exact
// arithmetic (softmax ignores a constant per query), so what it gets is rounding noise, which
// depends on how the batch is split; Adam divides it by its own magnitude and turns it into
// lr-sized steps of either sign, whoever computes it. (Frozen parameters are left whole.)
Model make(const std::string& kind) {
  Model m = kind == "scripted" ? scripted() : native();
  for (auto& [name, t] : m.named) {
    if (name.size() >= 12 && name.compare(name.size() - 12, 12, "in_proj_bias") == 0) {
      t.set_requires_grad(false);
    }
  }
  return m;
}

std::pair<at::Tensor, at::Tensor> batch(int64_t s, int64_t m) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + s * 8 + m);
  return {at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong),
          at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong)};
}

at::Tensor loss_of(Model& m, const at::Tensor& x, const at::Tensor& y) {
  return at::cross_entropy_loss(m.forward(x).reshape({-1, kVocab}), y.reshape({-1}));
}

Rule rule_of(const std::string& name) {
  if (name == "adamw") return AdamW(1e-3).weight_decay(0.01);
  return SGD(0.05).momentum(0.9);
}

struct Trained {
  std::map<std::string, at::Tensor> params;
  at::Tensor eval;  // logits of an evaluation batch under NoGradGuard after training
  int64_t peak = 0;        // tracked CPU bytes during the last step, above what was live before
  int64_t param_bytes = 0;
  int64_t padded_numel = 0;
  std::vector<int64_t> comm_elements;  // per step
};

at::Tensor eval_tokens() { return batch(99, 0).first; }

std::map<std::string, at::Tensor> snapshot(const Model& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : m.named) out[name] = t.detach().clone();
  return out;
}

Trained train_reference(const std::string& kind, const std::string& rule, int accumulation) {
  Model m = make(kind);
  std::vector<at::Tensor> params;  // deduplicated: a tied weight once
  for (const auto& [name, t] : m.named) {
    bool seen = false;
    for (const auto& p : params) seen = seen || p.is_same(t);
    if (!seen) params.push_back(t);
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (rule == "adamw") {
    opt = std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  } else {
    opt = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  for (int64_t s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    for (int k = 0; k < accumulation; ++k) {
      auto [x, y] = batch(s, k);
      (loss_of(m, x, y) / accumulation).backward();
    }
    opt->step();
  }
  Trained run;
  {
    at::NoGradGuard no_grad;
    run.eval = m.forward(eval_tokens());
  }
  run.params = snapshot(m);
  return run;
}

Trained train_sharded(const std::string& kind, int stage, const std::string& rule, CommunicatorPtr comm,
                  int accumulation = 1, int reuse_distance = ZeroOptions{}.reuse_distance) {
  ScopedMemoryTracking tracking;  // before the model: every byte of the run is counted
  const int64_t base = tracking.tracker().live_bytes();  // what others hold (the last run's result)
  Model m = make(kind);
  std::vector<ParamGroup> groups(1);
  for (const auto& [name, t] : m.named) {
    groups[0].params.push_back({name, t});
  }
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);  // no zo.units: automatic at stage 3
  zo.unit_policy.persist_below = 0;   // every layer a unit, however small this model is
  zo.bucket_bytes = 4096;
  zo.grad_accumulation_steps = accumulation;
  zo.reuse_distance = reuse_distance;
  zo.timeout = std::chrono::seconds(60);
  DistributedOptimizer opt(groups, rule_of(rule), comm, zo);
  const int64_t per_rank = kBatch / comm->size();
  const int64_t begin = comm->rank() * per_rank;
  Trained run;
  for (int64_t s = 0; s < kSteps; ++s) {
    tracking.tracker().reset_peak();
    opt.zero_grad();
    for (int k = 0; k < accumulation; ++k) {
      auto [x, y] = batch(s, k);
      opt.backward(loss_of(m, x.narrow(0, begin, per_rank), y.narrow(0, begin, per_rank)));
    }
    opt.step();
    run.peak = tracking.tracker().peak_bytes() - base;
    run.comm_elements.push_back(opt.last_step().comm_elements);
  }
  {
    at::NoGradGuard no_grad;  // every rank: parameters are gathered on use
    run.eval = m.forward(eval_tokens());
  }
  run.param_bytes = 4 * opt.numel();
  run.padded_numel = opt.padded_numel();
  opt.gather_full_parameters();
  run.params = snapshot(m);
  return run;
}

double max_diff(const std::map<std::string, at::Tensor>& a,
                const std::map<std::string, at::Tensor>& b, std::string* worst) {
  double d = 0;
  for (const auto& [name, t] : a) {
    const double di = (t - b.at(name)).abs().max().item<double>();
    if (di > d) {
      d = di;
      *worst = name;
    }
  }
  return d;
}

// Every rank holds rank 0's bits.
bool same_bits_everywhere(const std::map<std::string, at::Tensor>& params, Communicator& comm) {
  std::vector<at::Tensor> flat;
  for (const auto& [name, t] : params) flat.push_back(t.reshape({-1}));
  at::Tensor mine = at::cat(flat);
  at::Tensor zeros = mine.clone();
  comm.broadcast(zeros, 0);
  return zeros.equal(mine);
}

struct Case {
  std::string kind, rule, backend = "mpi";
  int accumulation = 1;
  // TorchScript's graph optimizer (profiling, autodiff subgraphs): on in one case, as a trainer
  // runs by default; off in the others, where it costs ~10 s per run on a loaded 2-core machine.
  bool jit_optimize = false;
};

class AutoUnits : public ::testing::TestWithParam<Case> {};

TEST_P(AutoUnits, MatchesSingleProcessTorchWithNoUnitsDeclared) {
  const Case& c = GetParam();
  auto comm = test::communicator(c.backend);
  if (!comm) GTEST_SKIP() << test::not_built(c.backend);
  torch::jit::GraphOptimizerEnabledGuard optimize(c.jit_optimize);
  const Trained reference = train_reference(c.kind, c.rule, c.accumulation);
  const Trained run = train_sharded(c.kind, 3, c.rule, comm, c.accumulation);
  std::string worst;
  const double diff = max_diff(run.params, reference.params, &worst);
  EXPECT_LE(diff, 1e-6) << "worst parameter: " << worst;
  const double eval_diff = (run.eval - reference.eval).abs().max().item<double>();
  EXPECT_LE(eval_diff, 1e-5);
  std::string moved;
  EXPECT_GT(max_diff(run.params, snapshot(make(c.kind)), &moved), 1e-3);  // it trained
  EXPECT_TRUE(same_bits_everywhere(run.params, *comm));
  EXPECT_TRUE(test::all_ranks(diff <= 1e-6 && eval_diff <= 1e-5));
}

INSTANTIATE_TEST_SUITE_P(
    Models, AutoUnits,
    ::testing::Values(Case{"scripted", "adamw", "mpi", 1, true}, Case{"scripted", "sgd"}, Case{"native", "adamw"},
                      Case{"native", "sgd"}, Case{"scripted", "adamw", "gloo", 2},
                      Case{"native", "sgd", "gloo"}),
    [](const auto& info) {
      const Case& c = info.param;
      return c.kind + "_" + c.rule + "_" + c.backend +
             (c.accumulation > 1 ? "_accum" + std::to_string(c.accumulation) : "") +
             (c.jit_optimize ? "_jitopt" : "");
    });

// It never holds the whole model through a step: peak tracked bytes below stage 2's by at least
// a quarter of (N-1)/N of the parameter bytes.
TEST(AutoUnitsMemory, PeakBelowStage2) {
  auto comm = test::world();
  const int n = comm->size();
  torch::jit::GraphOptimizerEnabledGuard optimize(false);
  if (n == 1) GTEST_SKIP() << "one rank: nothing is sharded (stage 3 holds the shard plus a copy)";
  for (const char* kind : {"native", "scripted"}) {
    const Trained stage2 = train_sharded(kind, 2, "adamw", comm);
    const Trained stage3 = train_sharded(kind, 3, "adamw", comm);
    const int64_t margin = stage2.param_bytes * (n - 1) / n / 4;
    EXPECT_LE(stage3.peak, stage2.peak - margin)
        << kind << ": stage 3 peak " << stage3.peak << " B, stage 2 " << stage2.peak
        << " B, parameters " << stage2.param_bytes << " B";
    EXPECT_TRUE(test::all_ranks(stage3.peak <= stage2.peak - margin));
  }
}

// Note [Reuse distance]: the trace of the last pass decides what forward keeps gathered. On the
// native model (its decoder tied to the embedding), a distance beyond the trace keeps every part
// until backward has used it, so each part is all-gathered once per step: with the reduce-scatter,
// 2 * padded elements. Distance 2 frees the middle layers (their next use is in backward) and
// keeps, at the end of forward, only what backward reads first; 0 frees every part once another
// starts, so backward gathers all but the last again. The first step has no trace yet: the same fallback for every distance. The parameters do
// not depend on it.
TEST(AutoUnitsReuseDistance, TraceDecidesWhatStaysGathered) {
  auto comm = test::world();
  torch::jit::GraphOptimizerEnabledGuard optimize(false);
  const Trained none = train_sharded("native", 3, "adamw", comm, 1, 0);
  const Trained near = train_sharded("native", 3, "adamw", comm, 1, 2);
  const Trained all = train_sharded("native", 3, "adamw", comm, 1, 1 << 20);
  bool ok = true;
  for (const Trained* run : {&none, &near}) {
    std::string worst;
    EXPECT_EQ(max_diff(run->params, all.params, &worst), 0.0) << worst;
    EXPECT_EQ(run->comm_elements.front(), all.comm_elements.front());
    ok = ok && max_diff(run->params, all.params, &worst) == 0.0 &&
         run->comm_elements.front() == all.comm_elements.front();
  }
  const int64_t c0 = none.comm_elements.back(), c2 = near.comm_elements.back(),
                call = all.comm_elements.back();
  EXPECT_EQ(call, 2 * all.padded_numel);
  EXPECT_GT(c2, call);
  EXPECT_GT(c0, c2);
  EXPECT_LT(none.peak, all.peak);
  ok = ok && call == 2 * all.padded_numel && c2 > call && c0 > c2 && none.peak < all.peak;
  if (comm->rank() == 0) {
    std::printf("[reuse distance] last-step comm elements: 0 -> %lld, 2 -> %lld, all -> %lld "
                "(padded %lld); step peak bytes: 0 -> %lld, 2 -> %lld, all -> %lld\n",
                static_cast<long long>(c0), static_cast<long long>(c2),
                static_cast<long long>(call), static_cast<long long>(all.padded_numel),
                static_cast<long long>(none.peak), static_cast<long long>(near.peak),
                static_cast<long long>(all.peak));
  }
  EXPECT_TRUE(test::all_ranks(ok)) << "comm elements in the last step: distance 0 " << c0
                                   << ", 2 " << c2 << ", all " << call << "; padded "
                                   << all.padded_numel;
}

}  // namespace
}  // namespace shardopt
