// bert_pretrain: BERT pretraining (MLM + NSP) with shardopt's ZeRO optimizer, one process per rank
// (mpirun -np N). Rank 0 prepares the vocabulary, the data and its held-out split once (cached),
// every rank trains on its slice of each global batch and evaluates its share of the eval set,
// rank 0 logs metrics.jsonl, plots the curves and writes summary.json; the final state is always
// checkpointed. --synthetic trains on random tokens instead (benchmarks: bench/compare_peers.sh).
#include <sys/resource.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "block_cache.hpp"
#include "checkpointing.hpp"
#include "data.hpp"
#include "evaluate.hpp"
#include "model.hpp"
#include "options.hpp"
#include "prepare.hpp"
#include "prepare_on_rank0.hpp"
#include "pretrained.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.hpp"
#include "tokenizer.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using bert::Args;

namespace {

// An error in the user's input, found after start-up: printed as one line, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
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

// Where batches come from: the pretraining file of bert::prepare_on_rank0, or random tokens.
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

// --export-hf DIR (and OUT/hf with --save-model): the fp32 master parameters of `checkpoint` when
// given, else the model's own, gathered (collective: every rank calls it); rank 0 writes.
void export_model(const Args& a, shardopt::DistributedOptimizer& opt, bert::BertForPreTraining& model,
                  const bert::BertConfig& config, const bert::Prepared& prepared,
                  const std::string& checkpoint, bool lead) {
  const std::string dir = a.export_hf.empty() ? (fs::path(a.out) / "hf").string() : a.export_hf;
  bert::StateDict params;
  if (checkpoint.empty()) {
    opt.gather_full_parameters();
    if (lead) params = model->named_parameters();
  } else if (lead) {
    params = shardopt::read_full_state(checkpoint).params;
  }
  if (!lead) return;
  const auto files = bert::export_hf(dir, config, params, prepared.vocab_path, prepared.lower_case);
  fmt::print("[bert] Hugging Face export: {} ({})\n", dir, fmt::join(files, ", "));
}

int run(const Args& a) {
  shardopt::InitOptions init;  // --timeout, else SHARDOPT_TIMEOUT, else the library's default
  if (a.timeout_s > 0) init.timeout = shardopt::Duration(static_cast<int64_t>(a.timeout_s * 1e3));
  const torch::Device device(a.device);
  init.device = device.is_cuda() ? "cuda" : "cpu";
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
  std::vector<std::string> ignored_keys;  // of --bert-config, reported below
  bert::BertConfig config = a.bert_config.empty()
                                ? bert::BertConfig::preset(a.preset)
                                : bert::BertConfig::load(a.bert_config, &ignored_keys);
  BatchSource loader;
  loader.args = &a;
  loader.rank = rank;
  bert::Prepared prepared;
  std::unique_ptr<bert::PretrainingData> eval_data;
  int64_t max_seq_length = a.max_seq_length;
  if (a.synthetic) {
    loader.vocab_size = config.vocab_size;  // the preset's (BERT's 30522)
    config.nsp = false;                     // random tokens have no sentence pairs
  } else {
    prepared = bert::prepare_on_rank0(a, *comm);
    if (lead) {
      for (const auto& n : prepared.notes) fmt::print("[bert] {}\n", n);
      for (const auto& w : prepared.warnings) fmt::print("[bert] warning: {}\n", w);
      fmt::print("[bert] tokenizer: {}\n", prepared.lower_case
                                               ? "lower-cased, accents stripped (--cased to keep them)"
                                               : "cased (--lower-case to fold)");
    }
    const bert::Vocab vocab = bert::Vocab::load(prepared.vocab_path);
    loader.data = std::make_unique<bert::PretrainingData>(prepared.data_path);
    if (!prepared.eval_path.empty()) {
      eval_data = std::make_unique<bert::PretrainingData>(prepared.eval_path);
    }
    loader.loader = std::make_unique<bert::BatchLoader>(*loader.data, a.batch_size, rank, world, a.seed);
    if (a.bert_config.empty()) {
      config.vocab_size = vocab.size();
    } else if (config.vocab_size < vocab.size()) {
      throw UsageError(fmt::format("--bert-config: vocab_size {} is smaller than the vocabulary's {} "
                                   "tokens ({})", config.vocab_size, vocab.size(), prepared.vocab_path));
    } else if (lead && config.vocab_size > vocab.size()) {
      fmt::print("[bert] note: vocab_size {} of --bert-config exceeds the vocabulary's {} tokens: "
                 "the extra rows are never used\n", config.vocab_size, vocab.size());
    }
    max_seq_length = loader.data->header().max_seq_length;
  }
  if (a.no_nsp) config.nsp = false;
  if (a.mlm_positions != "preset") config.mlm_all_positions = a.mlm_positions == "all";
  if (a.dropout >= 0) config.hidden_dropout = config.attention_dropout = a.dropout;
  if (max_seq_length > config.max_position_embeddings) {
    throw UsageError(fmt::format("--max-seq-length: {} exceeds the model's {} positions",
                                 max_seq_length, config.max_position_embeddings));
  }
  torch::manual_seed(a.seed);  // identical initial weights everywhere (rank 0's are broadcast too)
  bert::BertForPreTraining model(config);
  if (lead) {
    std::ofstream(fs::path(a.out) / "config.json") << config.to_hf_json().dump(2) << '\n';
    if (!ignored_keys.empty()) {
      fmt::print("[bert] --bert-config: keys that do not change the model, ignored: {}\n",
                 fmt::join(ignored_keys, ", "));
    }
  }
  if (!a.init_checkpoint.empty()) {
    std::string kind;
    const auto state = bert::read_init_checkpoint(a.init_checkpoint, &kind);
    try {
      const auto report = bert::load_pretrained(model, state);
      if (lead) bert::print_init_report(a.init_checkpoint, kind, report);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }
  model->to(device);
  // The optimizer casts the parameters to the compute dtype itself and keeps the fp32 master
  // copy of these fp32 initial values.
  const auto precision = shardopt::parse_precision(a.precision);
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
  zo.shard_group_size = a.shard_group_size;  // hybrid sharding: shard within, replicate across
  zo.reduce_dtype = shardopt::parse_precision(a.reduce_dtype);
  const double beta1 = a.adam_betas.at(0), beta2 = a.adam_betas.at(1), eps = bert::adam_eps(a);
  const shardopt::Rule rule =
      a.optimizer == "lamb"
          ? shardopt::Rule(shardopt::Lamb(a.lr).beta1(beta1).beta2(beta2).eps(eps).weight_decay(
                a.weight_decay))
          : shardopt::Rule(shardopt::AdamW(a.lr).beta1(beta1).beta2(beta2).eps(eps).weight_decay(
                a.weight_decay));
  shardopt::DistributedOptimizer opt(groups, rule, comm, zo);

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
    fmt::print("[bert] training: {} ranks ({}) on {}, ZeRO stage {}, {}, global batch {} = {} "
               "rows/rank x {} ranks x {} micro-steps, {} steps ({}), {} (betas {}, {}, eps {}, "
               "weight decay {}), lr {} (warm-up {}, then {}), {} thread(s)/rank\n",
               world, a.shard_group_size > 0
                   ? fmt::format("{}, hybrid: shard groups of {}", comm->backend(),
                                 a.shard_group_size)
                   : comm->backend(),
               a.device, a.stage, a.precision, global_batch, a.batch_size, world, a.grad_accum,
               a.steps, epochs, a.optimizer, beta1, beta2, eps, a.weight_decay, a.lr,
               a.warmup_steps, a.lr_schedule, a.threads);
    std::fflush(stdout);
  }

  std::ofstream metrics;
  const fs::path metrics_path = fs::path(a.out) / "metrics.jsonl";
  if (lead && !a.eval_only) {
    metrics.open(metrics_path, a.resume_requested ? std::ios::app : std::ios::trunc);
    if (!metrics) throw std::runtime_error("cannot write " + metrics_path.string());
  }
  const bool tty = lead && bert::progress_on_terminal(a.progress);
  std::vector<double> losses;
  std::vector<std::vector<double>> timings;  // rank 0: [step of this run][rank * kTimings + Timing]
  double train_s = 0;
  int64_t tokens_total = 0;
  nlohmann::json last, first_eval, last_eval;

  // ---- checkpoints: --resume restores; --checkpoint-every and the end of the run save ----------
  const fs::path checkpoint_dir = fs::path(a.out) / "checkpoint";
  nlohmann::json schedule = {{"steps", a.steps}, {"warmup-steps", a.warmup_steps},
                             {"lr", a.lr}, {"seed", a.seed}, {"batch-size", a.batch_size},
                             {"grad-accum", a.grad_accum}, {"ranks", world}};
  schedule["optimizer"] = a.optimizer;
  schedule["lr-schedule"] = a.lr_schedule;
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
      if (!a.eval_only) {
        bert::truncate_metrics(metrics_path, run_state.step);
        metrics.close();
        metrics.open(metrics_path, std::ios::app);
      }
    }
  }
  const int64_t start_step = run_state.step;
  int64_t data_position = run_state.data_position;
  int64_t last_saved = -1;
  auto save = [&](int64_t done) {
    const auto t0 = Clock::now();
    if (!opt.parameters_finite()) {  // never replace the last good checkpoint with NaN/Inf
      if (lead) fmt::print("\n[bert] checkpoint: step {} NOT saved: NaN/Inf parameters\n", done);
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
  auto run_eval = [&](int64_t done) {
    const auto e = bert::evaluate(model, *eval_data, *comm, a.eval_batch_size);
    if (lead) fmt::print("{}{}\n", tty ? "\r\033[K" : "", e.line(done, config.nsp));
    nlohmann::json j = e.to_json();
    j["step"] = done;
    if (first_eval.is_null()) first_eval = j;
    last_eval = j;
    return j;
  };

  if (a.eval_only) {
    if (!eval_data) throw UsageError("--eval-only: there is no eval data (--eval-data FILE)");
    run_eval(start_step);
    if (lead) {
      std::ofstream(fs::path(a.out) / "eval.json") << last_eval.dump(2) << '\n';
      fmt::print("[bert] eval results: {}\n", (fs::path(a.out) / "eval.json").string());
    }
    if (!a.dump_logits.empty()) {
      bert::dump_logits(model, *eval_data, a.eval_batch_size, device, lead ? a.dump_logits : "");
      if (lead) fmt::print("[bert] logits of the first eval batch: {}\n", a.dump_logits);
    }
    if (!a.export_hf.empty()) export_model(a, opt, model, config, prepared, "", lead);
    return 0;
  }

  int64_t step = start_step;
  // Progress-line rates: over the training time since the previous line (the whole run on a tty).
  int64_t shown_step = start_step, shown_samples = 0, shown_tokens = 0;
  double shown_train_s = train_s;
  int64_t run_samples = 0, run_tokens = 0;
  for (; step < a.steps; ++step) {
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
      const bert::BertInputs inputs = bert::to_inputs(batch, device);
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
    std::vector<double> local(bert::kTimings);
    local[bert::kMemory] = static_cast<double>(mem.total());
    local[bert::kStep] = step_s, local[bert::kFwd] = fwd_s, local[bert::kBwd] = bwd_s;
    local[bert::kOpt] = opt_s, local[bert::kCommWait] = stats.reduce_wait_s;
    local[bert::kUpdate] = stats.update_s, local[bert::kGather] = stats.gather_s;
    local[bert::kData] = data_s, local[bert::kCpu] = cpu_s;
    auto mine = torch::tensor(local, torch::kDouble);
    auto all = torch::zeros({bert::kTimings * world}, torch::kDouble);
    comm->all_gather(mine, all);
    const auto r = reduced.accessor<double, 1>();
    const double micro_n = static_cast<double>(world * a.grad_accum);
    const double loss = r[0] / micro_n;
    losses.push_back(loss);
    tokens_total += static_cast<int64_t>(r[7]);
    run_tokens += static_cast<int64_t>(r[7]);
    run_samples += global_batch;
    const int64_t done = step + 1;
    const bool last_of_run = done == a.steps || (a.stop_after > 0 && done - start_step == a.stop_after);
    nlohmann::json eval;
    if (eval_data && (last_of_run || (a.eval_every > 0 && done % a.eval_every == 0))) {
      eval = run_eval(done);  // collective: every rank
    }
    double slowest = 0;
    const auto* av = all.data_ptr<double>();
    for (int k = 0; k < world; ++k) slowest = std::max(slowest, av[k * bert::kTimings + bert::kStep]);
    train_s += slowest;  // the step's time is its slowest rank's: the same number on every rank
    // Counted from this run's start, so a resumed run keeps the same spacing. Rank 0 writes the
    // step's metrics line first: a published checkpoint never holds a step the log lacks.
    const bool save_now =
        a.checkpoint_every > 0 && (done - start_step) % a.checkpoint_every == 0 && !last_of_run;
    if (!lead) {
      if (save_now) save(done);
      continue;
    }

    std::vector<int64_t> mem_bytes;
    timings.emplace_back(av, av + bert::kTimings * world);
    for (int k = 0; k < world; ++k) {
      mem_bytes.push_back(static_cast<int64_t>(av[k * bert::kTimings + bert::kMemory]));
    }
    nlohmann::json j;
    j["step"] = done;
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
    const auto step_rates = bert::rates(1, global_batch, static_cast<int64_t>(r[7]), slowest);
    j["steps_per_s"] = step_rates.steps_per_s;  // global: the slowest rank's step time
    j["samples_per_s"] = step_rates.samples_per_s;
    j["tokens_per_s"] = step_rates.tokens_per_s;
    j["memory_bytes"] = mem_bytes;
    j["memory_rank0"] = {{"params", mem.param_bytes},
                         {"grads", mem.grad_bytes},
                         {"optimizer_state", mem.optimizer_state_bytes},
                         {"buffers", mem.buffer_bytes}};
    if (!eval.is_null()) j["eval"] = eval;
    metrics << j.dump() << '\n';
    metrics.flush();
    last = j;
    if (save_now) save(done);

    const bool show = tty || done % a.log_every == 0 || step == start_step || last_of_run;
    if (show) {
      const auto shown = tty ? bert::rates(done - start_step, run_samples, run_tokens,
                                           train_s - run_state.train_s)
                             : bert::rates(done - shown_step, run_samples - shown_samples,
                                           run_tokens - shown_tokens, train_s - shown_train_s);
      shown_step = done, shown_samples = run_samples, shown_tokens = run_tokens;
      shown_train_s = train_s;
      const double per_step = (train_s - run_state.train_s) / static_cast<double>(done - start_step);
      const int64_t left = (a.stop_after > 0 ? std::min(a.steps, start_step + a.stop_after) : a.steps) - done;
      std::string mem_text;
      for (int k = 0; k < world; ++k) mem_text += fmt::format(" r{} {}", k, bert::human_bytes(mem_bytes[k]));
      const std::string line = fmt::format(
          "{}step {:>{}}/{} | loss {:.3f} | mlm {:.3f} acc {:.3f} | nsp {:.3f} acc {:.2f} | {} | "
          "lr {:.2e} | ETA {} | mem{}",
          tty ? bert::progress_bar(done, a.steps) + " " : "", done, std::to_string(a.steps).size(),
          a.steps, loss, j["mlm_loss"].get<double>(), j["mlm_acc"].get<double>(),
          j["nsp_loss"].get<double>(), j["nsp_acc"].get<double>(), bert::format_rates(shown), lr,
          bert::human_time(per_step * static_cast<double>(left)), mem_text);
      if (tty) fmt::print("\r\033[K{}", line);
      else fmt::print("{}\n", line);
      std::fflush(stdout);
    }
  }
  if (tty) fmt::print("\n");
  // The final state is always saved (a stopped run too: --resume continues it).
  if (step > start_step && last_saved != step) save(step);
  const fs::path model_path = fs::path(a.out) / "model.pt";
  if (a.save_model && step > start_step) {
    comm->barrier();
    if (lead) {
      shardopt::consolidate_checkpoint(checkpoint_dir.string(), model_path.string());
      fmt::print("[bert] model: {} (consolidated parameters of step {})\n", model_path.string(), step);
    }
  }
  if ((a.save_model || !a.export_hf.empty()) && step > start_step) {
    export_model(a, opt, model, config, prepared, last_saved == step ? checkpoint_dir.string() : "",
                 lead);
  }

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
    // Timing medians over this run's steps after --timing-warmup, per rank.
    const int64_t ran = step - start_step;
    const int64_t skip = std::min<int64_t>(a.timing_warmup, std::max<int64_t>(0, ran - 1));
    const auto timing = bert::summarize_timings(timings, world, skip, global_batch);
    std::vector<int64_t> rss, tensor_peak;
    for (int k = 0; k < world; ++k) {
      rss.push_back(static_cast<int64_t>(all_peaks[2 * k].item<double>()));
      tensor_peak.push_back(static_cast<int64_t>(all_peaks[2 * k + 1].item<double>()));
    }
    const size_t k = std::min<size_t>(5, losses.size());
    const double first = k ? std::accumulate(losses.begin(), losses.begin() + k, 0.0) / k : 0.0;
    const double final_ = k ? std::accumulate(losses.end() - k, losses.end(), 0.0) / k : 0.0;
    const auto overall = bert::rates(ran, ran * global_batch, run_tokens, train_s - run_state.train_s);
    nlohmann::json summary = {
        {"preset", a.preset}, {"parameters", model->num_parameters()}, {"ranks", world},
        {"stage", a.stage}, {"steps", a.steps}, {"step", step}, {"steps_this_run", ran},
        {"global_batch", global_batch}, {"first5_loss", first}, {"last5_loss", final_},
        {"train_s", train_s}, {"wall_s", seconds_since(t_start)}, {"tokens", tokens_total},
        {"steps_per_s", overall.steps_per_s}, {"samples_per_s", overall.samples_per_s},
        {"tokens_per_s", overall.tokens_per_s}, {"last", last},
        {"vocab", prepared.vocab_path}, {"data", prepared.data_path},
        {"eval_data", prepared.eval_path}, {"lower_case", prepared.lower_case},
        {"synthetic", a.synthetic}, {"nsp", config.nsp},
        {"mlm_all_positions", config.mlm_all_positions}, {"batch_size", a.batch_size},
        {"threads", a.threads}, {"timing", timing.json}, {"peak_rss_bytes", rss},
        {"peak_tensor_bytes", tensor_peak},
        {"checkpoint", last_saved >= 0 ? checkpoint_dir.string() : ""},
        {"model", a.save_model && ran > 0 ? model_path.string() : ""},
        {"model_state_rank0", last.value("memory_rank0", nlohmann::json::object())}};
    if (!last_eval.is_null()) {
      summary["eval"] = last_eval;
      summary["first_eval"] = first_eval;
      summary["nsp_above_baseline"] = last_eval["nsp_acc"].get<double>() - last_eval["nsp_baseline"].get<double>();
    }
    if (block_cache) {
      const auto c = block_cache->stats();
      summary["block_cache_rank0"] = {{"hits", c.hits}, {"misses", c.misses},
                                      {"peak_cached_bytes", c.peak_cached_bytes},
                                      {"dropped_unused", c.dropped_unused}};
    }
    std::ofstream(fs::path(a.out) / "summary.json") << summary.dump(2) << '\n';
    fmt::print("[bert] done: step {} of {} ({} steps in this run, {} of training, {} wall), loss "
               "{:.3f} -> {:.3f} (mean of first/last {}), {}\n",
               step, a.steps, ran, bert::human_time(train_s - run_state.train_s),
               bert::human_time(seconds_since(t_start)), first, final_, k, bert::format_rates(overall));
    if (!last_eval.is_null()) {
      std::string nsp;
      if (config.nsp) {
        nsp = fmt::format("; NSP acc {:.3f} vs majority baseline {:.3f} ({:+.3f})",
                          last_eval["nsp_acc"].get<double>(), last_eval["nsp_baseline"].get<double>(),
                          summary["nsp_above_baseline"].get<double>());
      }
      fmt::print("[bert] held-out eval ({} instances): MLM loss {:.3f} (step {}) -> {:.3f} (step {}), "
                 "MLM acc {:.3f}{}\n",
                 last_eval["instances"].get<int64_t>(), first_eval["mlm_loss"].get<double>(),
                 first_eval["step"].get<int64_t>(), last_eval["mlm_loss"].get<double>(),
                 last_eval["step"].get<int64_t>(), last_eval["mlm_acc"].get<double>(), nsp);
    }
    if (ran > 0) {
      const auto& t = timing.slowest;
      fmt::print("[bert] step time (median of steps {}-{}, slowest rank {}): {:.4f} s = data {:.4f} + "
                 "fwd {:.4f} + bwd {:.4f} + step() {:.4f} (comm wait {:.4f}, update {:.4f}, gather "
                 "{:.4f}); process CPU {:.4f} s/step\n",
                 start_step + skip + 1, step, timing.slowest_rank, timing.median_step_s,
                 t["data_s"].get<double>(), t["fwd_s"].get<double>(), t["bwd_s"].get<double>(),
                 t["opt_s"].get<double>(), t["comm_wait_s"].get<double>(),
                 t["update_s"].get<double>(), t["gather_s"].get<double>(), t["cpu_s"].get<double>());
    }
    std::string peaks_text;
    for (int q = 0; q < world; ++q) {
      peaks_text += fmt::format(" r{} {} ({} tensors)", q, bert::human_bytes(rss[q]),
                                bert::human_bytes(tensor_peak[q]));
    }
    fmt::print("[bert] peak RSS:{}\n", peaks_text);
    fmt::print("[bert] metrics: {}\n[bert] loss plot: {}\n[bert] summary: {}\n", metrics_path.string(),
               plot_note, (fs::path(a.out) / "summary.json").string());
    fmt::print("[bert] checkpoint: {}\n",
               last_saved >= 0 ? fmt::format("{} (step {}; --resume continues)",
                                             checkpoint_dir.string(), last_saved)
                               : std::string("none written (no step ran)"));
    if (!a.write_golden.empty()) bert::write_golden(a.write_golden, losses);
    if (!a.golden.empty() && !bert::matches_golden(a.golden, losses, a.golden_tol)) rc = 4;
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
  bert::Commands commands;
  CLI::App app{"BERT pretraining (MLM + NSP) with shardopt's ZeRO optimizer; run under mpirun -np N"};
  bert::add_options(app, a, commands);
  // Every rank parses and checks the same arguments and files; rank 0 alone says what is wrong.
  const bool speaker = bert::launcher_rank() == 0;
  auto usage_error = [&](const std::string& what) {
    if (speaker) fmt::print(stderr, "bert_pretrain: error: {}\n", what);
    return 2;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return speaker ? app.exit(e) : 0;
  } catch (const CLI::CallForAllHelp& e) {
    return speaker ? app.exit(e) : 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  }
  for (auto* opt : app.get_options()) {
    if (opt->get_name() == "--corpus") a.corpus_given = opt->count() > 0;
    if (opt->get_name() == "--resume") a.resume_requested = opt->count() > 0;
  }
  bert::resolve_args(a);
  if (const std::string why = bert::check_args(a, commands); !why.empty()) return usage_error(why);
  if (a.device != "cpu" && !torch::cuda::is_available()) {
    return usage_error(fmt::format("--device {}: no CUDA device is visible to this libtorch (a "
                                   "build without CUDA, or no GPU); use --device cpu", a.device));
  }
  try {
    if (commands.build_vocab->parsed()) return bert::build_vocab_command(a, commands.output);
    if (commands.create_data->parsed()) {
      return bert::create_data_command(a, commands.output, commands.eval_output);
    }
    return run(a);
  } catch (const UsageError& e) {
    std::fflush(stdout);
    return usage_error(e.what());
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nbert_pretrain: error: {}\n", e.what());
    return 1;
  }
}
