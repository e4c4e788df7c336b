// memory_scaling: per-rank bytes of parameters, gradients and optimizer state of the BERT example's
// model (BERT-base or -large shape) after one optimizer step under ZeRO stage S on N ranks, measured
// by shardopt::MemoryTracker (live tensor storage) and by DistributedOptimizer::memory(), next to
// DESIGN.md's formula, the documented bounded buffers and the estimator (shardopt/estimate.hpp).
// bench/memory_scaling.sh runs it over stages and N (one mpirun each) and draws the table and plot.
//
//   mpirun -np 4 memory_scaling --model base --stage 2 --json out.json
//   memory_scaling --plan --model large --ranks 1,2,4,8 --stages 0,1,2,3 --budget-gib 12
#include <ATen/ATen.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "data.hpp"
#include "model.hpp"
#include "shardopt/detail/partition.hpp"
#include "shardopt/estimate.hpp"
#include "shardopt/shardopt.hpp"

namespace est = shardopt::estimate;
using nlohmann::json;

namespace {

constexpr int64_t kP = 4, kG = 4, kK = 8;  // fp32 parameters and gradients, AdamW's m and v
// The MPI engine reduces through a persistent scratch buffer of at most this many bytes
// (src/comm/mpi_communicator.cpp, kPieceBytes): one reduced piece of a bucket's shard.
constexpr int64_t kEngineScratchBytes = int64_t{64} << 20;
// What a libtorch + MPI process holds besides tensors (libraries, MPI buffers): for the budget.
constexpr int64_t kProcessOverheadBytes = int64_t{350} << 20;

struct Config {
  std::string model;
  int stage = 2;
  int ranks = 1;
};

int64_t vm_kib(const char* field) {  // VmRSS / VmHWM of /proc/self/status, in KiB
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size()));
  }
  return -1;
}

int64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

// The optimizer's flat layout, as the engine (src/engine/engine.cpp) builds it for one parameter group: parameters
// in reverse registration order, buckets of bucket_bytes, padded to world * align.
shardopt::detail::FlatLayout layout_of(const std::vector<int64_t>& numels_in_order, int world,
                               const shardopt::ZeroOptions& zo) {
  std::vector<int64_t> numels(numels_in_order.rbegin(), numels_in_order.rend());
  std::vector<int> groups(numels.size(), 0);
  return shardopt::detail::make_layout(numels, groups, world, std::max<int64_t>(1, zo.align_bytes / kP),
                                       std::max<int64_t>(1, zo.bucket_bytes / kP));
}

// DESIGN.md's table with P = G = 4, K = 8: bytes of model state per rank, by category.
est::Breakdown design_formula(int stage, int64_t psi, int64_t n) {
  est::Breakdown b;
  const int64_t shard = (psi + n - 1) / n;
  b.params = kP * (stage == 3 ? shard : psi);
  b.grads = kG * (stage >= 2 ? shard : psi);
  b.optimizer_state = kK * (stage >= 1 ? shard : psi);
  return b;
}

est::Estimate estimator(const Config& c, const est::BertConfig& bc, const shardopt::ZeroOptions& zo) {
  est::Options o;
  o.params = est::bert_parameter_count(bc);
  o.world = c.ranks;
  o.stage = c.stage;
  o.bucket_bytes = zo.bucket_bytes;
  o.align_bytes = zo.align_bytes;
  o.largest_param = bc.vocab * bc.hidden;  // the word embeddings (tied decoder)
  o.gathered_units_params = est::bert_counts(bc).two_largest_units(bc.layers);
  return est::model_states(o);
}

// Documented bounded buffers on top of the formula: stage 2 keeps at most two bucket buffers of
// the largest bucket; stage 3 the same two plus its root unit (embeddings, pooler and heads: the
// parameters in no layer unit), which stays gathered between steps; the MPI engine one scratch
// piece (N > 1). Stage 3's gathered layer units are freed after each step, so they are not
// live after it.
struct Buffers {
  int64_t optimizer = 0;
  int64_t engine = 0;
  int64_t total() const { return optimizer + engine; }
};

