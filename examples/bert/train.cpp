// bert_pretrain: BERT pretraining (MLM + NSP) with shardopt's ZeRO optimizer, one process per rank
// (mpirun -np N). Rank 0 prepares the vocabulary and the data file once (cached by content), every
// rank trains on its slice of each global batch, rank 0 logs metrics.jsonl and plots the loss.
// --synthetic trains on random tokens instead (benchmarks: bench/compare_peers.sh).
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include <fmt/format.h>

#include "block_cache.hpp"
#include "checkpointing.hpp"
#include "data.hpp"
#include "model.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.hpp"
#include "tokenizer.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::vector<std::string> corpus = {"/usr/share/common-licenses"};
  std::string corpus_format = "auto";
  std::string vocab;
  int32_t vocab_size = 8000;
  std::string data;
  std::string preset = "mini";
  int stage = 2;
  std::string precision = "fp32";
  int64_t batch_size = 8;
  int grad_accum = 1;
  double lr = 5e-4;
  int64_t warmup_steps = 30;
  int64_t steps = 300;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;
  double timeout_s = 0;  // collective deadline; 0: SHARDOPT_TIMEOUT or the library's default
  int64_t checkpoint_every = 0;
  std::string resume;
  bool resume_requested = false;  // --resume given (its value may be empty: OUT/checkpoint)
  int64_t stop_after = 0;
  std::string out = "out/bert";
  uint64_t seed = 42;
  int32_t max_seq_length = 128;
  int32_t max_predictions = 20;
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  int32_t dupe_factor = 5;
  bool whole_word_mask = false;
  double dropout = -1;  // < 0: the preset's 0.1
  int threads = 1;
  int64_t log_every = 10;
  std::string progress = "auto";
  bool no_plot = false;
  bool check_loss_decrease = false;
  std::string golden;        // "step loss" lines to compare against
  double golden_tol = 0.05;  // absolute
  std::string write_golden;
  double bucket_mb = 0;  // 0: the library's default
  bool synthetic = false;             // random-token MLM batches, no corpus
  bool no_nsp = false;
  std::string mlm_positions = "preset";  // masked | all | preset
  int64_t timing_warmup = 5;          // first steps left out of the timing medians
  double block_cache_mb = 1024;       // freed blocks >= 32 MiB kept for reuse; 0: off
  bool no_overlap = false;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU seconds of the whole process (every thread): on a shared machine a steadier measure of the
// work a step costs than wall time.
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

// Linear warm-up to the peak, then linear decay to 0 at the last step (BERT's schedule).
double lr_at(const Args& a, int64_t step) {
  if (step < a.warmup_steps) return a.lr * static_cast<double>(step + 1) / a.warmup_steps;
  const double rest = static_cast<double>(a.steps - a.warmup_steps);
  return rest <= 0 ? a.lr : a.lr * std::max(0.0, static_cast<double>(a.steps - step) / rest);
}

// ---- vocabulary and data (rank 0), cached by the content of their inputs ----------------------

struct Prepared {
  std::string vocab_path, data_path;
  std::vector<std::string> notes;  // what was built or reused, for the log
};

std::vector<std::string> corpus_files(const Args& a) {
  std::vector<std::string> files;
  for (const auto& c : a.corpus) {
    auto more = bert::list_corpus_files(c);
    files.insert(files.end(), more.begin(), more.end());
  }
  return files;
}

uint64_t corpus_key(const std::vector<std::string>& files) {
  uint64_t h = bert::fnv1a("corpus-v1", 9);
  for (const auto& f : files) {
    const std::string text = bert::read_file(f);
    const uint64_t n = text.size();
    h = bert::fnv1a(&n, sizeof(n), h);
    h = bert::fnv1a(text.data(), text.size(), h);
  }
  return h;
}

bert::PretrainOptions pretrain_options(const Args& a) {
  bert::PretrainOptions po;
  po.max_seq_length = a.max_seq_length;
  po.max_predictions_per_seq = a.max_predictions;
  po.masked_lm_prob = a.masked_lm_prob;
  po.short_seq_prob = a.short_seq_prob;
  po.dupe_factor = a.dupe_factor;
  po.whole_word_mask = a.whole_word_mask;
  po.seed = a.seed;
  return po;
}

