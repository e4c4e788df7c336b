// A model with buffers resumes bitwise: BatchNorm1d's running statistics and a registered buffer
// that the forward both reads and updates are saved (SaveOptions::module_state) and written back
// into the model by load_checkpoint (LoadOptions::module_state); the resumed run equals the
// uninterrupted one bitwise at the same N and stage, for stages 0-3. Buffers follow DDP's
// broadcast_buffers: rank 0's are copied to every rank before each forward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <map>
#include <string>

#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "support/dist_env.hpp"
#include "support/first_ranks.hpp"

namespace shardopt {
namespace {

constexpr int64_t kIn = 5, kHidden = 6, kGlobalBatch = 8, kSaveAt = 3, kEnd = 6;

// Linear -> BatchNorm1d -> Linear, with a buffer `scale` that the forward multiplies its input by
// and then moves towards the batch's mean magnitude: a loss that depends on every buffer.
struct BufferNetImpl : torch::nn::Module {
  BufferNetImpl() {
    at::manual_seed(99);
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, 1));
    scale = register_buffer("scale", at::ones({kIn}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = bn->forward(fc1->forward(x * scale));
    // The running statistics enter the loss too, not only the next evaluation.
    at::Tensor out = fc2->forward(at::tanh(h)) + 0.1 * bn->running_mean.sum();
    {
      at::NoGradGuard no_grad;
      scale.mul_(0.5).add_(x.abs().mean(0), 0.5);
    }
    return out;
  }
  torch::nn::Linear fc1{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Linear fc2{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(BufferNet);

ZeroOptions zero(int stage) {
  ZeroOptions zo;
  zo.stage = stage_from_int(stage);
  zo.bucket_bytes = 64;
  zo.timeout = std::chrono::seconds(60);
  return zo;
}

// Steps [from, to) on this rank's slice of each global batch, rank 0's buffers broadcast first.
void train(DistributedOptimizer& opt, BufferNet& net, int64_t from, int64_t to) {
  const auto comm = opt.communicator();
  const int64_t per_rank = kGlobalBatch / comm->size();
  for (int64_t s = from; s < to; ++s) {
    for (auto& b : net->named_buffers()) comm->broadcast(b.value(), 0);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(700 + s);
    const at::Tensor x = at::randn({kGlobalBatch, kIn}, gen) * (1.0 + 0.3 * s);
    const at::Tensor y = at::randn({kGlobalBatch, 1}, gen);
    opt.zero_grad();
    const at::Tensor mine = x.narrow(0, comm->rank() * per_rank, per_rank);
    opt.backward(at::mse_loss(net->forward(mine), y.narrow(0, comm->rank() * per_rank, per_rank)));
    opt.step();
  }
  opt.gather_full_parameters();  // stage 3: whole parameters for the comparison
}

std::map<std::string, at::Tensor> snapshot(BufferNet& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out["param/" + p.key()] = p.value().detach().clone();
  for (const auto& b : net->named_buffers()) out["buffer/" + b.key()] = b.value().clone();
  return out;
}

// The first name whose tensor differs in any bit, or "" when all are identical.
std::string first_difference(const std::map<std::string, at::Tensor>& a,
                             const std::map<std::string, at::Tensor>& b) {
  if (a.size() != b.size()) return "(a different set of names)";
  for (const auto& [name, t] : a) {
    if (!t.equal(b.at(name))) return name;
  }
  return "";
}

TEST(CheckpointModuleState, BuffersResumeBitwiseAtEveryStage) {
  const int n = std::min(2, test::world()->size());
  const std::string base = test::shared_dir("ckpt-buffers");
  bool ok = true;
  if (auto comm = test::first_ranks(n)) {
    for (int stage : {0, 1, 2, 3}) {
      const std::string dir = base + "/stage" + std::to_string(stage);
      BufferNet net;
      DistributedOptimizer opt(net->named_parameters(), AdamW(0.05), comm, zero(stage));
      train(opt, net, 0, kSaveAt);
      save_checkpoint(opt, dir, {},
                      module_save_options(net->named_parameters(), net->named_buffers()));
      train(opt, net, kSaveAt, kEnd);
      const auto uninterrupted = snapshot(net);

      BufferNet fresh;
      const auto untrained = snapshot(fresh);
      DistributedOptimizer resumed(fresh->named_parameters(), AdamW(0.05), comm, zero(stage));
      LoadOptions load;
      load.module_state =
          module_save_options(fresh->named_parameters(), fresh->named_buffers()).module_state;
      EXPECT_EQ(load.module_state.size(), 4u);  // bn's three buffers and `scale`
      load_checkpoint(resumed, dir, load);
      train(resumed, fresh, kSaveAt, kEnd);
      const std::string differs = first_difference(snapshot(fresh), uninterrupted);
      EXPECT_EQ(differs, "") << "N=" << n << " stage " << stage << ": not bitwise equal";
      // The buffers moved during training, so restoring them is what the comparison checks.
      EXPECT_FALSE(uninterrupted.at("buffer/bn.running_mean")
                       .equal(untrained.at("buffer/bn.running_mean")));
      ok = ok && differs.empty();
    }
  }
  EXPECT_TRUE(test::all_ranks(ok));
  test::world()->barrier();
  std::error_code ec;
  if (test::world()->rank() == 0) std::filesystem::remove_all(base, ec);
}

// A buffer the checkpoint does not store, or of another shape: Error{Mismatch} on every rank, and
// neither the model's buffers nor its parameters changed.
TEST(CheckpointModuleState, UnknownOrReshapedBufferFailsOnEveryRank) {
  const int n = std::min(2, test::world()->size());
  const std::string base = test::shared_dir("ckpt-buffers");
  bool ok = true;
  if (auto comm = test::first_ranks(n)) {
    const std::string dir = base + "/ckpt";
    BufferNet net;
    DistributedOptimizer opt(net->named_parameters(), AdamW(0.05), comm, zero(2));
    train(opt, net, 0, 2);
    save_checkpoint(opt, dir, {},
                    module_save_options(net->named_parameters(), net->named_buffers()));
    auto attempt = [&](std::map<std::string, at::Tensor> targets, const std::string& needle) {
      BufferNet fresh;
      const auto before = snapshot(fresh);
      DistributedOptimizer resumed(fresh->named_parameters(), AdamW(0.05), comm, zero(2));
      LoadOptions load;
      load.module_state = std::move(targets);
      bool right = false;
      try {
        load_checkpoint(resumed, dir, load);
      } catch (const Error& e) {
        right = e.kind() == ErrorKind::Mismatch &&
                std::string(e.what()).find(needle) != std::string::npos;
        EXPECT_TRUE(right) << e.what();
      }
      EXPECT_TRUE(right) << "expected a Mismatch naming " << needle;
      EXPECT_EQ(first_difference(snapshot(fresh), before), "");
      return right;
    };
    ok = attempt({{"mask", at::zeros({kIn})}}, "stores no module tensor 'mask'") && ok;
    ok = attempt({{"scale", at::zeros({kIn + 1})}}, "module tensor 'scale' is stored as float32 [5]") &&
         ok;
  }
  EXPECT_TRUE(test::all_ranks(ok));
  test::world()->barrier();
  std::error_code ec;
  if (test::world()->rank() == 0) std::filesystem::remove_all(base, ec);
}

}  // namespace
}  // namespace shardopt
