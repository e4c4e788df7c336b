// bert_pretrain: BERT pretraining (MLM + NSP) with shardopt's ZeRO optimizer, one process per rank
// (mpirun -np N). Rank 0 prepares the vocabulary, the data and its held-out split once (cached),
// every rank trains on its slice of each global batch and evaluates its share of the eval set,
// rank 0 logs metrics.jsonl, plots the curves and writes summary.json; the final state is always
// checkpointed. --synthetic trains on random tokens instead (benchmarks: bench/compare_peers.sh).
// The stages share a Run (run.hpp); what a run leaves behind is written by outputs.cpp.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "block_cache.hpp"
#include "checkpointing.hpp"
#include "data.hpp"
#include "evaluate.hpp"
#include "common/cli.hpp"
#include "metrics.hpp"
#include "model.hpp"
#include "options.hpp"
#include "outputs.hpp"
#include "prepare.hpp"
#include "prepare_on_rank0.hpp"
#include "pretrained.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "run.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.hpp"
#include "test_fault.hpp"
#include "tokenizer.hpp"

namespace fs = std::filesystem;
using bert::Args;
using bert::Clock;
using bert::Run;
using bert::UsageError;
using bert::seconds_since;

namespace {

// CPU seconds of the whole process (every thread): on a shared machine a steadier measure of the
// work a step costs than wall time.
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---- set-up: threads, output folder, memory accounting ------------------------------------------
void set_up(Run& r) {
  at::set_num_threads(r.a.threads);
  if (r.lead) fs::create_directories(r.a.out);
  // Note [Why the trainer caches blocks] (block_cache.hpp): blocks over glibc's largest mmap
  // threshold (32 MiB), which it would map and unmap on every allocation. The tracker above the
  // cache counts live tensor storage only (peak reported in summary.json).
  if (r.a.block_cache_mb > 0) {
    r.block_cache = std::make_unique<bert::ScopedBlockCache>(
        int64_t{32} << 20, static_cast<int64_t>(r.a.block_cache_mb * (1 << 20)));
  }
  r.tracking.emplace();
  try {
    r.groups = shardopt::make_parallel_groups(r.comm, shardopt::ParallelLayout{r.a.tp, r.a.pp, 0});
  } catch (const shardopt::Error& e) {
    throw UsageError(fmt::format("--tp {} --pp {}: {}", r.a.tp, r.a.pp, e.what()));
  }
  r.dp = r.groups.dp;
  r.loader.rank = r.groups.dp_rank;
  r.checkpoint_dir = fs::path(r.a.out) / "checkpoint";  // the grid's (one commit for every folder)
  r.metrics_path = fs::path(r.a.out) / "metrics.jsonl";
}

// ---- data: the model's config, the vocabulary, the training and eval data -----------------------
void load_data(Run& r) {
  const Args& a = r.a;
  std::vector<std::string> ignored_keys;
  r.config = a.bert_config.empty() ? bert::BertConfig::preset(a.preset)
                                   : bert::BertConfig::load(a.bert_config, &ignored_keys);
  if (r.lead && !ignored_keys.empty()) {
    fmt::print("[bert] --bert-config: keys that do not change the model, ignored: {}\n",
               fmt::join(ignored_keys, ", "));
  }
  auto& config = r.config;
  r.loader.args = &a;
  r.max_seq_length = a.max_seq_length;
  if (a.synthetic) {
    r.loader.vocab_size = config.vocab_size;  // the config's (BERT's 30522)
    config.nsp = false;                       // random tokens have no sentence pairs
  } else {
    r.prepared = bert::prepare_on_rank0(a, *r.comm);
    if (r.lead) {
      for (const auto& n : r.prepared.notes) fmt::print("[bert] {}\n", n);
      for (const auto& w : r.prepared.warnings) fmt::print("[bert] warning: {}\n", w);
      fmt::print("[bert] tokenizer: {}\n", r.prepared.lower_case
                                               ? "lower-cased, accents stripped (--cased to keep them)"
                                               : "cased (--lower-case to fold)");
    }
    const bert::Vocab vocab = bert::Vocab::load(r.prepared.vocab_path);
    r.loader.data = std::make_unique<bert::PretrainingData>(r.prepared.data_path);
    if (!r.prepared.eval_path.empty()) {
      r.eval_data = std::make_unique<bert::PretrainingData>(r.prepared.eval_path);
    }
    r.loader.loader =
        std::make_unique<bert::BatchLoader>(*r.loader.data, a.batch_size, r.dp->rank(), r.dp->size(), a.seed);
    if (a.bert_config.empty()) {
      config.vocab_size = vocab.size();
    } else if (config.vocab_size < vocab.size()) {
      throw UsageError(fmt::format("--bert-config: vocab_size {} is smaller than the vocabulary's {} "
                                   "tokens ({})", config.vocab_size, vocab.size(), r.prepared.vocab_path));
    } else if (r.lead && config.vocab_size > vocab.size()) {
      fmt::print("[bert] note: vocab_size {} of --bert-config exceeds the vocabulary's {} tokens: "
                 "the extra rows are never used\n", config.vocab_size, vocab.size());
    }
    r.max_seq_length = r.loader.data->header().max_seq_length;
  }
  if (a.no_nsp) config.nsp = false;
  if (a.mlm_positions != "preset") config.mlm_all_positions = a.mlm_positions == "all";
  config.attn_implementation = bert::resolve_attn_implementation(a.attn_implementation);
  if (a.dropout >= 0) config.hidden_dropout = config.attention_dropout = a.dropout;
  if (r.max_seq_length > config.max_position_embeddings) {
    throw UsageError(fmt::format("--max-seq-length: {} exceeds the model's {} positions",
                                 r.max_seq_length, config.max_position_embeddings));
  }
}

// ---- model and optimizer ------------------------------------------------------------------------
shardopt::Rule optimizer_rule(const Args& a) {
  const double beta1 = a.adam_betas.at(0), beta2 = a.adam_betas.at(1), eps = bert::adam_eps(a);
  if (a.optimizer == "lamb") {
    return shardopt::Lamb(a.lr).beta1(beta1).beta2(beta2).eps(eps).weight_decay(a.weight_decay);
  }
  if (a.optimizer == "adafactor") return shardopt::Adafactor(a.lr).weight_decay(a.weight_decay);
  if (a.optimizer == "adamw8bit") {
    return shardopt::AdamW8bit(a.lr).beta1(beta1).beta2(beta2).eps(eps).weight_decay(a.weight_decay);
  }
  if (a.optimizer == "muon") {
    // Moonshot's setting: the update's RMS matched to AdamW's, so --lr and --weight-decay serve
    // both the matrices (Muon) and the rest (AdamW with --adam-betas, --adam-eps).
    return shardopt::Muon(a.lr).weight_decay(a.weight_decay)
        .adjust_lr_fn(shardopt::Muon::kMatchRmsAdamW).adamw_beta1(beta1).adamw_beta2(beta2)
        .adamw_eps(eps);
  }
  return shardopt::AdamW(a.lr).beta1(beta1).beta2(beta2).eps(eps).weight_decay(a.weight_decay);
}

// --optimizer muon: the encoder's matrices in group 0 (Muon), the embeddings and the MLM head's
// transform in group 1 and biases and LayerNorm in group 2 (AdamW, as torch.optim.Muon's docs
// recommend for embeddings, heads, biases and norms; group 2 without weight decay).
// Empty groups (a pipeline stage without embeddings) are left out; `muon[g]`: group g runs Muon.
std::vector<shardopt::ParamGroup> muon_groups(
    const torch::OrderedDict<std::string, at::Tensor>& params, std::vector<bool>* muon) {
  std::vector<shardopt::ParamGroup> groups(3);
  groups[2].weight_decay = 0.0;
  for (const auto& p : params) {
    const std::string& n = p.key();
    const bool no_decay = n.find("bias") != std::string::npos || n.find("LayerNorm") != std::string::npos;
    const bool encoder_matrix = p.value().dim() == 2 && n.find("encoder") != std::string::npos;
    groups[no_decay ? 2 : encoder_matrix ? 0 : 1].params.push_back({n, p.value()});
  }
  std::vector<shardopt::ParamGroup> kept;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].params.empty()) continue;
    kept.push_back(std::move(groups[g]));
    muon->push_back(g == 0);
  }
  return kept;
}