Prepared prepare(const Args& a) {
  Prepared p;
  const fs::path cache = fs::path(a.out) / "cache";
  fs::create_directories(cache);
  const std::vector<std::string> files = corpus_files(a);
  const uint64_t ckey = corpus_key(files);
  const auto format = bert::parse_corpus_format(a.corpus_format);

  if (!a.vocab.empty()) {
    p.vocab_path = a.vocab;
    p.notes.push_back("vocab: " + a.vocab + " (given)");
  } else {
    uint64_t vkey = bert::fnv1a(&a.vocab_size, sizeof(a.vocab_size), ckey);
    p.vocab_path = (cache / ("vocab-" + hex(vkey) + ".txt")).string();
    if (fs::exists(p.vocab_path)) {
      p.notes.push_back("vocab: " + p.vocab_path + " (cached)");
    } else {
      const auto t0 = Clock::now();
      std::vector<std::string> texts;
      for (const auto& f : files) texts.push_back(bert::read_file(f));
      bert::VocabBuildOptions vo;
      vo.vocab_size = a.vocab_size;
      const bert::Vocab v = bert::build_vocab(texts, vo);
      v.save(p.vocab_path);
      p.notes.push_back(fmt::format(
          "vocab: {} (built, {} tokens from {} files, {:.1f} s{})", p.vocab_path, v.size(),
          files.size(), seconds_since(t0),
          v.size() < a.vocab_size ? fmt::format("; {} requested, but no pair of pieces occurs "
                                                "twice more in this corpus", a.vocab_size)
                                  : ""));
    }
  }
  const std::string vocab_text = bert::read_file(p.vocab_path);
  const bert::PretrainOptions po = pretrain_options(a);
  uint64_t dkey = bert::fnv1a(vocab_text.data(), vocab_text.size(), ckey);
  const std::string params =
      fmt::format("v{} L{} P{} m{} s{} d{} w{} seed{} fmt{}", bert::kDataVersion, po.max_seq_length,
                  po.max_predictions_per_seq, po.masked_lm_prob, po.short_seq_prob,
                  po.dupe_factor, po.whole_word_mask, po.seed, a.corpus_format);
  dkey = bert::fnv1a(params.data(), params.size(), dkey);
  p.data_path = a.data.empty() ? (cache / ("pretrain-" + hex(dkey) + ".bin")).string() : a.data;
  if (fs::exists(p.data_path)) {
    bert::PretrainingData existing(p.data_path);
    p.notes.push_back(fmt::format("data: {} ({} instances, {})", p.data_path, existing.size(),
                                  existing.header().cache_key == dkey
                                      ? "cached"
                                      : "given; made from other inputs than these"));
    return p;
  }
  const auto t0 = Clock::now();
  bert::Tokenizer tok(bert::Vocab::load(p.vocab_path));
  const auto docs = bert::load_documents(files, tok, format);
  const auto instances = bert::create_instances(docs, tok.vocab(), po);
  if (!p.data_path.empty() && fs::path(p.data_path).has_parent_path()) {
    fs::create_directories(fs::path(p.data_path).parent_path());
  }
  bert::write_pretraining_file(p.data_path, instances, po, tok.vocab().size(),
                               tok.vocab().pad_id(), dkey);
  p.notes.push_back(fmt::format("data: {} (built, {} documents -> {} instances, {:.1f} s)",
                                p.data_path, docs.size(), instances.size(), seconds_since(t0)));
  return p;
}

