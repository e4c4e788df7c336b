// The GPT-2-architecture decoder from shardopt's split layers: causal self-attention with a fused
// QKV projection, learned positions, pre-LN blocks, the LM head tied to the token embedding. One
// Stage is one pipeline stage's part of it (the whole model when there is one stage).
//
// Note [Tensor-parallel GPT]: Megatron's split, written once for every t (at t = 1 the split layers
// run over a group of one): c_attn (QKV, rows ordered head by head: q, k, v of head 0, then head
// 1, ...) and mlp.c_fc column-parallel, so a rank holds heads/t whole heads and 4h/t features;
// attn.c_proj and mlp.c_proj row-parallel; wte vocab-parallel over the bytes padded to
// tp::padded_vocab(256, t), whose padding rows start at zero and whose logits are masked out of
// the softmax; the head is wte's rows as a column-parallel product into
// vocab_parallel_cross_entropy. LayerNorms and wpe are replicated (marked so). The split layers
// record each parameter's split, which is all the optimizer and checkpoints need (Note [Split
// records] in shardopt/tensor_parallel.hpp): the model keeps no table of names.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "config.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace gpt {

// What every split layer of a rank is given: its tensor group and the dropout stream of its heads.
struct Parallel {
  shardopt::tp::TensorParallel tp;                // tp.group: ParallelGroups::tp (size 1: unsplit)
  std::shared_ptr<shardopt::tp::RngTracker> rng;  // this rank's stream inside split regions
  int size() const { return tp.group->size(); }
  int rank() const { return tp.group->rank(); }
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptConfig& c, Parallel par);
  at::Tensor forward(const at::Tensor& x);  // [B, T, h] -> [B, T, h]

 private:
  at::Tensor attention(const at::Tensor& x);
  Parallel par_;
  int64_t heads_, head_dim_;  // heads_: this rank's
  double dropout_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  shardopt::tp::ColumnParallelLinear c_attn_{nullptr}, c_fc_{nullptr};
  shardopt::tp::RowParallelLinear attn_proj_{nullptr}, mlp_proj_{nullptr};
};
TORCH_MODULE(Block);

// Layers [first, last) of the decoder; the first stage adds wte and wpe, the last ln_f and the
// head (its own copy of wte when it is not also the first). Parameter names are the whole model's
// ("wte.weight", "h.5.attn.c_attn.weight", "ln_f.bias"), so every layout names a tensor alike.
class StageImpl : public torch::nn::Module {
 public:
  StageImpl(const GptConfig& c, Parallel par, int64_t first, int64_t last, bool first_stage,
            bool last_stage);
  at::Tensor embed(const at::Tensor& ids);  // ids [B, T] int64 -> [B, T, h]
  at::Tensor layers(at::Tensor x);          // through this stage's blocks
  // The mean next-token cross entropy of hidden states x [B, T, h] against targets [B, T].
  at::Tensor loss(const at::Tensor& x, const at::Tensor& targets);
  // Note [Weights by name]: GPT-2's N(0, 0.02) (the residual projections' scaled by
  // 1/sqrt(2 x layers)), biases 0, LayerNorm weights 1, drawn from generators seeded by (seed,
  // name): a whole parameter from the generator of its name, a split one index by index along its
  // split dimension, index i from the generator of "name[i]". Any (t, p, V) thus starts from the
  // same model, each rank drawing only the stages and the slices it holds (the split layers are
  // built with init_unsplit = false: Note [Drawing only the slice]), and the two copies of wte
  // agree.
  void init_weights(uint64_t seed);
  bool first_stage() const { return first_stage_; }
  bool last_stage() const { return last_stage_; }
  int64_t first() const { return first_; }
  int64_t last() const { return last_; }

 private:
  GptConfig config_;
  Parallel par_;
  int64_t first_, last_;
  bool first_stage_, last_stage_;
  shardopt::tp::VocabParallelEmbedding wte_{nullptr};
  torch::nn::Embedding wpe_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
};
TORCH_MODULE(Stage);

}  // namespace gpt