void print_plan(const Run& r) {
  const Args& a = r.a;
  const auto& c = r.config;
  fmt::print("[bert] model: {} ({} layers, hidden {}, {} heads, {}), {:.2f} M parameters, vocab {}, "
             "{}, MLM logits at {} positions, {} attention\n",
             a.bert_config.empty() ? "BERT-" + c.name : "BERT of " + a.bert_config, c.num_layers,
             c.hidden_size, c.num_heads, c.hidden_act, r.model->num_parameters() / 1e6, c.vocab_size,
             c.nsp ? "MLM + NSP" : "MLM only", c.mlm_all_positions ? "all" : "masked",
             c.attn_implementation);
  const auto* data = r.loader.data.get();
  const std::string epochs =
      data ? fmt::format("{:.2f} epochs of {} instances",
                         static_cast<double>(a.steps * r.global_batch) / static_cast<double>(data->size()),
                         data->size())
           : fmt::format("synthetic: random tokens, {} per row", r.max_seq_length);
  const std::string backend =
      a.shard_group_size > 0
          ? fmt::format("{}, hybrid: shard groups of {}", r.comm->backend(), a.shard_group_size)
          : r.comm->backend();
  const std::string layout =
      r.tp() > 1 || r.pp() > 1
          ? fmt::format(" = {}{}", r.groups.layout.to_string(),
                        a.sequence_parallel ? " with sequence parallelism" : "")
          : "";
  fmt::print("[bert] training: {} ranks{} ({}) on {}, ZeRO stage {}{}, {}, global batch {} = {} rows/rank "
             "x {} {}ranks x {} micro-steps, {} steps ({}), {} ({}weight decay {}), "
             "lr {} (warm-up {}, then {}), {} thread(s)/rank\n",
             r.world, layout, backend, a.device, a.stage,
             fmt::format("{}{}", a.stage == 3 ? fmt::format(" ({} units)", a.units) : "",
                         a.defer_reduction ? ", reduction deferred to the last micro-step" : ""),
             a.precision, r.global_batch, a.batch_size, r.dp->size(), r.tp() > 1 || r.pp() > 1 ? "data-parallel " : "",
             a.grad_accum, a.steps, epochs, a.optimizer,
             a.optimizer == "adafactor"
                 ? std::string("torch's beta2_decay -0.8, eps (None, 1e-3), d 1, ")
                 : fmt::format("betas {}, {}, eps {}, ", a.adam_betas.at(0), a.adam_betas.at(1),
                               bert::adam_eps(a)),
             a.weight_decay, a.lr, a.warmup_steps, a.lr_schedule, a.threads);
  if (r.pipeline) {
    fmt::print("[bert] pipeline: {} schedule over {} ranks{}, {} micro-batches a step; {}\n", a.schedule,
               r.pp(), a.virtual_stages > 1 ? fmt::format(" x {} chunks", a.virtual_stages) : "",
               a.grad_accum, bert::describe(r.pipeline->stages()));
  }
  std::fflush(stdout);
}

