// gpt_train: a GPT-2-architecture decoder trained on a folder of text (bytes as tokens) with
// shardopt's pieces alone: tensor parallelism (split layers, split records), pipeline schedules
// (run_pipeline), the ZeRO optimizer over the data-parallel group, sharded checkpoints. One process
// per rank (mpirun -np T*D*P); every rank of a step's layout reads the rows Note [Rows by number]
// gives it, so any (t, p, d) with the same d*m trains on the same global batches.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpointing.hpp"
#include "common/cli.hpp"
#include "config.hpp"
#include "corpus.hpp"
#include "golden.hpp"
#include "local_model.hpp"
#include "model.hpp"
#include "options.hpp"
#include "shardopt/memory_tracker.hpp"
#include "shardopt/shardopt.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace gpt {
namespace {

// An error in what the user asked for: rank 0 prints one line, every rank exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Everything one rank's run holds.
struct Run {
  Run(const Args& args, shardopt::CommunicatorPtr world, shardopt::Duration deadline)
      : a(args), comm(std::move(world)), timeout(deadline), lead(comm->rank() == 0) {}
  const Args& a;
  shardopt::CommunicatorPtr comm;
  shardopt::Duration timeout;
  bool lead = false;  // world rank 0: prints and writes the metrics
  shardopt::ParallelGroups groups;
  GptConfig config;
  int micro_batches = 1;
  std::unique_ptr<ByteCorpus> corpus;
  std::shared_ptr<shardopt::tp::RngTracker> rng;  // dropout inside split regions (its heads)
  std::unique_ptr<LocalModel> model;
  std::unique_ptr<shardopt::DistributedOptimizer> opt;
  SavedRun saved_run;
  int64_t start_step = 0;
  std::string resumed_from;  // " (written at --tp ...)" when the checkpoint's layout differs
  std::vector<StepRecord> records;  // this run's steps
  std::ofstream metrics;
  bool tty = false;
};

at::ScalarType dtype_of(const Args& a) { return a.dtype == "float64" ? at::kDouble : at::kFloat; }

// Set-up: the grid, the model's shape, the data.
void set_up(Run& r) {
  const Args& a = r.a;
  at::set_num_threads(a.threads);
  try {
    r.groups = shardopt::make_parallel_groups(r.comm, shardopt::ParallelLayout{a.tp, a.pp, 0});
  } catch (const shardopt::Error& e) {
    throw UsageError(fmt::format("--tp {} --pp {}: {}", a.tp, a.pp, e.what()));
  }
  r.config = GptConfig::preset(a.preset);
  if (a.layers > 0) r.config.layers = a.layers;
  if (a.hidden > 0) r.config.hidden = a.hidden;
  if (a.heads > 0) r.config.heads = a.heads;
  if (a.dropout >= 0) r.config.dropout = a.dropout;
  r.micro_batches = a.micro_batches > 0 ? a.micro_batches : a.grad_accum;
  try {
    r.corpus = std::make_unique<ByteCorpus>(a.corpus, a.max_seq_length + 1);
  } catch (const std::exception& e) {
    throw UsageError(e.what());
  }
  const int d = r.groups.dp->size();
  r.saved_run = {a.tp, a.pp, a.virtual_stages, a.batch_size * d * r.micro_batches, a.seed};
  if (r.lead) {
    fs::create_directories(a.out);
    r.metrics.open(fs::path(a.out) / "metrics.jsonl", std::ios::app);
  }
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") ||
                        std::getenv("SLURM_NTASKS") || std::getenv("WORLD_SIZE");
  r.tty = r.lead && (a.progress == "tty" || (a.progress == "auto" && isatty(1) && !launched));
}

// The model and its optimizer: what spans the grid comes from the parameters' records.
void build(Run& r) {
  const Args& a = r.a;
  Parallel par;
  par.tp.group = r.groups.tp;
  par.tp.init_unsplit = false;  // each rank draws its slices (Note [Weights by name])
  r.rng = std::make_shared<shardopt::tp::RngTracker>(a.seed, r.groups.tp_rank);
  par.rng = r.rng;
  std::optional<shardopt::PipelineSchedule> schedule;
  if (a.pp > 1) {
    try {
      schedule = shardopt::compile_schedule(shardopt::parse_schedule_kind(a.schedule), a.pp,
                                            r.micro_batches, a.virtual_stages);
    } catch (const shardopt::Error& e) {
      throw UsageError(e.what());
    }
  }
  // What building costs a rank against the parameters it holds: its stages only, its slices only.
  int64_t build_peak = 0;
  {
    shardopt::ScopedMemoryTracking tracking;
    auto& tracker = tracking.tracker();
    const int64_t before = tracker.live_bytes();
    tracker.reset_peak();
    r.model =
        std::make_unique<LocalModel>(r.config, par, r.groups, schedule, a.seed, dtype_of(a));
    build_peak = tracker.peak_bytes() - before;
  }
  int64_t held = 0;
  for (const auto& p : r.model->named_parameters()) held += p.value().nbytes();
  const at::Tensor worst = at::full({1}, static_cast<double>(build_peak) / held, at::kDouble);
  r.comm->all_reduce(worst, shardopt::ReduceOp::Max);
  // Dropout outside the split regions: the same stream on a stage's tensor ranks, another stage's
  // offset (Megatron's), so two stages never draw the same masks.
  at::manual_seed(a.seed + 100 * static_cast<uint64_t>(r.groups.pp_rank));

  shardopt::ZeroOptions zo;
  zo.stage = shardopt::stage_from_int(a.stage);
  zo.max_grad_norm = a.max_grad_norm;
  zo.timeout = r.timeout;
  // Under a pipeline run_pipeline tells the optimizer the step's passes (Note [Pipeline
  // handshake]); without one the trainer runs its micro-batches through opt.backward().
  if (a.pp == 1) zo.grad_accumulation_steps = r.micro_batches;
  // What spans the grid (the clipping norm over every tensor rank and stage, wte's two copies on
  // the first and the last stage) the optimizer reads from the groups and the parameters' own
  // records: split, replicated, pipeline-shared.
  zo.grid = r.groups;
  // No weight decay on biases and LayerNorms (GPT-2's, nanoGPT's: parameters of one dimension).
  shardopt::ParamGroup decay, no_decay;
  no_decay.weight_decay = 0.0;
  for (const auto& p : r.model->named_parameters()) {
    (p.value().dim() >= 2 ? decay : no_decay).params.push_back({p.key(), p.value()});
  }
  const auto rule = shardopt::AdamW(a.lr).beta1(0.9).beta2(0.95).weight_decay(a.weight_decay);
  r.opt = std::make_unique<shardopt::DistributedOptimizer>(
      std::vector<shardopt::ParamGroup>{decay, no_decay}, rule, r.groups.dp, zo);
  if (!r.lead) return;
  const auto& c = r.config;
  const int64_t params = c.vocab * c.hidden + c.n_ctx * c.hidden +
                         c.layers * (12 * c.hidden * c.hidden + 13 * c.hidden) + 2 * c.hidden;
  fmt::print(
      "[gpt] model: GPT-2 architecture, {} ({}), {:.3f} M parameters, bytes as tokens, "
      "dropout {}, {}\n",
      a.preset, c.describe(), params / 1e6, c.dropout, a.dtype);
  fmt::print(
      "[gpt] construction: peak {:.3f} MB of tensors for {:.3f} MB of parameters held ({:.3f}x; "
      "highest over ranks {:.3f}x)\n",
      build_peak / 1e6, held / 1e6, static_cast<double>(build_peak) / held,
      worst.item<double>());
  fmt::print(
      "[gpt] training: {} ranks = {}, ZeRO stage {}, global batch {} = {} rows x {} "
      "data-parallel ranks x {} micro-batches of {} bytes, {} steps, AdamW lr {} (warm-up "
      "{}), clipping {}\n",
      r.comm->size(), r.groups.layout.to_string(), a.stage, r.saved_run.rows_per_step, a.batch_size,
      r.groups.dp->size(), r.micro_batches, a.max_seq_length, a.steps, a.lr, a.warmup_steps,
      a.max_grad_norm);
  if (schedule) {
    fmt::print("[gpt] pipeline: {} schedule over {} ranks{}; {}\n", a.schedule, a.pp,
               a.virtual_stages > 1 ? fmt::format(" x {} chunks", a.virtual_stages) : "",
               describe(r.model->spans()));
  }
  std::fflush(stdout);
}

// --resume: parameters, optimizer state, step and RNG from OUT/checkpoint or the folder given.
void restore(Run& r) {
  const Args& a = r.a;
  if (!a.resume_requested) return;
  const std::string base = a.resume.empty() ? (fs::path(a.out) / "checkpoint").string() : a.resume;
  try {
    const SavedRun then = saved_run(base).first;
    if (then.tp != r.saved_run.tp || then.pp != r.saved_run.pp ||
        then.virtual_stages != r.saved_run.virtual_stages) {
      r.resumed_from = fmt::format(" (written at {})", then.describe());
    }
    r.start_step = gpt::restore(*r.opt, base, r.groups, r.saved_run, *r.rng);
  } catch (const ResumeError& e) {
    throw UsageError(e.what());
  }
  shardopt::agree_on_errors(*r.comm, "rewriting metrics.jsonl", [&] {
    if (!r.lead) return;
    fmt::print("[gpt] resumed from {}{} at step {}\n", base, r.resumed_from, r.start_step);
    // The metrics of steps after the checkpoint's are those of a run that will be redone.
    const fs::path path = fs::path(a.out) / "metrics.jsonl";
    r.metrics.close();
    std::vector<std::string> kept;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("step", int64_t{0}) <= r.start_step) kept.push_back(line);
    }
    std::ofstream out(path, std::ios::trunc);
    for (const auto& line : kept) out << line << '\n';
    r.metrics.open(path, std::ios::app);
  });
}

