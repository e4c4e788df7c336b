// The BERT example's benchmark helpers: the exact-size block cache, synthetic batches, the MLM
// variants (all positions vs masked only give the same loss and gradients), the loss over the
// labelled rows, the encoder without a mask when nothing is padded and the NSP-less model.
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "block_cache.hpp"
#include "data.hpp"
#include "model.hpp"
#include "shardopt/unit_policy.hpp"

namespace bert {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(BlockCache, ReusesAFreedBlockOfTheSameSize) {
  c10::Allocator* original = c10::GetAllocator(c10::DeviceType::CPU);
  {
    ScopedBlockCache cache(kMiB, 64 * kMiB);
    EXPECT_NE(c10::GetAllocator(c10::DeviceType::CPU), original);
    void* first = nullptr;
    {
      at::Tensor a = at::empty({kMiB}, at::kFloat);  // 4 MiB
      first = a.data_ptr();
    }
    EXPECT_EQ(cache.stats().cached_bytes, 4 * kMiB);
    at::Tensor b = at::empty({kMiB}, at::kFloat);
    EXPECT_EQ(b.data_ptr(), first);  // the same, already mapped block
    EXPECT_EQ(cache.stats().hits, 1);
    EXPECT_EQ(cache.stats().cached_bytes, 0);
    at::Tensor c = at::empty({kMiB + 1}, at::kFloat);  // another size: not served from the cache
    EXPECT_NE(c.data_ptr(), first);
    EXPECT_EQ(cache.stats().hits, 1);
    EXPECT_EQ(cache.stats().misses, 2);
    at::Tensor small = at::empty({100}, at::kFloat);  // under min_bytes: never cached
    small.reset();
    EXPECT_EQ(cache.stats().cached_bytes, 0);
  }
  EXPECT_EQ(c10::GetAllocator(c10::DeviceType::CPU), original);
}

TEST(BlockCache, KeepsAtMostItsCapacityDroppingTheOldestFirst) {
  ScopedBlockCache cache(kMiB, 10 * kMiB);
  std::vector<at::Tensor> blocks;
  for (int64_t mib : {4, 4, 4}) blocks.push_back(at::empty({mib * kMiB}, at::kByte));
  void* oldest = blocks[0].data_ptr();
  blocks.clear();  // frees 3 x 4 MiB: only two fit in 10 MiB, the first one freed is dropped
  EXPECT_EQ(cache.stats().cached_bytes, 8 * kMiB);
  EXPECT_EQ(cache.stats().peak_cached_bytes, 8 * kMiB);
  at::Tensor x = at::empty({4 * kMiB}, at::kByte);
  at::Tensor y = at::empty({4 * kMiB}, at::kByte);
  EXPECT_EQ(cache.stats().hits, 2);
  EXPECT_EQ(cache.stats().cached_bytes, 0);
  EXPECT_NE(x.data_ptr(), oldest);  // the dropped one is not among the cached blocks
  EXPECT_NE(y.data_ptr(), oldest);
  at::Tensor huge = at::empty({11 * kMiB}, at::kByte);  // larger than the cache: never kept
  huge.reset();
  EXPECT_EQ(cache.stats().cached_bytes, 0);
}

TEST(BlockCache, NearSizesShareAClassAndUnusedBlocksLeaveAfterAStep) {
  ScopedBlockCache cache(kMiB, 256 * kMiB);
  void* first = nullptr;
  {
    at::Tensor a = at::empty({19'000'000}, at::kByte);
    first = a.data_ptr();
  }
  {
    at::Tensor b = at::empty({19'100'000}, at::kByte);  // same class (16 MiB / 16 = 1 MiB granules)
    EXPECT_EQ(b.data_ptr(), first);
    EXPECT_EQ(cache.stats().hits, 1);
  }
  EXPECT_EQ(cache.stats().cached_bytes, 19 * kMiB);
  cache.next_step();  // freed during this step: may serve the next one
  EXPECT_EQ(cache.stats().cached_bytes, 19 * kMiB);
  cache.next_step();  // a whole step without reuse: dropped
  EXPECT_EQ(cache.stats().cached_bytes, 0);
  EXPECT_EQ(cache.stats().dropped_unused, 1);
  {
    at::Tensor c = at::empty({19'000'000}, at::kByte);  // reused every step: stays
  }
  for (int step = 0; step < 3; ++step) {
    cache.next_step();
    at::Tensor d = at::empty({19'000'000}, at::kByte);
  }
  EXPECT_EQ(cache.stats().cached_bytes, 19 * kMiB);
  EXPECT_EQ(cache.stats().hits, 4);
}

TEST(BlockCache, BlocksOutlivingTheCacheAreFreedNormally) {
  at::Tensor kept;
  {
    ScopedBlockCache cache(kMiB, 64 * kMiB);
    kept = at::ones({2 * kMiB}, at::kFloat);
  }
  EXPECT_FLOAT_EQ(kept.sum().item<float>(), 2.0f * kMiB);
  kept.reset();  // through the cache's deleter, which no longer caches: must not crash
  at::Tensor after = at::empty({2 * kMiB}, at::kFloat);
  EXPECT_EQ(after.numel(), 2 * kMiB);
}

TEST(SyntheticBatch, MasksAboutTheRequestedShareDeterministically) {
  const Batch b = synthetic_batch(8, 128, 30522, 0.15, 103, 7, 3, 1);
  ASSERT_EQ(b.input_ids.size(), 8u * 128u);
  EXPECT_EQ(b.num_tokens, 8 * 128);
  EXPECT_GT(b.num_masked, 100);  // 15% of 1024 = 154 expected
  EXPECT_LT(b.num_masked, 210);
  int64_t masked = 0;
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t k = 0; k < 128; ++k) {
      const int64_t label = b.masked_labels[i * 128 + k];
      if (label == -100) continue;
      ++masked;
      const int64_t pos = b.masked_positions[i * 128 + k];
      EXPECT_EQ(b.input_ids[i * 128 + pos], 103);
      EXPECT_GE(label, 0);
      EXPECT_LT(label, 30522);
    }
  }
  EXPECT_EQ(masked, b.num_masked);
  const Batch again = synthetic_batch(8, 128, 30522, 0.15, 103, 7, 3, 1);
  EXPECT_EQ(again.input_ids, b.input_ids);
  const Batch other_rank = synthetic_batch(8, 128, 30522, 0.15, 103, 7, 3, 0);
  EXPECT_NE(other_rank.input_ids, b.input_ids);
}