// The units stage 3 derives from the parameter names (what the optimizer computes from the same
// names, numels and tensors; a tensor under two names would count once).
void print_automatic_units(const torch::OrderedDict<std::string, at::Tensor>& params,
                           const shardopt::UnitPolicy& policy) {
  std::vector<std::string> names;
  std::vector<int64_t> numels, ids;
  std::map<const void*, int64_t> id_of;
  for (const auto& p : params) {
    if (!p.value().requires_grad()) continue;
    names.push_back(p.key());
    numels.push_back(p.value().numel());
    ids.push_back(
        id_of.emplace(p.value().unsafeGetTensorImpl(), static_cast<int64_t>(id_of.size())).first->second);
  }
  const auto derived = shardopt::derive_units(names, numels, ids, policy);
  std::vector<std::string> units;
  for (size_t u = 0; u < derived.names.size(); ++u) {
    int64_t n = 0;
    for (int i : derived.members[u]) n += numels[i];
    units.push_back(fmt::format("{} ({:.3g} M)", derived.names[u], n / 1e6));
  }
  fmt::print("[bert] automatic units: {}; kept gathered for good (under {} elements, within {:g}% "
             "of the model): {}\n",
             fmt::join(units, ", "), policy.persist_below, 100 * policy.persist_share,
             derived.persistent.empty() ? "none" : fmt::format("{}", fmt::join(derived.persistent, ", ")));
}