Buffers documented_buffers(const Config& c, const shardopt::detail::FlatLayout& layout,
                           int64_t root_numel) {
  Buffers b;
  int64_t max_bucket = 0, max_shard = 0;
  for (const auto& bl : layout.buckets) {
    max_bucket = std::max(max_bucket, bl.padded);
    max_shard = std::max(max_shard, bl.shard);
  }
  if (c.stage == 2) b.optimizer = 2 * kG * max_bucket;
  if (c.stage == 3) b.optimizer = 2 * kG * max_bucket + kP * root_numel;
  if (c.ranks > 1) b.engine = std::min(kEngineScratchBytes, kG * max_shard);
  return b;
}

json breakdown_json(const est::Breakdown& b) {
  return {{"params", b.params}, {"grads", b.grads}, {"optimizer_state", b.optimizer_state},
          {"buffers", b.buffers}, {"total", b.total()}};
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(std::stoi(item));
  }
  return out;
}

// ---- --plan: which configurations fit the memory budget -----------------------------------------

int plan(const std::string& model, const std::string& ranks, const std::string& stages,
         double budget_gib) {
  const auto bc = est::bert_preset(model);
  const int64_t psi = est::bert_parameter_count(bc);
  const int64_t budget = static_cast<int64_t>(budget_gib * (int64_t{1} << 30));
  const int64_t available = mem_available_bytes();
  shardopt::ZeroOptions zo;
  json out = json::array();
  for (int n : parse_list(ranks)) {
    for (int s : parse_list(stages)) {
      const Config c{model, s, n};
      const auto e = estimator(c, bc, zo);
      // Per rank at the worst moment, plus the process itself: either construction (the model's
      // own parameters still alive while the optimizer copies them into its flat buffer; bucket
      // buffers not yet allocated) or backward (two transient gradients of the largest parameter).
      const int64_t construction = e.device.total() - e.device.buffers + kP * psi;
      const int64_t backward = e.device.total() + 2 * kG * bc.vocab * bc.hidden;
      const int64_t per_rank = std::max(construction, backward) + kProcessOverheadBytes;
      const int64_t total = per_rank * n;
      json j = {{"model", model}, {"stage", s}, {"ranks", n}, {"per_rank_bytes", per_rank},
                {"total_bytes", total}, {"budget_bytes", budget}, {"run", true}};
      if (total > budget) {
        j["run"] = false;
        j["reason"] = fmt::format("needs ~{:.1f} GiB across {} ranks, over the {:.1f} GiB budget",
                                  total / double(int64_t{1} << 30), n, budget_gib);
      } else if (available > 0 && total > available - (int64_t{1} << 30)) {
        j["run"] = false;
        j["reason"] = fmt::format("needs ~{:.1f} GiB, only {:.1f} GiB available now (minus 1 GiB "
                                  "kept free)", total / double(int64_t{1} << 30),
                                  available / double(int64_t{1} << 30));
      }
      out.push_back(j);
    }
  }
  fmt::print("{}\n", out.dump());
  return 0;
}

// ---- a measurement (all ranks) ------------------------------------------------------------------