// Rank 0 prepares; the others learn the outcome (paths or rank 0's error) by broadcast.
Prepared prepare_on_rank0(const Args& a, shardopt::Communicator& comm) {
  Prepared p;
  std::string message;
  if (comm.rank() == 0) {
    try {
      p = prepare(a);
      message = "ok\n" + p.vocab_path + "\n" + p.data_path;
    } catch (const std::exception& e) {
      message = std::string("error\n") + e.what();
    }
  }
  auto len = torch::tensor({static_cast<int64_t>(message.size())}, torch::kLong);
  comm.broadcast(len, 0);
  auto bytes = torch::zeros({len.item<int64_t>()}, torch::kByte);
  if (comm.rank() == 0) std::memcpy(bytes.data_ptr(), message.data(), message.size());
  comm.broadcast(bytes, 0);
  message.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  std::istringstream in(message);
  std::string status;
  std::getline(in, status);
  if (status != "ok") {
    std::string what((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    throw std::runtime_error(comm.rank() == 0 ? what : "rank 0 could not prepare the data: " + what);
  }
  std::getline(in, p.vocab_path);
  std::getline(in, p.data_path);
  return p;
}

int build_vocab_command(const Args& a, const std::string& output) {
  const auto t0 = Clock::now();
  std::vector<std::string> texts;
  for (const auto& f : corpus_files(a)) texts.push_back(bert::read_file(f));
  bert::VocabBuildOptions vo;
  vo.vocab_size = a.vocab_size;
  const bert::Vocab v = bert::build_vocab(texts, vo);
  v.save(output);
  fmt::print("[bert] {}: {} tokens (requested {}) from {} files in {:.1f} s\n", output, v.size(),
             a.vocab_size, texts.size(), seconds_since(t0));
  return 0;
}

int create_data_command(const Args& a, const std::string& output) {
  if (a.vocab.empty()) throw std::runtime_error("create-data needs --vocab");
  const auto t0 = Clock::now();
  bert::Tokenizer tok(bert::Vocab::load(a.vocab));
  const auto docs = bert::load_documents(corpus_files(a), tok, bert::parse_corpus_format(a.corpus_format));
  const auto instances = bert::create_instances(docs, tok.vocab(), pretrain_options(a));
  bert::write_pretraining_file(output, instances, pretrain_options(a), tok.vocab().size(),
                               tok.vocab().pad_id(), 0);
  fmt::print("[bert] {}: {} documents -> {} instances in {:.1f} s\n", output, docs.size(),
             instances.size(), seconds_since(t0));
  return 0;
}

// ---- training ---------------------------------------------------------------------------------

// Where batches come from: the pretraining file of prepare_on_rank0, or random tokens.
struct BatchSource {
  std::unique_ptr<bert::PretrainingData> data;
  std::unique_ptr<bert::BatchLoader> loader;
  const Args* args = nullptr;
  int64_t vocab_size = 0;
  int rank = 0;
  bert::Batch batch(int64_t index) {
    if (loader) return loader->batch(index);
    return bert::synthetic_batch(args->batch_size, args->max_seq_length, vocab_size,
                                 args->masked_lm_prob, kSyntheticMaskId, args->seed, index, rank);
  }
  static constexpr int64_t kSyntheticMaskId = 103;  // [MASK] in BERT's uncased vocabulary
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Per-step timings each rank sends to rank 0 (one all-gather per step).
enum Timing { kMemory, kStep, kFwd, kBwd, kCommWait, kUpdate, kGather, kOpt, kData, kCpu, kTimings };

int run(const Args& a) {
  shardopt::InitOptions init;
  if (a.timeout_s > 0) {
    init.timeout = std::chrono::duration_cast<shardopt::Duration>(
        std::chrono::duration<double>(a.timeout_s));
  }
  auto comm = shardopt::init_from_env(init);
  const int rank = comm->rank(), world = comm->size();
  at::set_num_threads(a.threads);
  const bool lead = rank == 0;
  const auto t_start = Clock::now();
  if (lead) fs::create_directories(a.out);

  // Note [Why the trainer caches blocks] (block_cache.hpp): blocks over glibc's largest mmap
  // threshold (32 MiB), which it would map and unmap on every allocation. The tracker above the
  // cache counts live tensor storage only (peak reported in summary.json).
  std::unique_ptr<bert::ScopedBlockCache> block_cache;
  if (a.block_cache_mb > 0) {
    block_cache = std::make_unique<bert::ScopedBlockCache>(
        int64_t{32} << 20, static_cast<int64_t>(a.block_cache_mb * (1 << 20)));
  }
  shardopt::ScopedMemoryTracking tracking;
  bert::BertConfig config = bert::BertConfig::preset(a.preset);
  BatchSource loader;
  loader.args = &a;
  loader.rank = rank;
  Prepared prepared;
  int64_t max_seq_length = a.max_seq_length;
  if (a.synthetic) {
    loader.vocab_size = config.vocab_size;  // the preset's (BERT's 30522)
    config.nsp = false;                     // random tokens have no sentence pairs
  } else {
    prepared = prepare_on_rank0(a, *comm);
    if (lead) {
      for (const auto& n : prepared.notes) fmt::print("[bert] {}\n", n);
    }
    const bert::Vocab vocab = bert::Vocab::load(prepared.vocab_path);
    loader.data = std::make_unique<bert::PretrainingData>(prepared.data_path);
    const auto& data = *loader.data;
    if (static_cast<int32_t>(data.header().vocab_size) != vocab.size()) {
      throw std::runtime_error(fmt::format("data file {} was made with a {}-token vocabulary, but {} has {}",
                                           prepared.data_path, data.header().vocab_size,
                                           prepared.vocab_path, vocab.size()));
    }
    loader.loader = std::make_unique<bert::BatchLoader>(data, a.batch_size, rank, world, a.seed);
    config.vocab_size = vocab.size();
    max_seq_length = data.header().max_seq_length;
  }
  if (a.no_nsp) config.nsp = false;
  if (a.mlm_positions != "preset") config.mlm_all_positions = a.mlm_positions == "all";
  if (a.dropout >= 0) config.hidden_dropout = config.attention_dropout = a.dropout;
  if (max_seq_length > config.max_position_embeddings) {
    throw std::runtime_error(fmt::format("--max-seq-length {} exceeds the model's {} positions",
                                         max_seq_length, config.max_position_embeddings));
  }
  torch::manual_seed(a.seed);  // identical initial weights everywhere (rank 0's are broadcast too)
  bert::BertForPreTraining model(config);
  // The optimizer casts the parameters to the compute dtype itself and keeps the fp32 master
  // copy of these fp32 initial values.
  const auto precision = shardopt::parse_precision(a.precision);
  if (precision == shardopt::Precision::FP16) {
    throw std::runtime_error(
        "--precision fp16 needs a GPU: libtorch's CPU kernels have no fp16 matrix products "
        "(\"addmm_impl_cpu_\" not implemented for 'Half'); use --precision bf16 on CPU");
  }
  model->train();

  shardopt::ZeroOptions zo;
  zo.stage = shardopt::stage_from_int(a.stage);
  zo.units = model->units();  // stage 3 gathers one encoder layer at a time
  zo.grad_accumulation_steps = a.grad_accum;
  zo.max_grad_norm = a.max_grad_norm;
  zo.timeout = init.timeout;
  zo.precision = precision;
  if (a.bucket_mb > 0) zo.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  zo.overlap_comm = !a.no_overlap;
  // BERT: no weight decay on biases and LayerNorm.
  auto groups = shardopt::weight_decay_groups(model->named_parameters(), [](const std::string& n) {
    return n.find("bias") != std::string::npos || n.find("LayerNorm") != std::string::npos;
  });
  shardopt::DistributedOptimizer opt(groups, shardopt::AdamW(a.lr).weight_decay(a.weight_decay),
                                     comm, zo);

  const int64_t global_batch = a.batch_size * world * a.grad_accum;
  if (lead) {
    fmt::print("[bert] model: BERT-{} ({} layers, hidden {}, {} heads), {:.2f} M parameters, vocab {}, "
               "{}, MLM logits at {} positions\n",
               config.name, config.num_layers, config.hidden_size, config.num_heads,
               model->num_parameters() / 1e6, config.vocab_size,
               config.nsp ? "MLM + NSP" : "MLM only", config.mlm_all_positions ? "all" : "masked");
    const std::string epochs =
        loader.data ? fmt::format("{:.2f} epochs of {} instances",
                                  static_cast<double>(a.steps * global_batch) /
                                      static_cast<double>(loader.data->size()),
                                  loader.data->size())
                    : fmt::format("synthetic: random tokens, {} per row", max_seq_length);
    fmt::print("[bert] training: {} ranks ({}), ZeRO stage {}, {}, {} rows/rank x {} micro-steps = "
               "{} sequences/step, {} steps ({}), lr {} (warm-up {}), {} thread(s)/rank\n",
               world, comm->backend(), a.stage, a.precision, a.batch_size, a.grad_accum,
               global_batch, a.steps, epochs, a.lr, a.warmup_steps, a.threads);
    std::fflush(stdout);
  }

  std::ofstream metrics;
  const fs::path metrics_path = fs::path(a.out) / "metrics.jsonl";
  if (lead) {
    metrics.open(metrics_path, a.resume_requested ? std::ios::app : std::ios::trunc);
    if (!metrics) throw std::runtime_error("cannot write " + metrics_path.string());
  }
  // mpirun hands ranks a pseudo-terminal even when its own output is a pipe: --progress decides.
  const bool tty = lead && (a.progress == "tty" || (a.progress == "auto" && ::isatty(STDOUT_FILENO)));
  std::vector<double> losses;
  std::vector<std::vector<double>> timings;  // rank 0: [step][rank * kTimings + Timing]
  double train_s = 0;
  int64_t tokens_total = 0;
  nlohmann::json last;

  // ---- checkpoints: --resume restores, --checkpoint-every saves (atomically, into OUT/checkpoint)
  const fs::path checkpoint_dir = fs::path(a.out) / "checkpoint";
  const nlohmann::json schedule = {{"steps", a.steps}, {"warmup-steps", a.warmup_steps},
                                   {"lr", a.lr}, {"seed", a.seed}, {"batch-size", a.batch_size},
                                   {"grad-accum", a.grad_accum}, {"ranks", world}};
  bert::RunState run_state;
  if (a.resume_requested) {
    const std::string from = a.resume.empty() ? checkpoint_dir.string() : a.resume;
    const auto t0 = Clock::now();
    const auto notes = bert::restore_run_state(shardopt::load_checkpoint(opt, from), schedule,
                                               &run_state);
    losses = run_state.losses;
    train_s = run_state.train_s;
    tokens_total = run_state.tokens;
    if (lead) {
      fmt::print("[bert] resumed from {} at step {} ({:.1f} s)\n", from, run_state.step,
                 seconds_since(t0));
      for (const auto& n : notes) fmt::print("[bert] note: {}\n", n);
      bert::truncate_metrics(metrics_path, run_state.step);
      metrics.close();
      metrics.open(metrics_path, std::ios::app);
    }
  }
  const int64_t start_step = run_state.step;
  int64_t data_position = run_state.data_position;
  int64_t last_saved = -1;
  auto maybe_checkpoint = [&](int64_t done) {
    if (a.checkpoint_every <= 0 || done <= start_step || done % a.checkpoint_every != 0 ||
        done == last_saved) {
      return;
    }
    const auto t0 = Clock::now();
    if (!opt.parameters_finite()) {  // never replace the last good checkpoint with NaN/Inf
      if (lead) {
        fmt::print("{}[bert] checkpoint: step {} NOT saved: the parameters hold NaN/Inf; {} keeps "
                   "the last good one\n", tty ? "\r\033[K" : "", done, checkpoint_dir.string());
      }
      return;
    }
    bert::RunState s{done, data_position, losses, train_s, tokens_total};
    shardopt::save_checkpoint(opt, checkpoint_dir.string(), bert::make_trainer_state(s, schedule));
    last_saved = done;
    if (lead) {
      fmt::print("{}[bert] checkpoint: step {} -> {} ({:.1f} s)\n", tty ? "\r\033[K" : "", done,
                 checkpoint_dir.string(), seconds_since(t0));
    }
  };

  int64_t step = start_step;
  for (; step < a.steps; ++step) {
    maybe_checkpoint(step);
    if (a.stop_after > 0 && step - start_step >= a.stop_after) break;
    const auto t0 = Clock::now();
    const double cpu0 = process_cpu_s();
    const double lr = lr_at(a, step);
    for (auto& g : opt.param_groups()) g.options().set_lr(lr);
    opt.zero_grad();
    double fwd_s = 0, bwd_s = 0, data_s = 0, metrics_s = 0, metrics_cpu_s = 0;
    // Local sums: loss, mlm_loss, nsp_loss, mlm correct, mlm count, nsp correct, rows, tokens.
    std::array<double, 8> sums{};
    for (int micro = 0; micro < a.grad_accum; ++micro) {
      const auto td = Clock::now();
      const bert::Batch batch = loader.batch(data_position++);
      const bert::BertInputs inputs = bert::to_inputs(batch);
      data_s += seconds_since(td);
      const auto tf = Clock::now();
      const bert::BertOutputs out = model->forward(inputs);
      fwd_s += seconds_since(tf);
      const auto tb = Clock::now();
      opt.backward(out.loss);
      bwd_s += seconds_since(tb);
      // Metrics are not training work: their time is left out of the step time.
      const auto tm = Clock::now();
      const double cpu_m = process_cpu_s();
      torch::NoGradGuard no_grad;
      sums[0] += out.loss.item<double>();
      sums[1] += out.mlm_loss.item<double>();
      sums[2] += out.nsp_loss.item<double>();
      sums[3] += out.mlm_logits.argmax(-1).eq(out.mlm_labels).sum().item<double>();
      sums[4] += out.mlm_labels.ne(-100).sum().item<double>();
      if (out.nsp_logits.defined()) {
        sums[5] += out.nsp_logits.argmax(-1).eq(inputs.nsp_labels).sum().item<double>();
      }
      sums[6] += static_cast<double>(batch.rows);
      sums[7] += static_cast<double>(batch.num_tokens);
      metrics_s += seconds_since(tm);
      metrics_cpu_s += process_cpu_s() - cpu_m;
    }
    const auto to = Clock::now();
    opt.step();
    const double opt_s = seconds_since(to);
    if (block_cache) block_cache->next_step();
    const double step_s = seconds_since(t0) - metrics_s;
    const double cpu_s = process_cpu_s() - cpu0 - metrics_cpu_s;
    const auto& stats = opt.last_step();

    // Metrics over all ranks (one small all-reduce and one all-gather per step).
    auto reduced = torch::tensor(std::vector<double>(sums.begin(), sums.end()), torch::kDouble);
    comm->all_reduce(reduced, shardopt::ReduceOp::Sum);
    const auto mem = opt.memory();
    std::vector<double> local(kTimings);
    local[kMemory] = static_cast<double>(mem.total());
    local[kStep] = step_s, local[kFwd] = fwd_s, local[kBwd] = bwd_s, local[kOpt] = opt_s;
    local[kCommWait] = stats.reduce_wait_s, local[kUpdate] = stats.update_s;
    local[kGather] = stats.gather_s, local[kData] = data_s, local[kCpu] = cpu_s;
    auto mine = torch::tensor(local, torch::kDouble);
    auto all = torch::zeros({kTimings * world}, torch::kDouble);
    comm->all_gather(mine, all);
    train_s += step_s;
    const auto r = reduced.accessor<double, 1>();
    const double micro_n = static_cast<double>(world * a.grad_accum);
    const double loss = r[0] / micro_n;
    losses.push_back(loss);
    tokens_total += static_cast<int64_t>(r[7]);
    if (!lead) continue;

    std::vector<int64_t> mem_bytes;
    double slowest = 0;
    const auto* av = all.data_ptr<double>();
    timings.emplace_back(av, av + kTimings * world);
    for (int k = 0; k < world; ++k) {
      mem_bytes.push_back(static_cast<int64_t>(av[k * kTimings + kMemory]));
      slowest = std::max(slowest, av[k * kTimings + kStep]);
    }
    nlohmann::json j;
    j["step"] = step + 1;
    j["loss"] = loss;
    j["mlm_loss"] = r[1] / micro_n;
    j["nsp_loss"] = r[2] / micro_n;
    j["mlm_acc"] = r[4] > 0 ? r[3] / r[4] : 0.0;
    j["nsp_acc"] = r[6] > 0 ? r[5] / r[6] : 0.0;
    j["lr"] = lr;
    j["grad_norm"] = stats.grad_norm;
    j["step_time_s"] = slowest;
    j["data_s"] = data_s;
    j["fwd_s"] = fwd_s;
    j["bwd_s"] = bwd_s;
    j["opt_s"] = opt_s;  // the step() call: comm_wait_s + update_s + gather_s + clipping
    j["comm_wait_s"] = stats.reduce_wait_s;  // reductions not finished when backward ended
    j["update_s"] = stats.update_s;
    j["gather_s"] = stats.gather_s;
    j["cpu_s"] = cpu_s;  // process CPU time of the step (all threads, rank 0)
    j["tokens_per_s"] = r[7] / std::max(slowest, 1e-9);
    j["memory_bytes"] = mem_bytes;
    j["memory_rank0"] = {{"params", mem.param_bytes},
                         {"grads", mem.grad_bytes},
                         {"optimizer_state", mem.optimizer_state_bytes},
                         {"buffers", mem.buffer_bytes}};
    metrics << j.dump() << '\n';
    metrics.flush();
    last = j;

    const bool show = tty || (step + 1) % a.log_every == 0 || step == 0 || step + 1 == a.steps;
    if (show) {
      const double eta = train_s / static_cast<double>(step + 1) * static_cast<double>(a.steps - step - 1);
      std::string mem_text;
      for (int k = 0; k < world; ++k) mem_text += fmt::format(" r{} {}", k, human_bytes(mem_bytes[k]));
      const std::string line = fmt::format(
          "step {:>{}}/{} | loss {:.3f} | mlm {:.3f} acc {:.3f} | nsp {:.3f} acc {:.2f} | "
          "{:.0f} tok/s | lr {:.2e} | ETA {} | mem{}",
          step + 1, std::to_string(a.steps).size(), a.steps, loss, j["mlm_loss"].get<double>(),
          j["mlm_acc"].get<double>(), j["nsp_loss"].get<double>(), j["nsp_acc"].get<double>(),
          j["tokens_per_s"].get<double>(), lr, human_time(eta), mem_text);
      if (tty) fmt::print("\r\033[K{}", line);
      else fmt::print("{}\n", line);
      std::fflush(stdout);
    }
  }
  maybe_checkpoint(step);
  if (tty) fmt::print("\n");

  // Peak resident memory and peak tensor storage of every rank.
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  auto peaks = torch::tensor({static_cast<double>(usage.ru_maxrss) * 1024.0,
                              static_cast<double>(tracking.tracker().peak_bytes())},
                             torch::kDouble);
  auto all_peaks = torch::zeros({2 * world}, torch::kDouble);
  comm->all_gather(peaks, all_peaks);

  int rc = 0;
  if (lead) {
    metrics.close();
    const fs::path plot = fs::path(a.out) / "loss.png";
    std::string plot_note = "skipped (--no-plot)";
    if (!a.no_plot) {
      const char* env = std::getenv("BERT_PLOT_SCRIPT");
      const std::string script = env ? env : BERT_PLOT_SCRIPT;
      const std::string cmd = fmt::format("/usr/bin/python3 '{}' '{}' '{}'", script,
                                          metrics_path.string(), plot.string());
      plot_note = std::system(cmd.c_str()) == 0 ? plot.string()
                                                : "failed (command: " + cmd + ")";
    }
    // Timing medians over the steps after --timing-warmup, per rank; the step time of the run is
    // the slowest rank's median (as the peer baseline reports it).
    const int64_t skip = std::min<int64_t>(a.timing_warmup, std::max<int64_t>(0, a.steps - 1));
    const char* names[kTimings] = {"memory_bytes", "step_s", "fwd_s", "bwd_s", "comm_wait_s",
                                   "update_s", "gather_s", "opt_s", "data_s", "cpu_s"};
    nlohmann::json per_rank = nlohmann::json::array();
    std::vector<int64_t> rss, tensor_peak;
    double step_median = 0;
    int slowest_rank = 0;
    for (int r = 0; r < world; ++r) {
      nlohmann::json t;
      for (int f = kStep; f < kTimings; ++f) {
        std::vector<double> v;
        for (size_t s = static_cast<size_t>(skip); s < timings.size(); ++s) {
          v.push_back(timings[s][r * kTimings + f]);
        }
        t[names[f]] = median(v);
      }
      if (t["step_s"].get<double>() > step_median) {
        step_median = t["step_s"].get<double>(), slowest_rank = r;
      }
      per_rank.push_back(t);
      rss.push_back(static_cast<int64_t>(all_peaks[2 * r].item<double>()));
      tensor_peak.push_back(static_cast<int64_t>(all_peaks[2 * r + 1].item<double>()));
    }
    nlohmann::json timing = {
        {"timed_steps", a.steps - skip}, {"warmup_steps", skip},
        {"median_step_s", step_median},
        {"samples_per_s", static_cast<double>(global_batch) / std::max(step_median, 1e-9)},
        {"per_rank_median", per_rank}};
    const size_t k = std::min<size_t>(5, losses.size());
    const double first = std::accumulate(losses.begin(), losses.begin() + k, 0.0) / k;
    const double final_ = std::accumulate(losses.end() - k, losses.end(), 0.0) / k;
    nlohmann::json summary = {
        {"preset", a.preset}, {"parameters", model->num_parameters()}, {"ranks", world},
        {"stage", a.stage}, {"steps", a.steps}, {"global_batch", global_batch},
        {"first5_loss", first}, {"last5_loss", final_}, {"train_s", train_s},
        {"wall_s", seconds_since(t_start)}, {"tokens", tokens_total}, {"last", last},
        {"vocab", prepared.vocab_path}, {"data", prepared.data_path},
        {"synthetic", a.synthetic}, {"nsp", config.nsp},
        {"mlm_all_positions", config.mlm_all_positions}, {"batch_size", a.batch_size},
        {"threads", a.threads}, {"timing", timing}, {"peak_rss_bytes", rss},
        {"peak_tensor_bytes", tensor_peak},
        {"model_state_rank0", last.value("memory_rank0", nlohmann::json::object())}};
    if (block_cache) {
      const auto c = block_cache->stats();
      summary["block_cache_rank0"] = {{"hits", c.hits}, {"misses", c.misses},
                                      {"peak_cached_bytes", c.peak_cached_bytes},
                                      {"dropped_unused", c.dropped_unused}};
    }
    std::ofstream(fs::path(a.out) / "summary.json") << summary.dump(2) << '\n';
    fmt::print("[bert] done: {} steps in {} ({} wall), loss {:.3f} -> {:.3f} (mean of first/last {}), "
               "MLM loss {:.3f}, MLM acc {:.3f}, NSP acc {:.2f}\n",
               step, human_time(train_s), human_time(seconds_since(t_start)), first, final_, k,
               last.value("mlm_loss", 0.0), last.value("mlm_acc", 0.0), last.value("nsp_acc", 0.0));
    const auto& t = per_rank[slowest_rank];
    fmt::print("[bert] step time (median of steps {}-{}, slowest rank {}): {:.4f} s = data {:.4f} + "
               "fwd {:.4f} + bwd {:.4f} + step() {:.4f} (comm wait {:.4f}, update {:.4f}, gather "
               "{:.4f}); {:.2f} samples/s; process CPU {:.4f} s/step\n",
               skip + 1, a.steps, slowest_rank, step_median, t["data_s"].get<double>(),
               t["fwd_s"].get<double>(), t["bwd_s"].get<double>(), t["opt_s"].get<double>(),
               t["comm_wait_s"].get<double>(), t["update_s"].get<double>(),
               t["gather_s"].get<double>(), timing["samples_per_s"].get<double>(),
               t["cpu_s"].get<double>());
    std::string peaks_text;
    for (int r = 0; r < world; ++r) {
      peaks_text += fmt::format(" r{} {} ({} tensors)", r, human_bytes(rss[r]), human_bytes(tensor_peak[r]));
    }
    fmt::print("[bert] peak RSS:{}\n", peaks_text);
    fmt::print("[bert] metrics: {}\n[bert] loss plot: {}\n[bert] summary: {}\n", metrics_path.string(),
               plot_note, (fs::path(a.out) / "summary.json").string());
    fmt::print("[bert] checkpoint: {}\n",
               last_saved >= 0 ? fmt::format("{} (step {})", checkpoint_dir.string(), last_saved)
                               : std::string("none written (--checkpoint-every N saves one)"));
    if (!a.write_golden.empty()) {
      std::ofstream g(a.write_golden, std::ios::trunc);
      for (size_t i = 0; i < losses.size(); ++i) g << fmt::format("{} {:.6f}\n", i + 1, losses[i]);
      fmt::print("[bert] golden losses written to {}\n", a.write_golden);
    }
    if (!a.golden.empty()) {
      std::ifstream g(a.golden);
      if (!g) throw std::runtime_error("cannot read the golden loss file " + a.golden);
      int64_t step = 0, compared = 0, worst_step = 0;
      double expected = 0, worst = 0;
      while (g >> step >> expected) {
        if (step < 1 || step > static_cast<int64_t>(losses.size())) continue;
        const double d = std::abs(losses[static_cast<size_t>(step - 1)] - expected);
        if (d > worst) worst = d, worst_step = step;
        ++compared;
      }
      const bool ok = compared > 0 && worst <= a.golden_tol;
      fmt::print("[bert] golden {}: {} steps compared, largest |loss - golden| {:.2e} at step {} "
                 "(tolerance {:.1e}): {}\n", a.golden, compared, worst, worst_step, a.golden_tol,
                 ok ? "ok" : "MISMATCH");
      if (!ok) rc = 4;
    }
    if (a.check_loss_decrease && !(final_ < first)) {
      fmt::print(stderr, "[bert] --check-loss-decrease: the loss did not fall ({:.4f} -> {:.4f})\n",
                 first, final_);
      rc = 3;
    }
    std::fflush(stdout);
  }
  // Every rank exits with rank 0's verdict.
  auto verdict = torch::tensor({static_cast<int64_t>(rc)}, torch::kLong);
  comm->broadcast(verdict, 0);
  return static_cast<int>(verdict.item<int64_t>());
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"BERT pretraining (MLM + NSP) with shardopt's ZeRO optimizer; run under mpirun -np N"};
  // A later occurrence of an option wins (scripts pass defaults, users append overrides).
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--corpus", a.corpus, "text files or directories (one sentence per line and blank "
                 "lines between documents, or prose)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--corpus-format", a.corpus_format, "auto | sentences | prose")
      ->check(CLI::IsMember({"auto", "sentences", "prose"}));
  app.add_option("--vocab", a.vocab, "WordPiece vocab.txt (default: learned from the corpus)");
  app.add_option("--vocab-size", a.vocab_size, "size of the learned vocabulary")
      ->check(CLI::Range(6, 1 << 20));
  app.add_option("--data", a.data, "pretraining data file (generated when absent; default: cached "
                 "under OUT/cache by content)");
  app.add_option("--preset", a.preset, "tiny | mini | small | base | large | peer")
      ->check(CLI::IsMember(bert::BertConfig::preset_names()));
  app.add_option("--stage", a.stage, "ZeRO stage")->check(CLI::Range(0, 3));
  app.add_option("--precision", a.precision, "fp32 | fp16 | bf16")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  app.add_option("--batch-size", a.batch_size, "sequences per rank per micro-step")
      ->check(CLI::PositiveNumber);
  app.add_option("--grad-accum", a.grad_accum, "micro-steps per optimizer step")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", a.lr, "peak learning rate (AdamW)")->check(CLI::PositiveNumber);
  app.add_option("--warmup-steps", a.warmup_steps, "linear warm-up steps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", a.steps, "optimizer steps (the LR decays linearly to 0 here)")
      ->check(CLI::PositiveNumber);
  app.add_option("--weight-decay", a.weight_decay, "AdamW decoupled weight decay (not on bias and "
                 "LayerNorm)")->check(CLI::NonNegativeNumber);
  app.add_option("--timeout", a.timeout_s, "seconds a rank waits for the others in any collective "
                 "before the job ends with an error (default: SHARDOPT_TIMEOUT, else 600)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-grad-norm", a.max_grad_norm, "global gradient clipping, 0 disables")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-every", a.checkpoint_every, "save a checkpoint into OUT/checkpoint "
                 "every N steps (atomically: the previous one stays until the new one is complete)")
      ->check(CLI::NonNegativeNumber);
  auto* resume = app.add_option("--resume", a.resume, "continue from a checkpoint: optimizer, "
                                "step, data position, RNG and LR schedule (default directory: "
                                "OUT/checkpoint)")
                     ->expected(0, 1);
  app.add_option("--stop-after", a.stop_after, "stop after N steps of this run, as if preempted "
                 "(the LR schedule still spans --steps; --resume continues)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--out", a.out, "output directory (metrics.jsonl, loss.png, summary.json, cache/)");
  app.add_option("--seed", a.seed, "seed of the data, the model and the batch order");
  app.add_option("--max-seq-length", a.max_seq_length)->check(CLI::Range(8, 512));
  app.add_option("--max-predictions", a.max_predictions, "masked positions per sequence at most")
      ->check(CLI::PositiveNumber);
  app.add_option("--masked-lm-prob", a.masked_lm_prob)->check(CLI::Range(0.0, 1.0));
  app.add_option("--short-seq-prob", a.short_seq_prob)->check(CLI::Range(0.0, 1.0));
  app.add_option("--dupe-factor", a.dupe_factor, "times each document is masked differently")
      ->check(CLI::PositiveNumber);
  app.add_flag("--whole-word-mask", a.whole_word_mask, "mask all pieces of a word together");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout (default: 0.1)");
  app.add_option("--threads", a.threads, "torch threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--log-every", a.log_every, "steps between progress lines when not on a tty")
      ->check(CLI::PositiveNumber);
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size in MiB (0: the library's default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--progress", a.progress, "tty: one line rewritten with \\r; lines: a line every "
                 "--log-every steps; auto: tty when stdout is a terminal")
      ->check(CLI::IsMember({"auto", "tty", "lines"}));
  app.add_flag("--synthetic", a.synthetic, "random-token MLM batches (uniform over the preset's "
               "vocabulary, --masked-lm-prob masked, --max-seq-length long), no corpus; NSP off");
  app.add_flag("--no-nsp", a.no_nsp, "no pooler and next-sentence head: MLM only");
  app.add_option("--mlm-positions", a.mlm_positions, "masked: MLM logits only at masked positions "
                 "(Google); all: at every position (Hugging Face); preset: the preset's choice")
      ->check(CLI::IsMember({"masked", "all", "preset"}));
  app.add_option("--timing-warmup", a.timing_warmup, "first steps left out of the timing medians "
                 "in summary.json")->check(CLI::NonNegativeNumber);
  app.add_option("--block-cache-mb", a.block_cache_mb, "keep freed tensor blocks of >= 32 MiB (up "
                 "to this many MiB) for the next allocation of their size; 0: off")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-overlap", a.no_overlap, "reduce gradients after backward instead of from its "
               "hooks (ZeroOptions::overlap_comm = false)");
  app.add_flag("--no-plot", a.no_plot, "do not draw loss.png");
  app.add_flag("--check-loss-decrease", a.check_loss_decrease,
               "exit non-zero unless the mean of the last 5 losses is below that of the first 5");
  app.add_option("--golden", a.golden, "compare the per-step loss with this \"step loss\" file; "
                 "exit non-zero beyond --golden-tol");
  app.add_option("--golden-tol", a.golden_tol, "largest absolute loss difference to the golden file")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--write-golden", a.write_golden, "write the per-step losses as a golden file");
  // Data preparation alone, one process (the trainer does both itself when their files are absent).
  app.fallthrough();
  std::string output;
  auto* build_vocab = app.add_subcommand(
      "build-vocab", "learn a WordPiece vocab.txt of --vocab-size tokens from --corpus, then exit");
  build_vocab->add_option("--output,-o", output, "vocab.txt to write")->required();
  auto* create_data = app.add_subcommand(
      "create-data", "write the pretraining data file of --corpus with --vocab and the masking "
                     "options, then exit");
  create_data->add_option("--output,-o", output, "data file to write")->required();
  CLI11_PARSE(app, argc, argv);
  a.resume_requested = resume->count() > 0;
  try {
    if (build_vocab->parsed()) return build_vocab_command(a, output);
    if (create_data->parsed()) return create_data_command(a, output);
    return run(a);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nbert_pretrain: error: {}\n", e.what());
    return 1;
  }
}