void build_model(Run& r) {
  const Args& a = r.a;
  torch::manual_seed(a.seed);  // identical initial weights everywhere (rank 0's are broadcast too)
  // --units auto: no Units in the model; the optimizer derives them (shardopt/unit_policy.hpp).
  const bool automatic = a.units == "auto";
  bert::ModelParallel mp;
  // Megatron's offset: each pipeline stage draws its own dropout masks (the layers of two stages
  // are different layers); the weights are drawn from a.seed everywhere.
  const uint64_t dropout_seed = a.seed + (r.pp() > 1 ? 100 * static_cast<uint64_t>(r.groups.pp_rank) : 0);
  if (r.tp() > 1) {
    mp.tp = {r.groups.tp, a.sequence_parallel};
    mp.rng = std::make_shared<shardopt::tp::RngTracker>(dropout_seed, r.groups.tp_rank);
  }
  try {
    r.model = bert::BertForPreTraining(r.config, /*declare_units=*/!automatic, mp);
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("--tp {}: {}", a.tp, e.what()));
  }
  r.model->set_recompute(a.recompute);
  if (r.lead) std::ofstream(fs::path(a.out) / "config.json") << r.config.to_hf_json().dump(2) << '\n';
  if (!a.init_checkpoint.empty()) {
    try {
      std::string kind;
      // Under --tp the weights load into the unsplit model, and this rank keeps its slices.
      bert::BertForPreTraining target =
          r.tp() > 1 ? bert::BertForPreTraining(r.config, /*declare_units=*/false) : r.model;
      const auto report = bert::load_pretrained(target, bert::read_init_checkpoint(a.init_checkpoint, &kind));
      if (r.tp() > 1) r.model->load_unsplit(target->named_parameters());
      if (r.lead) bert::print_init_report(a.init_checkpoint, kind, report);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }
  r.model->to(r.device);
  r.model->train();
  if (r.pp() > 1) torch::manual_seed(dropout_seed);
  if (r.pp() > 1) {  // Note [Pipelined BERT]: this rank's stages; the others' parameters freed
    try {
      r.pipeline = std::make_unique<bert::PipelineStages>(
          r.model, r.groups,
          shardopt::compile_schedule(shardopt::parse_schedule_kind(a.schedule), r.pp(),
                                     a.grad_accum, a.virtual_stages),
          r.config.num_layers);
    } catch (const std::exception& e) {
      throw UsageError(e.what());
    }
  }
  const auto held = [&](const std::string& name) { return !r.pipeline || r.pipeline->holds(name); };
  shardopt::ZeroOptions zo;
  zo.stage = shardopt::stage_from_int(a.stage);
  if (!automatic) zo.units = r.model->units();  // stage 3 gathers one encoder layer at a time
  // Under a pipeline run_pipeline tells the optimizer the step's passes (Note [Pipeline
  // handshake]).
  if (r.pp() == 1) zo.grad_accumulation_steps = a.grad_accum;
  zo.max_grad_norm = a.max_grad_norm;
  zo.timeout = r.init.timeout;
  // The optimizer casts the parameters to the compute dtype itself and keeps the fp32 master
  // copy of these fp32 initial values.
  zo.precision = shardopt::parse_precision(a.precision);
  if (a.bucket_mb > 0) zo.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  zo.overlap_comm = !a.no_overlap;
  zo.defer_reduction = a.defer_reduction;
  zo.shard_group_size = a.shard_group_size;  // hybrid sharding: shard within, replicate across
  zo.reduce_dtype = shardopt::parse_precision(a.reduce_dtype);
  // The clipping norm and the non-finite check over the whole grid, the tied word embedding's two
  // copies (pipelines): the parameters' records say which are split and which are tied (Note
  // [Split records] in shardopt/tensor_parallel.hpp; mark_pipeline_shared).
  zo.grid = r.groups;
  torch::OrderedDict<std::string, at::Tensor> params;
  for (const auto& p : r.model->named_parameters()) {
    if (held(p.key())) params.insert(p.key(), p.value());
  }
  // BERT: no weight decay on biases and LayerNorm.
  std::vector<bool> muon;
  auto groups = a.optimizer == "muon" ? muon_groups(params, &muon)
                                      : shardopt::weight_decay_groups(params, [](const std::string& n) {
                                          return n.find("bias") != std::string::npos ||
                                                 n.find("LayerNorm") != std::string::npos;
                                        });
  r.opt = std::make_unique<shardopt::DistributedOptimizer>(groups, optimizer_rule(a), r.dp, zo);
  if (a.optimizer == "muon") {
    for (size_t g = 0; g < groups.size(); ++g) {
      if (muon[g]) continue;
      auto rule = std::get<shardopt::Muon>(optimizer_rule(a)).use_muon(false);
      if (groups[g].weight_decay) rule.weight_decay(*groups[g].weight_decay);
      r.opt->set_group_rule(g, rule);
    }
  }
  r.global_batch = a.batch_size * r.dp->size() * a.grad_accum;
  r.state.rows_per_position = a.batch_size * r.dp->size();
  if (r.lead) print_plan(r);
  if (r.lead && automatic) print_automatic_units(params, zo.unit_policy);
}

