// The names the documentation's C++ samples use, so that each sample compiles as written
// (docs/tools/samples.py puts every ```cpp block of README.md and docs/*.md in a function whose
// parameters are these). Nothing here runs: the samples are compiled and linked, never called.
#pragma once

#include <shardopt/shardopt.hpp>
#include <torch/script.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardopt_samples {

// A transformer-ish layer: forward(x, mask).
struct LayerImpl : torch::nn::Module {
  LayerImpl() : fc(register_module("fc", torch::nn::Linear(16, 16))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) { return fc->forward(x) * mask; }
  torch::nn::Linear fc;
};
TORCH_MODULE(Layer);

// A model with a forward(x), buffers, and the Units it declares for stage 3 (as the BERT example).
struct ModelImpl : torch::nn::Module {
  ModelImpl() : fc(register_module("fc", torch::nn::Linear(16, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  std::shared_ptr<shardopt::Units> units() const { return units_; }
  torch::nn::Linear fc;
  std::shared_ptr<shardopt::Units> units_ = std::make_shared<shardopt::Units>();
};
TORCH_MODULE(Model);

}  // namespace shardopt_samples

inline void write_summary() {}

// Parameters of every fragment: what a trainer around the sample would have in scope.
#define SHARDOPT_SAMPLE_PARAMETERS                                                               \
  shardopt_samples::Model &model, torch::jit::Module &scripted,                                   \
      std::vector<std::pair<at::Tensor, at::Tensor>> &batches, shardopt::CommunicatorPtr comm,    \
      shardopt::CommunicatorPtr world, shardopt::ZeroOptions zo, shardopt::DistributedOptimizer &opt, \
      std::vector<shardopt::ParamGroup> groups, at::Tensor x, at::Tensor mask, at::Tensor rng_state, \
      std::string dir, std::vector<std::shared_ptr<shardopt_samples::LayerImpl>> layers,                         \
      std::shared_ptr<shardopt_samples::LayerImpl> layer,                                         \
      std::shared_ptr<shardopt::Units> units, int i, int p, int m, int64_t batch, int64_t hidden,  \
      int64_t ffn, bool stage_is_last, std::function<at::Tensor(const at::Tensor&, int)> loss,     \
      std::function<at::Tensor(int)> micro_batch

#define SHARDOPT_SAMPLE_UNUSED                                                                    \
  (void)model, (void)scripted, (void)batches, (void)comm, (void)world, (void)zo, (void)opt,        \
      (void)groups, (void)x, (void)mask, (void)rng_state, (void)dir, (void)layers, (void)layer,    \
      (void)units, (void)i, (void)p, (void)m, (void)batch, (void)hidden, (void)ffn,                \
      (void)stage_is_last, (void)loss, (void)micro_batch