TEST(BertVariants, AllPositionsAndMaskedOnlyGiveTheSameLossAndGradients) {
  BertConfig c = BertConfig::preset("tiny");
  c.vocab_size = 500;
  c.nsp = false;
  c.hidden_dropout = c.attention_dropout = 0.0;
  const Batch batch = synthetic_batch(2, 16, c.vocab_size, 0.3, 103, 1, 0, 0);
  torch::manual_seed(0);
  BertForPreTraining masked(c);
  c.mlm_all_positions = true;
  torch::manual_seed(0);
  BertForPreTraining all(c);
  const auto out_masked = masked->forward(to_inputs(batch));
  const auto out_all = all->forward(to_inputs(batch));
  EXPECT_EQ(out_all.mlm_logits.size(0), 2 * 16);
  EXPECT_EQ(out_masked.mlm_logits.size(0), batch.num_masked);
  EXPECT_NEAR(out_all.loss.item<double>(), out_masked.loss.item<double>(), 1e-6);
  EXPECT_EQ(out_all.nsp_loss.item<double>(), 0.0);
  EXPECT_FALSE(out_all.nsp_logits.defined());
  out_masked.loss.backward();
  out_all.loss.backward();
  const auto pm = masked->named_parameters(), pa = all->named_parameters();
  ASSERT_EQ(pm.size(), pa.size());
  for (size_t i = 0; i < pm.size(); ++i) {
    EXPECT_LT((pm[i].value().grad() - pa[i].value().grad()).abs().max().item<double>(), 1e-6)
        << pm[i].key();
  }
}

// With logits at every position, the loss takes only the labelled rows (model.cpp): the same loss
// and the same gradient of the logits as cross_entropy over every row with ignore_index.
TEST(BertVariants, AllPositionsLossIsCrossEntropyOverEveryRow) {
  BertConfig c = BertConfig::preset("tiny");
  c.vocab_size = 500;
  c.nsp = false;
  c.mlm_all_positions = true;
  const Batch batch = synthetic_batch(2, 16, c.vocab_size, 0.3, 103, 1, 0, 0);
  torch::manual_seed(0);
  BertForPreTraining model(c);
  const auto out = model->forward(to_inputs(batch));
  ASSERT_GT(batch.num_masked, 0);
  ASSERT_LT(batch.num_masked, 2 * 16);  // some rows have no label
  const auto every_row = torch::nn::functional::cross_entropy(out.mlm_logits, out.mlm_labels);
  EXPECT_NEAR(out.mlm_loss.item<double>(), every_row.item<double>(), 1e-6);
  const auto g = torch::autograd::grad({out.mlm_loss}, {out.mlm_logits}, {}, true)[0];
  const auto g_every = torch::autograd::grad({every_row}, {out.mlm_logits})[0];
  EXPECT_LT((g - g_every).abs().max().item<double>(), 1e-7);
  const auto unlabelled = out.mlm_labels.eq(-100).nonzero().squeeze(1);
  EXPECT_EQ(g.index_select(0, unlabelled).abs().max().item<double>(), 0.0);
}