// One step: the rows of Note [Rows by number], the model's micro-batches, the optimizer's step.
std::vector<MicroBatch> micro_batches_of(const Run& r, int64_t step) {
  const Args& a = r.a;
  std::vector<MicroBatch> out;
  const int d = r.groups.dp->size();
  for (int j = 0; j < r.micro_batches; ++j) {
    std::vector<int64_t> ids, targets;
    const int64_t first = first_row(step, j, r.micro_batches, r.groups.dp_rank, d, a.batch_size);
    for (int64_t i = 0; i < a.batch_size; ++i)
      r.corpus->row(a.seed, first + i, a.max_seq_length, ids, targets);
    const std::vector<int64_t> shape{a.batch_size, a.max_seq_length};
    out.push_back(
        {at::tensor(ids, at::kLong).view(shape), at::tensor(targets, at::kLong).view(shape)});
  }
  return out;
}

StepRecord train_step(Run& r, int64_t step) {
  auto& opt = *r.opt;
  for (auto& g : opt.param_groups()) g.options().set_lr(lr_at(r.a, step));
  opt.zero_grad();
  const double local = r.model->run(micro_batches_of(r, step), opt);
  opt.step();
  // The mean loss over the global batch: the last stage's sums over data-parallel ranks and
  // stages (a tensor group's ranks hold the same loss).
  at::Tensor sum = at::full({1}, local, at::kDouble);
  r.groups.dp->all_reduce(sum, shardopt::ReduceOp::Sum);
  if (r.a.pp > 1) r.groups.pp->all_reduce(sum, shardopt::ReduceOp::Sum);
  const double rows = static_cast<double>(r.groups.dp->size() * r.micro_batches);
  return {step + 1, sum.item<double>() / rows, opt.last_step().grad_norm};
}