// ---- checkpoints: --resume restores (outputs.cpp saves) ----------------------------------------
void restore(Run& r) {
  const Args& a = r.a;
  r.schedule = {{"steps", a.steps}, {"warmup-steps", a.warmup_steps}, {"lr", a.lr},
                {"seed", a.seed}, {"batch-size", a.batch_size},
                // rows per step (batch x data-parallel ranks x micro-batches): a layout may change
                // its factors and continue the same trajectory, not the product
                {"global-batch", r.global_batch}, {"optimizer", a.optimizer}, {"lr-schedule", a.lr_schedule}};
  // --snapshot-every: the newest snapshot in host memory comes first (Note [Snapshots in memory]
  // in shardopt/snapshot.hpp); without one, a run that keeps snapshots continues from
  // OUT/checkpoint when there is one, as --resume does (a restart by scripts/shardopt-run).
  std::optional<shardopt::TrainerState> from_memory;
  shardopt::RestoreReport memory;
  if (a.snapshot_every > 0 && !a.eval_only) {
    r.snapshots = std::make_unique<shardopt::MemorySnapshots>(*r.opt, r.comm, bert::snapshot_options(a, r.rank));
    from_memory = r.snapshots->restore(&memory);
    if (r.lead && !from_memory && memory.reason.rfind("no snapshot", 0) != 0) {
      fmt::print("[bert] snapshot: not restored: {}\n", memory.reason);
    }
  }
  const fs::path own_checkpoint = fs::path(a.out) / "checkpoint";
  const bool resume = !from_memory && (a.resume_requested ||
                                       (a.snapshot_every > 0 && (fs::exists(own_checkpoint / "commit.json") ||
                                                                 fs::exists(own_checkpoint / "manifest.json"))));
  shardopt::agree_on_errors(*r.comm, "opening the metrics log", [&] {
    if (!r.lead || a.eval_only) return;
    r.metrics.open(r.metrics_path, from_memory || resume ? std::ios::app : std::ios::trunc);
    if (!r.metrics) throw std::runtime_error("cannot write " + r.metrics_path.string());
  });
  if (from_memory) {
    const auto notes = bert::restore_run_state(*from_memory, r.schedule, &r.state, true);
    const auto tp_rng = from_memory->tensors.find("tp_dropout_rng");
    if (const auto& rng = r.model->model_parallel().rng; rng && tp_rng != from_memory->tensors.end()) {
      rng->set_state(tp_rng->second);
    }
    r.restore_s = memory.seconds;
    shardopt::agree_on_errors(*r.comm, "resuming the metrics log", [&] {
      if (!r.lead) return;
      std::string from;
      if (memory.saved_world != r.world) {  // Note [Snapshots at another world size]
        from = fmt::format("saved by {} ranks, resharded to {}; {} records from buddies' copies",
                           memory.saved_world, r.world, memory.from_buddy);
      } else if (memory.from_buddy == 0) {
        from = "every rank's own copy";
      } else {
        from = fmt::format("{} ranks' copies sent by their buddies", memory.from_buddy);
      }
      fmt::print("[bert] restored snapshot {} (step {}) from host memory in {:.3f} s ({})\n",
                 memory.number, r.state.step, memory.seconds, from);
      for (const auto& n : notes) fmt::print("[bert] note: {}\n", n);
      bert::truncate_metrics(r.metrics_path, r.state.step);
      r.metrics.close();
      r.metrics.open(r.metrics_path, std::ios::app);
      if (!r.metrics) throw std::runtime_error("cannot write " + r.metrics_path.string());
    });
  } else if (resume) {
    const fs::path base = a.resume.empty() ? fs::path(a.out) / "checkpoint" : fs::path(a.resume);
    // Any layout loads any other (shardopt/grid_checkpoint.hpp): each rank reads only what it
    // will hold.
    bert::SavedLayout saved;
    std::string trainer_json;
    try {
      if (!fs::exists(base / "manifest.json")) {  // else a folder of --tp 1 --pp 1 before commits
        const shardopt::GridCommit c = shardopt::read_grid_commit(base.string());
        saved.tp = c.layout.tp, saved.pp = c.layout.pp;
      }
      const std::string first = shardopt::committed_folder(base.string());
      trainer_json = shardopt::read_checkpoint_info(first).trainer_json;
    } catch (const shardopt::Error& e) {
      throw UsageError(fmt::format("--resume: {}", e.what()));
    }
    const auto recorded = nlohmann::json::parse(trainer_json).value("layout", nlohmann::json());
    if (recorded.is_object()) saved.virtual_stages = recorded.value("virtual_stages", 1);
    const bert::SavedLayout now{r.tp(), r.pp(), r.pp() > 1 ? a.virtual_stages : 1};
    std::error_code ec;
    if (!saved.same_folders(now) && fs::equivalent(base, fs::path(a.out) / "checkpoint", ec)) {
      throw UsageError(fmt::format(
          "--resume: the checkpoint in {} was written at {}; this run's ({}) is laid out "
          "differently: resume into a new folder (--out NEW --resume {})", a.out, saved.describe(),
          now.describe(), base.string()));
    }
    const std::string from = saved == now ? base.string() : fmt::format("{} (written at {})", base.string(), saved.describe());
    const auto t0 = Clock::now();
    shardopt::TrainerState saved_state;
    try {
      saved_state = shardopt::load_grid_checkpoint(*r.opt, r.groups, base.string());
    } catch (const shardopt::Error& e) {  // on every rank alike: a checkpoint that does not fit
      if (e.kind() != shardopt::ErrorKind::Checkpoint && e.kind() != shardopt::ErrorKind::Mismatch) throw;
      throw UsageError(fmt::format("--resume: {}", e.what()));
    }
    const auto notes = bert::restore_run_state(saved_state, r.schedule, &r.state, saved == now);
    const auto tp_rng = saved_state.tensors.find("tp_dropout_rng");
    if (const auto& rng = r.model->model_parallel().rng; rng && tp_rng != saved_state.tensors.end()) {
      rng->set_state(tp_rng->second);
    }
    shardopt::agree_on_errors(*r.comm, "resuming the metrics log", [&] {
      if (!r.lead) return;
      fmt::print("[bert] resumed from {} at step {} ({:.1f} s)\n", from, r.state.step,
                 seconds_since(t0));
      for (const auto& n : notes) fmt::print("[bert] note: {}\n", n);
      if (!a.eval_only) {
        bert::truncate_metrics(r.metrics_path, r.state.step);
        r.metrics.close();
        r.metrics.open(r.metrics_path, std::ios::app);
        if (!r.metrics) throw std::runtime_error("cannot write " + r.metrics_path.string());
      }
    });
  }
  r.start_step = r.state.step;
  r.start_train_s = r.state.train_s;
  const bool tty = r.lead && bert::progress_on_terminal(a.progress);
  const int64_t end = a.stop_after > 0 ? std::min(a.steps, r.start_step + a.stop_after) : a.steps;
  r.progress = std::make_unique<bert::ProgressLine>(tty, a.steps, end, a.log_every, r.start_step,
                                                    r.state.train_s);
}

