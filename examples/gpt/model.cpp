// The decoder (Note [Tensor-parallel GPT] and Note [Weights by name] in model.hpp).
#include "model.hpp"

#include "shardopt/pipeline_runner.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/linear.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

namespace gpt {
namespace tp = shardopt::tp;

namespace {

torch::nn::LayerNorm layer_norm(torch::nn::Module& parent, const char* name, int64_t h,
                                const Parallel& par) {
  auto ln = parent.register_module(name, torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
  tp::mark_replicated(ln->weight, par.tp.group);  // said, not assumed: every tensor rank holds it
  tp::mark_replicated(ln->bias, par.tp.group);
  return ln;
}

// FNV-1a of a parameter's name, to seed its generator (Note [Weights by name]).
uint64_t hash_name(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// Dropout that draws nothing at p = 0 (the layouts then compare exactly).
at::Tensor drop(const at::Tensor& x, double p, bool train) {
  return p > 0 && train ? at::dropout(x, p, /*train=*/true) : x;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

BlockImpl::BlockImpl(const GptConfig& c, Parallel par)
    : par_(std::move(par)),
      heads_(c.heads / par_.size()),
      head_dim_(c.head_dim()),
      dropout_(c.dropout) {
  const int64_t h = c.hidden;
  ln_1_ = layer_norm(*this, "ln_1", h, par_);
  auto attn = register_module("attn", std::make_shared<torch::nn::Module>());
  c_attn_ = attn->register_module("c_attn", tp::ColumnParallelLinear(h, 3 * h, par_.tp));
  attn_proj_ = attn->register_module("c_proj", tp::RowParallelLinear(h, h, par_.tp));
  ln_2_ = layer_norm(*this, "ln_2", h, par_);
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  c_fc_ = mlp->register_module("c_fc", tp::ColumnParallelLinear(h, 4 * h, par_.tp));
  mlp_proj_ = mlp->register_module("c_proj", tp::RowParallelLinear(4 * h, h, par_.tp));
}

at::Tensor BlockImpl::attention(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1);
  // This rank's heads, each [q | k | v] (Note [Tensor-parallel GPT]): [3, B, heads, T, d].
  const at::Tensor qkv = c_attn_(x).view({b, t, heads_, 3, head_dim_}).permute({3, 0, 2, 1, 4});
  const at::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  at::Tensor scores =
      at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  const at::Tensor future = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
  at::Tensor probs =
      scores.masked_fill(future, -std::numeric_limits<double>::infinity()).softmax(-1);
  if (dropout_ > 0 && is_training()) {  // inside the split region: this rank's own stream
    const auto fork = par_.rng->fork();
    probs = at::dropout(probs, dropout_, /*train=*/true);
  }
  const at::Tensor y = at::matmul(probs, v).transpose(1, 2).reshape({b, t, heads_ * head_dim_});
  return attn_proj_(y);
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const bool train = is_training();
  const at::Tensor h = x + drop(attention(ln_1_(x)), dropout_, train);
  const at::Tensor m = mlp_proj_(at::gelu(c_fc_(ln_2_(h)), "tanh"));
  return h + drop(m, dropout_, train);
}

StageImpl::StageImpl(const GptConfig& c, Parallel par, int64_t first, int64_t last,
                     bool first_stage, bool last_stage)
    : config_(c),
      par_(std::move(par)),
      first_(first),
      last_(last),
      first_stage_(first_stage),
      last_stage_(last_stage) {
  if (first_stage_ || last_stage_) {
    const int64_t padded = tp::padded_vocab(c.vocab, par_.size());
    wte_ = register_module("wte", tp::VocabParallelEmbedding(padded, c.hidden, par_.tp));
    tp::mark_split(wte_->weight, par_.tp.group, 0, c.vocab, padded);  // the real rows
    // The lookup's and the head's weight: under a pipeline the first and the last stage each hold
    // a copy, which the optimizer keeps equal by summing their gradients.
    shardopt::mark_pipeline_shared(wte_->weight);
  }
  if (first_stage_) {
    wpe_ = register_module("wpe", torch::nn::Embedding(c.n_ctx, c.hidden));
    tp::mark_replicated(wpe_->weight, par_.tp.group);
  }
  auto h = register_module("h", std::make_shared<torch::nn::Module>());
  for (int64_t i = first_; i < last_; ++i) {
    blocks_.push_back(h->register_module(std::to_string(i), Block(c, par_)));
  }
  if (last_stage_) ln_f_ = layer_norm(*this, "ln_f", c.hidden, par_);
}

at::Tensor StageImpl::embed(const at::Tensor& ids) {
  const at::Tensor positions = at::arange(ids.size(1), ids.options());
  return drop(wte_(ids) + wpe_(positions), config_.dropout, is_training());
}

at::Tensor StageImpl::layers(at::Tensor x) {
  for (auto& block : blocks_) x = block(x);
  return x;
}

at::Tensor StageImpl::loss(const at::Tensor& x, const at::Tensor& targets) {
  // The head's input enters the split region (its gradient is summed over the tensor group).
  // [B, T, padded / t]
  at::Tensor logits = at::linear(tp::copy_to_region(ln_f_(x), par_.tp.group), wte_->weight);
  const int64_t columns = logits.size(-1);
  const int64_t real = std::clamp<int64_t>(config_.vocab - wte_->vocab_begin(), 0, columns);
  if (real < columns) {  // the padding rows never enter the softmax
    const at::Tensor padding = at::arange(columns, targets.options()) >= real;
    logits = logits.masked_fill(padding, -std::numeric_limits<double>::infinity());
  }
  return tp::vocab_parallel_cross_entropy(logits, targets, par_.tp.group).mean();
}

void StageImpl::init_weights(uint64_t seed) {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  for (auto& p : named_parameters()) {
    const std::string& name = p.key();
    at::Tensor& param = p.value();
    const bool is_bias = ends_with(name, ".bias");
    const bool is_norm = name.rfind("ln_", 0) == 0 || name.find(".ln_") != std::string::npos;
    const double std = ends_with(name, "c_proj.weight") ? residual_std : 0.02;
    // Fills `slot` from its own generator: in place, so nothing but the parameter is allocated.
    auto fill = [&](at::Tensor slot, const std::string& key) {
      if (is_bias) {
        slot.zero_();
      } else if (is_norm) {
        slot.fill_(1.0);
      } else {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ hash_name(key));
        if (slot.is_contiguous() && slot.scalar_type() == at::kFloat) {
          slot.normal_(0.0, std, gen);
        } else {  // a column of a row-parallel weight: drawn contiguous, as every t draws it
          slot.copy_(at::empty(slot.sizes(), at::kFloat).normal_(0.0, std, gen));
        }
      }
    };
    const auto split = tp::split_of(param);
    if (!split) {
      fill(param, name);
      continue;
    }
    // Index i of the split dimension from the generator of "name[i]": a rank draws only the
    // indices it holds, and every t the same values (Note [Weights by name]).
    const int64_t local = param.size(split->dim);
    for (int64_t j = 0; j < local; ++j) {
      const int64_t i = par_.rank() * local + j;
      at::Tensor slot = param.select(split->dim, j);
      if (i >= split->full_size) {
        slot.zero_();  // padding rows start at zero
      } else {
        fill(slot, fmt::format("{}[{}]", name, i));
      }
    }
  }
}

}  // namespace gpt