int measure(const Config& c, const std::string& json_path) {
  auto comm = shardopt::init_from_env();
  at::set_num_threads(1);
  const int rank = comm->rank(), world = comm->size();
  Config cfg = c;
  cfg.ranks = world;
  shardopt::ScopedMemoryTracking tracking;
  auto& tracker = tracking.tracker();
  comm->barrier();
  const int64_t base = tracker.live_bytes();
  const int64_t rss_base = vm_kib("VmRSS") * 1024;

  bert::BertConfig config = bert::BertConfig::preset(c.model);
  config.hidden_dropout = config.attention_dropout = 0.0;  // no masks: only the model state counts
  at::manual_seed(0);
  auto model = std::make_unique<bert::BertForPreTraining>(config);
  const int64_t model_bytes = tracker.live_bytes() - base;
  std::vector<int64_t> numels;
  int64_t psi = 0;
  for (const auto& p : (*model)->named_parameters()) {
    numels.push_back(p.value().numel());
    psi += p.value().numel();
  }

  shardopt::ZeroOptions zo;
  zo.stage = shardopt::stage_from_int(c.stage);
  zo.units = (*model)->units();  // stage 3: one unit per encoder layer, as the trainer does
  int64_t unit_numel = 0;
  for (int u = 0; u < zo.units->size(); ++u) {
    for (const auto& t : zo.units->parameters(u)) unit_numel += t.numel();
  }
  const auto bc = est::bert_preset(c.model);
  const auto e = estimator(cfg, bc, zo);
  const auto layout = layout_of(numels, world, zo);
  const auto buffers = documented_buffers(cfg, layout, psi - unit_numel);
  const auto formula = design_formula(c.stage, psi, world);

  json result = {{"model", c.model}, {"stage", c.stage}, {"ranks", world},
                 {"backend", comm->backend()}, {"psi", psi},
                 {"estimator_psi", est::bert_parameter_count(bc)},
                 {"padded_psi", layout.padded_numel}, {"shard_psi", layout.shard_numel},
                 {"buckets", layout.buckets.size()}, {"formula", breakdown_json(formula)},
                 {"estimator", breakdown_json(e.device)},
                 {"documented_buffers", {{"optimizer", buffers.optimizer},
                                         {"engine_scratch", buffers.engine}}},
                 {"expected_total", formula.total() + buffers.total()},
                 {"model_bytes_before_optimizer", model_bytes}};

  std::unique_ptr<shardopt::DistributedOptimizer> opt;
  try {
    opt = std::make_unique<shardopt::DistributedOptimizer>(
        (*model)->named_parameters(), shardopt::AdamW(1e-4).weight_decay(0.01), comm, zo);
  } catch (const shardopt::Error& err) {
    // Every rank refuses alike (options are checked before any collective).
    result["status"] = err.kind() == shardopt::ErrorKind::Unsupported ? "pending" : "failed";
    result["reason"] = err.what();
    if (rank == 0) {
      if (!json_path.empty()) std::ofstream(json_path) << result.dump(1) << '\n';
      fmt::print("{}\n", result.dump());
    }
    return result["status"] == "pending" ? 0 : 1;
  }
  const int64_t after_construction = tracker.live_bytes() - base;
  tracker.reset_peak();

  {
    // One tiny batch: one sequence of 16 tokens, every position masked.
    const bert::Batch batch = bert::synthetic_batch(1, 16, config.vocab_size, 1.0, 103, 0, 0, rank);
    const bert::BertInputs inputs = bert::to_inputs(batch);
    opt->zero_grad();
    const bert::BertOutputs out = (*model)->forward(inputs);
    opt->backward(out.loss);
  }
  opt->step();
  const int64_t live = tracker.live_bytes() - base;
  const int64_t peak = tracker.peak_bytes() - base;
  const auto mem = opt->memory();
  const int64_t rss = vm_kib("VmRSS") * 1024, hwm = vm_kib("VmHWM") * 1024;

  // Every rank's numbers to rank 0.
  const std::vector<double> mine = {
      double(after_construction), double(live), double(peak), double(mem.param_bytes),
      double(mem.grad_bytes), double(mem.optimizer_state_bytes), double(mem.buffer_bytes),
      double(rss), double(hwm), double(rss_base)};
  const int64_t k = static_cast<int64_t>(mine.size());
  auto all = at::zeros({k * world}, at::kDouble);
  comm->all_gather(at::tensor(mine, at::kDouble), all);
  opt.reset();
  model.reset();
  const int64_t left = tracker.live_bytes() - base;

  if (rank == 0) {
    json per_rank = json::array();
    const auto* a = all.data_ptr<double>();
    int64_t worst_live = 0;
    for (int r = 0; r < world; ++r) {
      const double* v = a + r * k;
      per_rank.push_back({{"after_construction", int64_t(v[0])}, {"tracker_live", int64_t(v[1])},
                          {"tracker_peak", int64_t(v[2])},
                          {"memory", {{"params", int64_t(v[3])}, {"grads", int64_t(v[4])},
                                      {"optimizer_state", int64_t(v[5])},
                                      {"buffers", int64_t(v[6])},
                                      {"total", int64_t(v[3] + v[4] + v[5] + v[6])}}},
                          {"rss", int64_t(v[7])}, {"rss_peak", int64_t(v[8])},
                          {"rss_before_model", int64_t(v[9])}});
      worst_live = std::max(worst_live, int64_t(v[1]));
    }
    result["status"] = "ok";
    result["per_rank"] = per_rank;
    result["tracker_live_max"] = worst_live;
    result["rank0_left_after_teardown"] = left;  // the engine's scratch stays with the communicator
    // The verdict: live model state within 5% of the formula plus the documented buffers, and
    // memory()'s categories within 5% of the formula's.
    auto within = [](double measured, double expected) {
      return expected == 0 ? measured == 0 : std::abs(measured - expected) / expected <= 0.05;
    };
    const double expected = static_cast<double>(formula.total() + buffers.total());
    bool ok = within(static_cast<double>(worst_live), expected);
    for (const auto& pr : per_rank) {
      ok = ok && within(pr["memory"]["params"].get<double>(), double(formula.params)) &&
           within(pr["memory"]["grads"].get<double>(), double(formula.grads)) &&
           within(pr["memory"]["optimizer_state"].get<double>(), double(formula.optimizer_state)) &&
           pr["memory"]["buffers"].get<double>() <= double(buffers.optimizer) * 1.05;
    }
    result["deviation"] = (static_cast<double>(worst_live) - expected) / expected;
    result["within_5pct"] = ok;
    if (!json_path.empty()) std::ofstream(json_path) << result.dump(1) << '\n';
    fmt::print("{}\n", result.dump());
    if (!ok) {
      fmt::print(stderr, "memory_scaling: measured {} bytes per rank, expected {} (formula + "
                 "documented buffers): off by {:+.2f}%, more than 5%\n", worst_live,
                 static_cast<int64_t>(expected), 100 * result["deviation"].get<double>());
    }
  }
  // Every rank exits with rank 0's verdict.
  auto verdict = at::zeros({1}, at::kLong);
  if (rank == 0) verdict.fill_(result.value("within_5pct", false) ? 0 : 2);
  comm->broadcast(verdict, 0);
  return static_cast<int>(verdict.item<int64_t>());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-rank model-state bytes of BERT under ZeRO stage S on N ranks, measured vs "
               "DESIGN.md's formula and the estimator (run under mpirun -np N)"};
  Config c;
  bool plan_only = false;
  std::string json_path, ranks = "1,2,4,8", stages = "0,1,2,3";
  double budget_gib = 12;
  app.add_option("--model", c.model, "BERT shape: base or large (or any example preset)")
      ->required()->check(CLI::IsMember({"tiny", "mini", "small", "base", "large"}));
  app.add_option("--stage", c.stage, "ZeRO stage")->check(CLI::Range(0, 3));
  app.add_option("--json", json_path, "write the result here too (rank 0)");
  app.add_flag("--plan", plan_only, "print which (stage, ranks) fit --budget-gib, run nothing");
  app.add_option("--ranks", ranks, "--plan: world sizes");
  app.add_option("--stages", stages, "--plan: stages");
  app.add_option("--budget-gib", budget_gib, "--plan: GiB all ranks of one run may use together");
  CLI11_PARSE(app, argc, argv);
  try {
    if (plan_only) return plan(c.model, ranks, stages, budget_gib);
    return measure(c, json_path);
  } catch (const std::exception& e) {
    fmt::print(stderr, "memory_scaling: error: {}\n", e.what());
    return 1;
  }
}