// ---- evaluation ---------------------------------------------------------------------------------
nlohmann::json evaluate(Run& r, int64_t done) {
  // Under --pp the eval batches go through the stages (PipelineStages::forward_only).
  const auto e = bert::evaluate(r.model, *r.eval_data, *r.dp, r.a.eval_batch_size, r.pipeline.get());
  if (r.lead) fmt::print("{}{}\n", r.clear(), e.line(done, r.config.nsp));
  nlohmann::json j = e.to_json();
  j["step"] = done;
  if (r.first_eval.is_null()) r.first_eval = j;
  r.last_eval = j;
  return j;
}

// --eval-only: the held-out metrics of the model as it stands (a checkpoint's with --resume, the
// weights of --init-checkpoint), its logits with --dump-logits, its export with --export-hf.
int evaluate_only(Run& r) {
  if (!r.eval_data) throw UsageError("--eval-only: there is no eval data (--eval-data FILE)");
  evaluate(r, r.start_step);
  shardopt::agree_on_errors(*r.comm, "writing eval.json", [&] {
    if (!r.lead) return;
    const fs::path path = fs::path(r.a.out) / "eval.json";
    std::ofstream out(path);
    out << r.last_eval.dump(2) << '\n';
    if (!out) throw std::runtime_error("cannot write " + path.string());
    fmt::print("[bert] eval results: {}\n", path.string());
  });
  if (!r.a.dump_logits.empty()) {
    shardopt::agree_on_errors(*r.comm, "writing the logits", [&] {
      bert::dump_logits(r.model, *r.eval_data, r.a.eval_batch_size, r.device,
                        r.lead ? r.a.dump_logits : "");
      if (r.lead) fmt::print("[bert] logits of the first eval batch: {}\n", r.a.dump_logits);
    });
  }
  if (!r.a.export_hf.empty()) bert::export_model(r);
  return 0;
}

