// The BERT example's unit tests: pretraining data, model (shapes, tied decoder, size);
// and BertTrainer.*, which runs the trainer under mpirun (its own CTest entry, bert_resume_np2).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "corpus.hpp"
#include "data.hpp"
#include "model.hpp"
#include "shardopt/checkpoint.hpp"
#include "test_paths.hpp"
#include "tokenizer.hpp"

namespace bert {
namespace {

using Strings = std::vector<std::string>;

// ---- pretraining data -------------------------------------------------------------------------

// Words w0..w299 plus continuation pieces ##p0..##p49.
Vocab synthetic_vocab() {
  std::vector<std::string> t = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  for (int i = 0; i < 300; ++i) t.push_back("w" + std::to_string(i));
  for (int i = 0; i < 50; ++i) t.push_back("##p" + std::to_string(i));
  return Vocab(t);
}

std::vector<Document> synthetic_documents(const Vocab& vocab, int count, uint64_t seed) {
  Rng rng(seed);
  std::vector<Document> docs;
  for (int d = 0; d < count; ++d) {
    Document doc;
    const int64_t sentences = rng.randint(3, 30);
    for (int64_t s = 0; s < sentences; ++s) {
      std::vector<int32_t> ids;
      const int64_t words = rng.randint(4, 18);
      for (int64_t w = 0; w < words; ++w) {
        ids.push_back(static_cast<int32_t>(5 + rng.randint(0, 299)));
        if (rng.uniform() < 0.3) ids.push_back(static_cast<int32_t>(305 + rng.randint(0, 49)));
      }
      doc.push_back(ids);
    }
    docs.push_back(doc);
  }
  (void)vocab;
  return docs;
}

bool same(const Instance& a, const Instance& b) {
  return a.input_ids == b.input_ids && a.segment_a_length == b.segment_a_length &&
         a.masked_positions == b.masked_positions && a.masked_labels == b.masked_labels &&
         a.is_random_next == b.is_random_next;
}

TEST(PretrainingData, InstanceInvariants) {
  const Vocab vocab = synthetic_vocab();
  const auto docs = synthetic_documents(vocab, 60, 7);
  PretrainOptions opt;
  opt.max_seq_length = 128;
  opt.max_predictions_per_seq = 40;  // large enough not to cap the 15%
  opt.dupe_factor = 10;
  const auto instances = create_instances(docs, vocab, opt);
  ASSERT_GT(instances.size(), 1000u);

  int64_t tokens = 0, masked = 0, as_mask = 0, kept = 0, random = 0, random_next = 0, full = 0;
  for (const auto& inst : instances) {
    const auto& ids = inst.input_ids;
    ASSERT_LE(ids.size(), 128u);
    ASSERT_GE(ids.size(), 5u);
    full += ids.size() >= 120;
    EXPECT_EQ(ids.front(), vocab.cls_id());
    EXPECT_EQ(ids.back(), vocab.sep_id());
    EXPECT_EQ(ids[inst.segment_a_length - 1], vocab.sep_id());
    EXPECT_GE(inst.segment_a_length, 3);                           // [CLS] a [SEP]
    EXPECT_LE(inst.segment_a_length, static_cast<int32_t>(ids.size()) - 2);  // b non-empty
    int seps = 0;
    for (int32_t t : ids) seps += t == vocab.sep_id();
    EXPECT_EQ(seps, 2);
    ASSERT_EQ(inst.masked_positions.size(), inst.masked_labels.size());
    ASSERT_GE(inst.masked_positions.size(), 1u);
    for (size_t k = 0; k < inst.masked_positions.size(); ++k) {
      const int32_t pos = inst.masked_positions[k];
      if (k > 0) EXPECT_LT(inst.masked_positions[k - 1], pos);
      // Special tokens are never masked.
      EXPECT_NE(pos, 0);
      EXPECT_NE(pos, inst.segment_a_length - 1);
      EXPECT_NE(pos, static_cast<int32_t>(ids.size()) - 1);
      EXPECT_FALSE(vocab.is_special(inst.masked_labels[k]));
      const int32_t now = ids[pos];
      if (now == vocab.mask_id()) ++as_mask;
      else if (now == inst.masked_labels[k]) ++kept;
      else ++random;
      EXPECT_FALSE(now != vocab.mask_id() && vocab.is_special(now));
    }
    tokens += static_cast<int64_t>(ids.size());
    masked += static_cast<int64_t>(inst.masked_positions.size());
    random_next += inst.is_random_next;
  }
  const double n = static_cast<double>(instances.size());
  EXPECT_NEAR(static_cast<double>(masked) / tokens, 0.15, 0.005);
  EXPECT_NEAR(static_cast<double>(as_mask) / masked, 0.80, 0.02);
  // "kept" also counts random draws that hit the same token (1/350 of them).
  EXPECT_NEAR(static_cast<double>(kept) / masked, 0.10, 0.015);
  EXPECT_NEAR(static_cast<double>(random) / masked, 0.10, 0.015);
  // As in Google's generator, a chunk of one sentence (document ends) always gets a random next
  // sentence, so the share is a little above one half on these short documents.
  EXPECT_NEAR(random_next / n, 0.53, 0.05);
  EXPECT_GT(full / n, 0.3);  // most chunks fill the sequence
}

TEST(PretrainingData, MaxPredictionsCapsMasks) {
  const Vocab vocab = synthetic_vocab();
  PretrainOptions opt;
  opt.max_seq_length = 64;
  opt.max_predictions_per_seq = 3;
  opt.dupe_factor = 2;
  for (const auto& inst : create_instances(synthetic_documents(vocab, 20, 3), vocab, opt)) {
    EXPECT_LE(inst.masked_positions.size(), 3u);
    EXPECT_LE(inst.input_ids.size(), 64u);
  }
}

TEST(PretrainingData, DeterministicForASeed) {
  const Vocab vocab = synthetic_vocab();
  const auto docs = synthetic_documents(vocab, 20, 11);
  PretrainOptions opt;
  opt.dupe_factor = 2;
  const auto a = create_instances(docs, vocab, opt);
  const auto b = create_instances(docs, vocab, opt);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(same(a[i], b[i])) << i;
  opt.seed += 1;
  const auto c = create_instances(docs, vocab, opt);
  size_t differ = 0;
  for (size_t i = 0; i < std::min(a.size(), c.size()); ++i) differ += !same(a[i], c[i]);
  EXPECT_GT(differ, a.size() / 2);
  // The generator is pinned: mt19937_64's 10000th output is fixed by the standard.
  Rng rng(5489u);
  uint64_t x = 0;
  for (int i = 0; i < 10000; ++i) x = rng.next();
  EXPECT_EQ(x, 9981545732273789042ull);
}

TEST(PretrainingData, WholeWordMasking) {
  const Vocab vocab = synthetic_vocab();
  PretrainOptions opt;
  opt.whole_word_mask = true;
  opt.dupe_factor = 3;
  int64_t pieces = 0;
  for (const auto& inst : create_instances(synthetic_documents(vocab, 30, 5), vocab, opt)) {
    std::set<int32_t> pos(inst.masked_positions.begin(), inst.masked_positions.end());
    for (size_t k = 0; k < inst.masked_positions.size(); ++k) {
      const int32_t p = inst.masked_positions[k];
      // As in Google's code, a piece right after [SEP] joins the previous word (truncation can
      // cut a word's start off); anywhere else the piece before it is masked too.
      if (vocab.is_continuation(inst.masked_labels[k]) && !vocab.is_special(inst.input_ids[p - 1])) {
        ++pieces;
        EXPECT_TRUE(pos.count(p - 1)) << "a ## piece is masked without the piece before it";
      }
      // The word continues: the next piece is masked too.
      if (p + 1 < static_cast<int32_t>(inst.input_ids.size()) && !pos.count(p + 1)) {
        const int32_t next = inst.input_ids[p + 1];
        EXPECT_FALSE(vocab.is_continuation(next) && next != vocab.mask_id());
      }
    }
  }
  EXPECT_GT(pieces, 100);
}

TEST(PretrainingData, FileRoundTripAndLoader) {
  const Vocab vocab = synthetic_vocab();
  PretrainOptions opt;
  opt.max_seq_length = 64;
  opt.max_predictions_per_seq = 10;
  opt.dupe_factor = 3;
  const auto instances = create_instances(synthetic_documents(vocab, 40, 9), vocab, opt);
  const auto path = temp_path("data.bin");
  write_pretraining_file(path, instances, opt, vocab, /*lower_case=*/true, 42);
  {
    PretrainingData data(path);
    ASSERT_EQ(data.size(), static_cast<int64_t>(instances.size()));
    EXPECT_EQ(data.header().cache_key, 42u);
    EXPECT_EQ(data.header().max_seq_length, 64u);
    for (size_t i = 0; i < instances.size(); ++i) ASSERT_TRUE(same(data.instance(i), instances[i]));

    // World 3, 4 rows per rank: the ranks' rows tile each global batch without overlap.
    const int world = 3, rows = 4;
    std::vector<BatchLoader> loaders;
    for (int r = 0; r < world; ++r) loaders.emplace_back(data, rows, r, world, 77);
    const int64_t per_epoch = loaders[0].batches_per_epoch();
    EXPECT_EQ(per_epoch, data.size() / (rows * world));
    std::set<int64_t> epoch0;
    for (int64_t g = 0; g < per_epoch; ++g) {
      for (int r = 0; r < world; ++r) {
        for (int64_t row : loaders[r].rows(g)) EXPECT_TRUE(epoch0.insert(row).second);
      }
    }
    EXPECT_EQ(static_cast<int64_t>(epoch0.size()), per_epoch * rows * world);
    // Next epoch: a different order; the same order again for the same seed.
    EXPECT_NE(loaders[0].rows(0), loaders[0].rows(per_epoch));
    BatchLoader again(data, rows, 0, world, 77);
    EXPECT_EQ(again.rows(per_epoch + 1), loaders[0].rows(per_epoch + 1));
    EXPECT_EQ(again.rows(1), loaders[0].rows(1));

    // Batch arrays agree with the instances.
    Batch b = loaders[1].batch(2);
    const auto picked = loaders[1].rows(2);
    EXPECT_EQ(b.rows, rows);
    int64_t longest = 0, tokens = 0;
    for (int64_t row : picked) {
      longest = std::max<int64_t>(longest, instances[row].input_ids.size());
      tokens += instances[row].input_ids.size();
    }
    EXPECT_EQ(b.seq_length, longest);
    EXPECT_EQ(b.num_tokens, tokens);
    for (int64_t i = 0; i < rows; ++i) {
      const Instance& inst = instances[picked[i]];
      for (int64_t t = 0; t < b.seq_length; ++t) {
        const bool real = t < static_cast<int64_t>(inst.input_ids.size());
        EXPECT_EQ(b.attention_mask[i * b.seq_length + t], real ? 1 : 0);
        EXPECT_EQ(b.input_ids[i * b.seq_length + t], real ? inst.input_ids[t] : vocab.pad_id());
        if (real) EXPECT_EQ(b.token_type_ids[i * b.seq_length + t], t < inst.segment_a_length ? 0 : 1);
      }
      for (int64_t k = 0; k < b.max_predictions; ++k) {
        const bool real = k < static_cast<int64_t>(inst.masked_positions.size());
        EXPECT_EQ(b.masked_labels[i * b.max_predictions + k], real ? inst.masked_labels[k] : -100);
      }
      EXPECT_EQ(b.nsp_labels[i], inst.is_random_next ? 1 : 0);
    }
  }
  // A truncated file is rejected with a message naming it.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 8);
  try {
    PretrainingData broken(path);
    ADD_FAILURE() << "no error for a truncated file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(Corpus, ProseAndSentenceFormats) {
  const std::string prose =
      "GNU GENERAL PUBLIC LICENSE\n   Version 3\n\nThe licenses for most software\nare designed"
      " to take away your freedom. By contrast, it is free! Is it?\nYes.\n";
  const auto docs = split_documents(prose, CorpusFormat::Auto);
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(docs[0], (Strings{"GNU GENERAL PUBLIC LICENSE Version 3",
                              "The licenses for most software are designed to take away your freedom.",
                              "By contrast, it is free!", "Is it?", "Yes."}));
  const std::string sentences = "First one.\nSecond one.\n\n\nOther doc.\nEnd.\n";
  const auto sdocs = split_documents(sentences, CorpusFormat::Auto);
  ASSERT_EQ(sdocs.size(), 2u);
  EXPECT_EQ(sdocs[0], (Strings{"First one.", "Second one."}));
  EXPECT_EQ(sdocs[1], (Strings{"Other doc.", "End."}));
  EXPECT_THROW(parse_corpus_format("xml"), std::invalid_argument);
}

// ---- model ------------------------------------------------------------------------------------

BertConfig tiny_config(int64_t vocab) {
  BertConfig c = BertConfig::preset("tiny");
  c.vocab_size = vocab;
  return c;
}

BertInputs random_inputs(int64_t B, int64_t T, int64_t P, int64_t vocab) {
  BertInputs in;
  in.input_ids = torch::randint(5, vocab, {B, T}, torch::kLong);
  in.token_type_ids = (torch::arange(T).unsqueeze(0) >= T / 2).to(torch::kLong).expand({B, T}).contiguous();
  in.attention_mask = torch::ones({B, T}, torch::kLong);
  in.attention_mask.index_put_({0, torch::indexing::Slice(T - 3, torch::indexing::None)}, 0);
  in.masked_positions = torch::randint(1, T - 3, {B, P}, torch::kLong);
  in.masked_labels = torch::randint(5, vocab, {B, P}, torch::kLong);
  in.masked_labels.index_put_({1, P - 1}, -100);
  in.nsp_labels = torch::randint(0, 2, {B}, torch::kLong);
  return in;
}

TEST(BertModel, Presets) {
  EXPECT_EQ(BertConfig::preset("base").num_layers, 12);
  EXPECT_EQ(BertConfig::preset("mini").hidden_size, 256);
  EXPECT_EQ(BertConfig::preset("small").num_heads, 8);
  EXPECT_EQ(BertConfig::preset("large").intermediate_size, 4096);
  EXPECT_EQ(BertConfig::preset("tiny").num_layers, 2);
  EXPECT_THROW(BertConfig::preset("huge"), std::invalid_argument);
  BertConfig bad = BertConfig::preset("tiny");
  bad.num_heads = 3;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
}

TEST(BertModel, ShapesAndInitialLoss) {
  torch::manual_seed(0);
  BertForPreTraining model(tiny_config(500));
  const int64_t B = 3, T = 16, P = 4;
  auto in = random_inputs(B, T, P, 500);
  auto out = model->forward(in);
  EXPECT_EQ(out.mlm_logits.sizes(), (std::vector<int64_t>{B * P - 1, 500}));
  EXPECT_EQ(out.mlm_labels.sizes(), (std::vector<int64_t>{B * P - 1}));
  EXPECT_EQ(out.nsp_logits.sizes(), (std::vector<int64_t>{B, 2}));
  auto [seq, pooled] = model->encode(in.input_ids, in.token_type_ids, in.attention_mask);
  EXPECT_EQ(seq.sizes(), (std::vector<int64_t>{B, T, 128}));
  EXPECT_EQ(pooled.sizes(), (std::vector<int64_t>{B, 128}));
  // At initialisation the predictions are near uniform.
  EXPECT_NEAR(out.mlm_loss.item<double>(), std::log(500.0), 0.3);
  EXPECT_NEAR(out.nsp_loss.item<double>(), std::log(2.0), 0.2);
  EXPECT_NEAR(out.loss.item<double>(), out.mlm_loss.item<double>() + out.nsp_loss.item<double>(), 1e-6);
}

TEST(BertModel, TiedDecoderIsTheWordEmbedding) {
  BertForPreTraining model(tiny_config(300));
  const auto params = model->named_parameters();
  const auto* emb = params.find("bert.embeddings.word_embeddings.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->data_ptr(), model->word_embeddings().data_ptr());
  int sharing = 0;
  for (const auto& p : params) {
    EXPECT_EQ(p.key().find("decoder"), std::string::npos) << p.key();
    sharing += p.value().data_ptr() == emb->data_ptr();
  }
  EXPECT_EQ(sharing, 1);
  for (const char* name :
       {"cls.predictions.bias", "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.LayerNorm.weight", "cls.seq_relationship.weight",
        "bert.pooler.dense.weight", "bert.encoder.layer.1.attention.self.query.weight",
        "bert.encoder.layer.0.attention.output.LayerNorm.bias",
        "bert.encoder.layer.0.intermediate.dense.weight", "bert.encoder.layer.1.output.dense.bias",
        "bert.embeddings.token_type_embeddings.weight"}) {
    EXPECT_NE(params.find(name), nullptr) << name;
  }
  // The decoder really is the embedding: changing one embedding row moves only that logit.
  model->eval();
  auto in = random_inputs(2, 8, 3, 300);
  auto before = model->forward(in).mlm_logits.detach();
  {
    torch::NoGradGuard g;
    model->word_embeddings()[7].add_(torch::randn({128}));
  }
  auto after = model->forward(in).mlm_logits.detach();
  // Logit column 7 is h . W[7] + b[7], so it must move.
  EXPECT_GT((after.select(1, 7) - before.select(1, 7)).abs().max().item<double>(), 1e-3);
  // And gradients from the MLM loss reach the embedding matrix at rows never used as inputs.
  model->train();
  model->zero_grad();
  in.input_ids.clamp_(5, 100);
  model->forward(in).mlm_loss.backward();
  EXPECT_GT(model->word_embeddings().grad().slice(0, 200, 300).abs().sum().item<double>(), 0.0);
}

TEST(BertModel, PaddingDoesNotChangeOutputs) {
  torch::manual_seed(1);
  BertForPreTraining model(tiny_config(200));
  model->eval();
  torch::NoGradGuard g;
  auto ids = torch::randint(5, 200, {1, 10}, torch::kLong);
  auto types = torch::zeros({1, 10}, torch::kLong);
  auto [short_seq, short_pool] = model->encode(ids, types, torch::ones({1, 10}, torch::kLong));
  auto padded_ids = torch::cat({ids, torch::zeros({1, 6}, torch::kLong)}, 1);
  auto mask = torch::cat({torch::ones({1, 10}, torch::kLong), torch::zeros({1, 6}, torch::kLong)}, 1);
  auto [long_seq, long_pool] = model->encode(padded_ids, torch::zeros({1, 16}, torch::kLong), mask);
  EXPECT_LT((long_seq.slice(1, 0, 10) - short_seq).abs().max().item<double>(), 1e-4);
  EXPECT_LT((long_pool - short_pool).abs().max().item<double>(), 1e-4);
}

TEST(BertModel, LearnsWithTorchAdamW) {
  torch::manual_seed(2);
  BertForPreTraining model(tiny_config(100));
  auto in = random_inputs(4, 12, 3, 100);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = model->forward(in).loss;
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, 0.5 * first);
}

TEST(BertModel, PublishedParameterCounts) {
  torch::NoGradGuard g;
  BertForPreTraining base(BertConfig::preset("base"));
  const double n = static_cast<double>(base->num_parameters());
  EXPECT_NEAR(n, 110e6, 1.1e6) << "BERT-base: " << n;
  int64_t listed = 0;
  for (const auto& p : base->parameters()) listed += p.numel();
  EXPECT_EQ(listed, base->num_parameters());
  BertConfig large = BertConfig::preset("large");
  // Count BERT-large without allocating it: the same formula via a 1-layer model.
  large.num_layers = 1;
  BertForPreTraining one(large);
  large.num_layers = 2;
  BertForPreTraining two(large);
  const int64_t per_layer = two->num_parameters() - one->num_parameters();
  const double large_n = static_cast<double>(one->num_parameters() + 23 * per_layer);
  EXPECT_NEAR(large_n, 340e6, 6e6) << "BERT-large: " << large_n;
}

// ---- the trainer: resume continues the same trajectory --------------------------------------

#if defined(BERT_PRETRAIN_EXE) && defined(BERT_MPIEXEC)
int run_command(const std::string& cmd) {
  std::printf("[ RUN      ] %s\n", cmd.c_str());
  std::fflush(stdout);
  return std::system(cmd.c_str());
}

// "loss" of every metrics.jsonl line, by step (JSON keeps every bit of a double).
std::map<int64_t, double> losses_of(const std::string& metrics) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
  }
  return out;
}

// 8 steps on 2 ranks (ZeRO stage 2, dropout on) with checkpoints every 4, uninterrupted; versus
// 4 steps that stop as if preempted, then --resume for the rest. Steps 5-8 must have the same
// losses bitwise, and the final checkpoints the same parameters and optimizer state.
TEST(BertTrainer, ResumeContinuesTheSameTrajectory) {
  namespace fs = std::filesystem;
  const fs::path work = temp_path("resume");
  fs::remove_all(work);
  fs::create_directories(work);
  const std::string exe = BERT_PRETRAIN_EXE, corpus = BERT_TEST_CORPUS;
  const std::string vocab = (work / "vocab.txt").string(), data = (work / "data.bin").string();
  ASSERT_EQ(run_command(exe + " build-vocab --corpus " + corpus + " --vocab-size 2000 -o " + vocab +
                        " > /dev/null"), 0);
  ASSERT_EQ(run_command(exe + " create-data --corpus " + corpus + " --vocab " + vocab +
                        " --max-seq-length 64 --dupe-factor 2 -o " + data + " > /dev/null"), 0);
  const std::string train = std::string(BERT_MPIEXEC) +
      " --allow-run-as-root --oversubscribe --bind-to none -np 2 " + exe +
      " --preset tiny --stage 2 --steps 8 --warmup-steps 2 --lr 2e-3 --batch-size 4"
      " --max-seq-length 64 --vocab " + vocab + " --data " + data +
      " --no-plot --progress lines --log-every 4 --checkpoint-every 4";
  const std::string whole = (work / "whole").string(), parts = (work / "parts").string();
  ASSERT_EQ(run_command(train + " --out " + whole), 0);
  ASSERT_EQ(run_command(train + " --out " + parts + " --stop-after 4"), 0);
  EXPECT_EQ(shardopt::read_checkpoint_info(parts + "/checkpoint").step, 4);
  ASSERT_EQ(run_command(train + " --out " + parts + " --resume"), 0);

  const auto expected = losses_of(whole + "/metrics.jsonl");
  const auto resumed = losses_of(parts + "/metrics.jsonl");
  ASSERT_EQ(expected.size(), 8u);
  ASSERT_EQ(resumed.size(), 8u);
  for (int64_t step = 1; step <= 8; ++step) {
    EXPECT_EQ(resumed.at(step), expected.at(step)) << "step " << step;  // bitwise
  }
  EXPECT_NE(expected.at(8), expected.at(4));  // it trained on

  const auto a = shardopt::read_full_state(whole + "/checkpoint", true);
  const auto b = shardopt::read_full_state(parts + "/checkpoint", true);
  EXPECT_EQ(a.step, 8);
  EXPECT_EQ(b.step, 8);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (const auto& item : a.params) {
    EXPECT_TRUE(item.value().equal(b.params[item.key()])) << item.key();
    for (const auto& [state, dict] : a.optimizer_state) {
      EXPECT_TRUE(dict[item.key()].equal(b.optimizer_state.at(state)[item.key()]))
          << state << " of " << item.key();
    }
  }
  if (!HasFailure()) fs::remove_all(work);
}
#endif

}  // namespace
}  // namespace bert