void report(Run& r, const StepRecord& rec, double seconds) {
  const double lr = lr_at(r.a, rec.step - 1);
  r.metrics << nlohmann::json{{"step", rec.step},
                              {"loss", rec.loss},
                              {"grad_norm", rec.grad_norm},
                              {"lr", lr},
                              {"step_s", seconds}}
                   .dump()
            << '\n';
  r.metrics.flush();
  // Parseable: "step N loss L grad_norm G", full precision.
  const std::string line = fmt::format(
      "[gpt] step {} of {}: loss {:.10f} grad_norm {:.10e} lr {:.3e} "
      "({:.3f} s)",
      rec.step, r.a.steps, rec.loss, rec.grad_norm, lr, seconds);
  // tty: the line rewritten, its tail cleared.
  fmt::print("{}{}{}", r.tty ? "\r\x1b[K" : "", line, r.tty ? "" : "\n");
  std::fflush(stdout);
}

int train(const Args& a, const shardopt::CommunicatorPtr& comm, const shardopt::InitOptions& init) {
  Run r(a, comm, init.timeout);
  set_up(r);
  build(r);
  restore(r);
  const int64_t end = a.stop_after > 0 ? std::min(a.steps, r.start_step + a.stop_after) : a.steps;
  for (int64_t step = r.start_step; step < end; ++step) {
    const auto t0 = Clock::now();
    const StepRecord rec = train_step(r, step);
    r.records.push_back(rec);
    if (r.lead) report(r, rec, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (r.tty) fmt::print("\n");
  const std::string base = (fs::path(a.out) / "checkpoint").string();
  save(*r.opt, base, r.groups, r.saved_run, end, *r.rng);
  int rc = 0;
  shardopt::agree_on_errors(*comm, "writing the golden curve", [&] {
    if (!r.lead) return;
    fmt::print("[gpt] checkpoint at step {}: {}\n", end, base);
    if (!a.write_golden.empty()) write_golden(a.write_golden, r.records);
    if (!a.golden.empty() && !matches_golden(a.golden, r.records, a.golden_tol, a.golden_norm_tol))
      rc = 4;
  });
  int64_t all_rc = rc;  // rank 0's verdict is every rank's exit code
  at::Tensor t = at::full({1}, all_rc, at::kLong);
  comm->broadcast(t, 0);
  return static_cast<int>(t.item<int64_t>());
}

// What escapes on one rank ends the job at once (run_or_abort) rather than leaving the others in a
// collective; usage errors are found alike on every rank, and rank 0 prints the line.
int run(const Args& a) {
  shardopt::InitOptions init;
  if (a.timeout_s > 0) init.timeout = shardopt::Duration(static_cast<int64_t>(a.timeout_s * 1e3));
  auto comm = shardopt::init_from_env(init);
  return shardopt::run_or_abort(*comm, [&] {
    try {
      return train(a, comm, init);
    } catch (const UsageError& e) {
      std::fflush(stdout);
      if (comm->rank() == 0) fmt::print(stderr, "gpt_train: error: {}\n", e.what());
      std::fflush(stderr);
      comm->barrier();
      return 2;
    }
  });
}

}  // namespace
}  // namespace gpt

int main(int argc, char** argv) {
  gpt::Args a;
  CLI::App app{
      "A GPT-2-architecture decoder trained with shardopt (ZeRO x TP x PP); run under "
      "mpirun -np T*D*P"};
  gpt::add_options(app, a);
  // Rank 0 alone says what is wrong; under a launcher the others wait for it.
  const bool speaker = examples::launcher_rank() == 0;
  auto usage_error = [](const std::string& what) { return examples::usage_error("gpt_train", what); };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return speaker ? app.exit(e) : 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  }
  for (auto* opt : app.get_options()) {
    if (opt->get_name() == "--resume") a.resume_requested = opt->count() > 0;
  }
  if (const std::string why = gpt::check_args(a); !why.empty()) return usage_error(why);
  if (a.micro_batches > 0) a.grad_accum = a.micro_batches;
  try {
    return gpt::run(a);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\ngpt_train: error: {}\n", e.what());
    return 1;
  }
}