// ---- the training loop --------------------------------------------------------------------------
// One optimizer step over --grad-accum micro-batches; returns its metrics over all ranks (one
// small all-reduce and one all-gather).
bert::StepRecord train_step(Run& r, int64_t step) {
  const Args& a = r.a;
  auto& opt = *r.opt;
  // The tracker's peak window is the step (the run's peak is kept in tracked_peak).
  r.tracked_peak = std::max(r.tracked_peak, r.tracking->tracker().reset_peak());
  const auto t0 = Clock::now();
  const double cpu0 = process_cpu_s();
  const double lr = bert::lr_at(a, step);
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
  opt.zero_grad();
  double fwd_s = 0, bwd_s = 0, data_s = 0, metrics_s = 0, metrics_cpu_s = 0;
  bert::StepSums sums{};
  if (r.pipeline) {  // the M micro-batches through the pipeline; the sums on the last stage
    std::vector<bert::BertInputs> inputs;
    double rows = 0, tokens = 0;
    const auto td = Clock::now();
    for (int micro = 0; micro < a.grad_accum; ++micro) {
      const bert::Batch batch = r.loader.batch(r.state.data_position++);
      inputs.push_back(bert::to_inputs(batch, r.device));
      rows += static_cast<double>(batch.rows);
      tokens += static_cast<double>(batch.num_tokens);
    }
    data_s += seconds_since(td);
    const auto tf = Clock::now();
    const auto& ids = inputs.front().input_ids;
    // Between stages travels the hidden state; with sequence parallelism each tensor rank's
    // share of the sequence (Note [Split regions] in shardopt/tensor_parallel.hpp).
    const int64_t seq = a.sequence_parallel ? ids.size(1) / r.tp() : ids.size(1);
    sums = r.pipeline->run(std::move(inputs), opt, {ids.size(0), seq, r.config.hidden_size},
                           opt.param_groups().front().params().front().scalar_type());
    fwd_s += seconds_since(tf);  // forward and backward interleave: all of it counts as forward
    if (r.groups.last_stage()) sums[bert::kRows] += rows, sums[bert::kTokens] += tokens;
  }
  for (int micro = 0; micro < (r.pipeline ? 0 : a.grad_accum); ++micro) {
    const auto td = Clock::now();
    const bert::Batch batch = r.loader.batch(r.state.data_position++);
    const bert::BertInputs inputs = bert::to_inputs(batch, r.device);
    data_s += seconds_since(td);
    const auto tf = Clock::now();
    const bert::BertOutputs out = r.model->forward(inputs);
    fwd_s += seconds_since(tf);
    const auto tb = Clock::now();
    opt.backward(out.loss);
    bwd_s += seconds_since(tb);
    // Metrics are not training work: their time is left out of the step time.
    const auto tm = Clock::now();
    const double cpu_m = process_cpu_s();
    torch::NoGradGuard no_grad;
    sums[bert::kLossSum] += out.loss.item<double>();
    sums[bert::kMlmLossSum] += out.mlm_loss.item<double>();
    sums[bert::kNspLossSum] += out.nsp_loss.item<double>();
    sums[bert::kMlmCorrect] += out.mlm_predictions.eq(out.mlm_labels).sum().item<double>();
    sums[bert::kMlmCount] += out.mlm_labels.ne(-100).sum().item<double>();
    if (out.nsp_logits.defined()) {
      sums[bert::kNspCorrect] += out.nsp_logits.argmax(-1).eq(inputs.nsp_labels).sum().item<double>();
    }
    sums[bert::kRows] += static_cast<double>(batch.rows);
    sums[bert::kTokens] += static_cast<double>(batch.num_tokens);
    metrics_s += seconds_since(tm);
    metrics_cpu_s += process_cpu_s() - cpu_m;
  }
  const auto to = Clock::now();
  opt.step();
  const double opt_s = seconds_since(to);
  if (r.block_cache) r.block_cache->next_step();
  const auto& stats = opt.last_step();
  const auto mem = opt.memory();
  std::vector<double> local(bert::kTimings);
  local[bert::kMemory] = static_cast<double>(mem.total());
  local[bert::kStep] = seconds_since(t0) - metrics_s, local[bert::kFwd] = fwd_s;
  local[bert::kBwd] = bwd_s, local[bert::kOpt] = opt_s, local[bert::kCommWait] = stats.reduce_wait_s;
  local[bert::kUpdate] = stats.update_s, local[bert::kGather] = stats.gather_s;
  local[bert::kData] = data_s, local[bert::kCpu] = process_cpu_s() - cpu0 - metrics_cpu_s;
  local[bert::kCommElements] = static_cast<double>(stats.comm_elements);
  local[bert::kStepPeak] = static_cast<double>(r.tracking->tracker().peak_bytes());

  auto reduced = torch::tensor(std::vector<double>(sums.begin(), sums.end()), torch::kDouble);
  r.dp->all_reduce(reduced, shardopt::ReduceOp::Sum);  // a tensor group's ranks share the rows
  if (r.pp() > 1) r.groups.pp->all_reduce(reduced, shardopt::ReduceOp::Sum);  // the last stage's
  auto all = torch::zeros({bert::kTimings * r.world}, torch::kDouble);
  r.comm->all_gather(torch::tensor(local, torch::kDouble), all);
  bert::StepRecord rec;
  rec.step = step + 1;
  std::copy_n(reduced.data_ptr<double>(), bert::kStepSums, rec.sums.begin());
  rec.micro_batches = static_cast<double>(r.dp->size() * a.grad_accum);
  rec.lr = lr;
  rec.grad_norm = stats.grad_norm;
  rec.world = r.world;
  rec.global_batch = r.global_batch;
  rec.timings.assign(all.data_ptr<double>(), all.data_ptr<double>() + bert::kTimings * r.world);
  rec.memory_rank0 = {{"params", mem.param_bytes}, {"grads", mem.grad_bytes},
                      {"optimizer_state", mem.optimizer_state_bytes}, {"buffers", mem.buffer_bytes}};
  return rec;
}

// After a restart from a snapshot: the time from the failure (SHARDOPT_FAILED_AT, seconds since
// the epoch, set by scripts/shardopt-run) to the end of the first step after it.
void report_recovery(const Run& r) {
  const char* failed_at = std::getenv("SHARDOPT_FAILED_AT");
  if (!r.lead || failed_at == nullptr) return;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  fmt::print("{}[bert] recovered: {:.2f} s from the failure to the end of the first step after "
             "it (restore {:.3f} s)\n", r.clear(), now - std::atof(failed_at), r.restore_s);
}

void train_loop(Run& r) {
  const Args& a = r.a;
  for (int64_t step = r.start_step; step < a.steps; ++step) {
    if (a.stop_after > 0 && step - r.start_step >= a.stop_after) break;
    r.fault.before_step(r.rank, step + 1);
    bert::StepRecord rec = train_step(r, step);
    const int64_t done = rec.step;
    r.state.step = done;
    r.state.losses.push_back(rec.loss());
    r.state.tokens += rec.tokens();
    r.run_tokens += rec.tokens();
    r.run_samples += r.global_batch;
    const bool last_of_run = done == a.steps || (a.stop_after > 0 && done - r.start_step == a.stop_after);
    if (r.eval_data && (last_of_run || (a.eval_every > 0 && done % a.eval_every == 0))) {
      rec.eval = evaluate(r, done);  // collective: every rank
    }
    // The step's time is its slowest rank's: the same number on every rank.
    r.state.train_s += rec.slowest_step_s();
    // Counted from this run's start, so a resumed run keeps the same spacing. Rank 0 writes the
    // step's metrics line first: a published checkpoint never holds a step the log lacks.
    const bool save_now =
        a.checkpoint_every > 0 && (done - r.start_step) % a.checkpoint_every == 0 && !last_of_run;
    // At a snapshot step the previous snapshot is committed before this step's line is written
    // (snapshot() would join it next anyway): a death after the line repeats at most K steps.
    const bool snapshot_now = r.snapshots && done % a.snapshot_every == 0 && !last_of_run;
    if (snapshot_now) r.snapshots->wait();
    if (r.lead) {
      r.timings.push_back(rec.timings);
      r.last = bert::metrics_json(rec);
      r.metrics << r.last.dump() << '\n';
      r.metrics.flush();
    }
    if (save_now) bert::save(r, done);
    if (snapshot_now) bert::snapshot(r, done);
    if (r.restore_s >= 0 && done == r.start_step + 1) report_recovery(r);
    if (r.lead) r.progress->step(rec, r.state.train_s, r.run_samples, r.run_tokens);
  }
  if (r.snapshots) r.snapshots->wait();
  if (r.lead) r.progress->finish();
}