// Without padding the encoder adds no mask (model.cpp): the same output as with the zero mask.
TEST(BertVariants, UnpaddedBatchNeedsNoMask) {
  BertConfig c = BertConfig::preset("tiny");
  c.hidden_dropout = c.attention_dropout = 0.0;
  torch::manual_seed(0);
  BertLayer layer(c);
  const auto x = torch::randn({2, 16, c.hidden_size});
  const auto zero_mask = ((1.0 - torch::ones({2, 16})) * -10000.0).view({2, 1, 1, 16});
  EXPECT_TRUE(torch::equal(layer->forward(x, at::Tensor()), layer->forward(x, zero_mask)));
  auto padded = torch::zeros({2, 1, 1, 16});
  padded.index_put_({0, 0, 0, 15}, -10000.0);
  EXPECT_FALSE(torch::equal(layer->forward(x, at::Tensor()), layer->forward(x, padded)));
}

TEST(BertVariants, PeerPresetIsMiniWithoutNspAndWithAllPositions) {
  const BertConfig c = BertConfig::preset("peer");
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.intermediate_size, 1024);
  EXPECT_EQ(c.vocab_size, 30522);
  EXPECT_FALSE(c.nsp);
  EXPECT_TRUE(c.mlm_all_positions);
  BertForPreTraining model(c);
  // The peer's 11.2M: BERT-mini's count without the pooler (h^2 + h) and NSP head (2h + 2).
  EXPECT_EQ(model->num_parameters(), 11'201'594);
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.key().find("pooler"), std::string::npos);
    EXPECT_EQ(p.key().find("seq_relationship"), std::string::npos);
  }
}

// The default UnitPolicy on BERT's own names (bert_pretrain --units auto): one unit per encoder
// layer, the embeddings one unit, the pooler and the heads groups of their own (kept gathered
// through the step below 10^5 elements); the model built without Units has the same names.
shardopt::DerivedUnits derive_for(const BertConfig& c, int64_t persist_below) {
  BertForPreTraining with_units(c), without(c, /*declare_units=*/false);
  EXPECT_EQ(with_units->units()->size(), c.num_layers + (c.nsp ? 3 : 2));
  EXPECT_FALSE(without->units());
  std::vector<std::string> names;
  std::vector<int64_t> numels, ids;
  for (const auto& p : without->named_parameters()) {
    names.push_back(p.key());
    numels.push_back(p.value().numel());
    ids.push_back(static_cast<int64_t>(ids.size()));  // no tensor appears under two names
  }
  EXPECT_EQ(names.size(), with_units->named_parameters().size());
  shardopt::UnitPolicy policy;
  policy.persist_below = persist_below;
  return shardopt::derive_units(names, numels, ids, policy);
}

TEST(BertUnits, DefaultPolicyGroupsLayersEmbeddingsPoolerAndHeads) {
  using V = std::vector<std::string>;
  const BertConfig tiny = BertConfig::preset("tiny");  // with the pooler and the NSP head
  const auto all = derive_for(tiny, 0);
  EXPECT_EQ(all.names, (V{"bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
                          "bert.pooler", "cls"}));
  const auto tiny_default = derive_for(tiny, shardopt::UnitPolicy{}.persist_below);
  EXPECT_EQ(tiny_default.names, (V{"bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"}));
  EXPECT_EQ(tiny_default.persistent, (V{"bert.pooler", "cls"}));
  // The peer: no pooler, no NSP; the MLM head (transform h^2 + h, LayerNorm, 30522 biases) persists.
  const auto peer = derive_for(BertConfig::preset("peer"), shardopt::UnitPolicy{}.persist_below);
  EXPECT_EQ(peer.names, (V{"bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
                           "bert.encoder.layer.2", "bert.encoder.layer.3"}));
  EXPECT_EQ(peer.persistent, (V{"cls"}));
}

}  // namespace
}  // namespace bert