// A checkpoint at or past the last step: nothing to train. Found from its manifest before any
// data or model is built; every rank reads it and stops alike, with no collective.
bool already_finished(const Args& a, int rank) {
  if (!a.resume_requested || a.eval_only) return false;
  const fs::path base = a.resume.empty() ? fs::path(a.out) / "checkpoint" : fs::path(a.resume);
  std::string from;
  shardopt::CheckpointInfo info;
  try {
    from = shardopt::committed_folder(base.string());  // the grid's first folder
    info = shardopt::read_checkpoint_info(from);
  } catch (const shardopt::Error& e) {
    throw UsageError(fmt::format("--resume: {}", e.what()));
  }
  const auto trainer = nlohmann::json::parse(info.trainer_json, nullptr, false);
  const int64_t saved = trainer.is_object() ? trainer.value("step", int64_t{-1}) : -1;
  if (saved < a.steps) return false;
  if (rank == 0) {
    fmt::print("[bert] checkpoint {} is at step {} of {}: nothing to train; raise --steps to "
               "continue\n", from, saved, a.steps);
  }
  return true;
}

int train(const Args& a, const shardopt::CommunicatorPtr& comm, const shardopt::InitOptions& init) {
  if (already_finished(a, comm->rank())) return 0;
  Run r(a, comm, init);
  set_up(r);
  load_data(r);
  build_model(r);
  restore(r);
  if (a.eval_only) return evaluate_only(r);
  train_loop(r);
  bert::finish(r);
  return bert::summarize(r);
}

// Note [Errors on one rank]: an error that escapes train() on one rank (a file, the data, JSON)
// ends the whole job at once through shardopt::run_or_abort, so no rank waits for the collective
// timeout. Usage errors are found alike on every rank (the same arguments and files), so every
// rank returns 2 and rank 0 alone prints the one line; the others wait at a barrier until it has,
// since a launcher may end the job as soon as one rank exits non-zero (OpenMPI 5's prterun did,
// before rank 0 had printed anything).
int run(const Args& a) {
  shardopt::InitOptions init;  // --timeout, else SHARDOPT_TIMEOUT, else the library's default
  if (a.timeout_s > 0) init.timeout = shardopt::Duration(static_cast<int64_t>(a.timeout_s * 1e3));
  init.device = torch::Device(a.device).is_cuda() ? "cuda" : "cpu";
  auto comm = shardopt::init_from_env(init);
  return shardopt::run_or_abort(*comm, [&] {
    try {
      return train(a, comm, init);
    } catch (const UsageError& e) {
      std::fflush(stdout);
      if (comm->rank() == 0) fmt::print(stderr, "bert_pretrain: error: {}\n", e.what());
      std::fflush(stderr);
      comm->barrier();
      return 2;
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bert::Commands commands;
  CLI::App app{"BERT pretraining (MLM + NSP) with shardopt's ZeRO optimizer; run under mpirun -np N"};
  bert::add_options(app, a, commands);
  // Every rank parses and checks the same arguments and files; rank 0 alone says what is wrong,
  // and under a launcher the others wait for it (Note [Errors on one rank]).
  const bool speaker = examples::launcher_rank() == 0;
  auto usage_error = [](const std::string& what) {
    return examples::usage_error("bert_pretrain", what);
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
  if (a.micro_batches > 0) a.grad_accum = a.micro_batches;  // --pp's name for --grad-accum
  if (a.device != "cpu" && !torch::cuda::is_available()) {
    return usage_error(fmt::format("--device {}: no CUDA device is visible to this libtorch (a "
                                   "build without CUDA, or no GPU); use --device cpu", a.device));
  }
  try {
    if (commands.build_vocab->parsed()) return bert::build_vocab_command(a, commands.output);
    if (commands.create_data->parsed()) {
      return bert::create_data_command(a, commands.output, commands.eval_output);
    }
    if (commands.tokenize->parsed()) return bert::tokenize_command(a, commands.input);
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
