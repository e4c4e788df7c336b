// shardopt-estimate: per-rank memory and communication of ZeRO stages 0-3 from the analytic model
// in shardopt/estimate.hpp. Torch-free (links fmt and CLI11 only).
//
//   shardopt-estimate --preset base --ranks 1,2,4,8 --stage all --precision fp32
//   shardopt-estimate --params 1.3e9 --ranks 8,64 --stage 2,3 --precision bf16 --offload cpu --json
#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "shardopt/estimate.hpp"

namespace est = shardopt::estimate;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (c != ' ') {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

double mb(int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

std::string json_breakdown(const est::Breakdown& b) {
  return fmt::format(
      "{{\"params\": {}, \"grads\": {}, \"optimizer_state\": {}, \"buffers\": {}, \"total\": {}}}",
      b.params, b.grads, b.optimizer_state, b.buffers, b.total());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "shardopt-estimate: per-rank bytes of parameters, gradients, optimizer state and buffers, "
      "and communication per step, for ZeRO stages 0-3 (docs/stages.md, the memory model). MB = 10^6 bytes."};
  std::string preset;
  double params = 0;
  std::string ranks_arg = "1,2,4,8";
  std::string stages_arg = "all";
  std::string precision_arg = "fp32";
  std::string offload_arg = "none";
  std::string optimizer_arg = "adamw";
  int state_bytes = -1;
  double bucket_mib = 0;
  int64_t align_bytes = 0;
  double unit_params = 0;
  double persistent_params = 0;
  bool json = false;
  auto* preset_opt = app.add_option("--preset", preset, "BERT preset: tiny, mini, small, base, large")
                         ->check(CLI::IsMember({"tiny", "mini", "small", "base", "large"}));
  auto* params_opt = app.add_option("--params", params, "parameter count Ψ, e.g. 1.3e9");
  preset_opt->excludes(params_opt);
  app.add_option("--ranks", ranks_arg, "comma-separated world sizes")->capture_default_str();
  app.add_option("--stage", stages_arg, "comma-separated stages 0-3, or all")->capture_default_str();
  app.add_option("--precision", precision_arg, "fp32 | fp16 | bf16 (fp16/bf16: mixed, +4 B master)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  app.add_option("--offload", offload_arg, "none | cpu (optimizer state and fp32 grad shard on host)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "cpu"}));
  app.add_option("--optimizer", optimizer_arg, "adam | adamw | lamb | sgd | adagrad | sgd-nomomentum | adafactor | adamw8bit | muon")
      ->capture_default_str()
      ->check(CLI::IsMember({"adam", "adamw", "lamb", "sgd", "adagrad", "sgd-nomomentum",
                            "adafactor", "adamw8bit", "muon"}));
  app.add_option("--state-bytes", state_bytes, "override K, optimizer bytes per parameter");
  app.add_option("--bucket-mib", bucket_mib, "gradient bucket size in MiB (ZeroOptions::bucket_bytes; 0: sized from the model as "
                 "the optimizer does)")
      ->capture_default_str();
  app.add_option("--align-bytes", align_bytes, "pad Ψ to N*align (0: none)")->capture_default_str();
  app.add_option("--unit-params", unit_params,
                 "stage 3: elements of the two largest units gathered together (default: the "
                 "preset's, or two buckets)");
  app.add_option("--persistent-params", persistent_params,
                 "stage 3: elements kept gathered for good (UnitPolicy's persistent groups: "
                 "memory().persistent_param_bytes / P)");
  bool defer_reduction = false;
  app.add_flag("--defer-reduction", defer_reduction,
               "stages 2-3: gradients summed in every bucket over the micro-steps, reduced once "
               "(ZeroOptions::defer_reduction: the pool holds all buckets)");
  int pipeline_ranks = 1;
  app.add_option("--pp", pipeline_ranks,
                 "pipeline ranks: above 1, --params is one rank's stage; stages 2-3 defer their "
                 "reduction and stage 3 holds the stage's units through the step (Note [Pipelines "
                 "decide two defaults])")
      ->check(CLI::PositiveNumber);
  bool reshard_between_uses = false;
  app.add_flag("--reshard-between-uses", reshard_between_uses,
               "stage 3 under --pp: release units between uses (ZeroOptions::reshard_between_uses)");
  bool memory_snapshots = false;
  app.add_flag("--memory-snapshots", memory_snapshots,
               "also the host memory (tmpfs) of MemorySnapshots' slots per rank: two of its own "
               "and two for its buddy (Note [Snapshots in memory])");
  app.add_flag("--json", json, "machine-readable output");
  CLI11_PARSE(app, argc, argv);

  try {
    if (preset.empty() && params <= 0) throw CLI::ValidationError("give --preset or --params");
    int64_t psi = 0, largest = 0;
    int64_t units = static_cast<int64_t>(std::llround(unit_params));
    if (!preset.empty()) {
      const est::BertConfig cfg = est::bert_preset(preset);
      const est::BertCounts counts = est::bert_counts(cfg);
      psi = counts.total();
      largest = cfg.vocab * cfg.hidden;  // the word embeddings: one bucket on their own
      if (units == 0) units = counts.two_largest_units(cfg.layers);
    } else {
      psi = static_cast<int64_t>(std::llround(params));
    }
    std::vector<int> ranks, stages;
    for (const auto& r : split(ranks_arg)) ranks.push_back(std::stoi(r));
    if (stages_arg == "all") {
      stages = {0, 1, 2, 3};
    } else {
      for (const auto& s : split(stages_arg)) stages.push_back(std::stoi(s));
    }
    if (ranks.empty() || stages.empty()) throw CLI::ValidationError("empty --ranks or --stage");

    est::Options base;
    base.params = psi;
    base.precision = est::parse_precision(precision_arg);
    base.offload = est::parse_offload(offload_arg);
    base.optimizer = est::parse_optimizer(optimizer_arg);
    base.state_bytes = state_bytes;
    base.bucket_bytes = static_cast<int64_t>(std::llround(bucket_mib * (1 << 20)));
    base.align_bytes = align_bytes;
    base.gathered_units_params = units;
    base.persistent_params = static_cast<int64_t>(std::llround(persistent_params));
    base.largest_param = largest;
    base.defer_reduction = defer_reduction;
    base.pipeline_ranks = pipeline_ranks;
    base.memory_snapshots = memory_snapshots;
    if (reshard_between_uses) base.reshard_between_uses = true;
    const bool deferred = shardopt::detail::defers_reduction(defer_reduction, pipeline_ranks);

    std::vector<est::Estimate> rows;
    for (int stage : stages) {
      for (int n : ranks) {
        est::Options o = base;
        o.stage = stage;
        o.world = n;
        rows.push_back(est::model_states(o));
      }
    }
    const bool offload = base.offload == est::Offload::CPU;

    if (json) {
      fmt::print("{{\"model\": \"{}\", \"params\": {}, \"precision\": \"{}\", \"optimizer\": \"{}\", "
                 "\"offload\": \"{}\", \"bucket_bytes\": {}, \"align_bytes\": {}, "
                 "\"defer_reduction\": {}, \"rows\": [\n",
                 preset.empty() ? "custom" : "bert-" + preset, psi, precision_arg, optimizer_arg,
                 offload_arg, base.bucket_bytes, base.align_bytes, deferred);
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto& e = rows[i];
        fmt::print("  {{\"stage\": {}, \"ranks\": {}, \"padded_params\": {}, \"P\": {}, \"G\": {}, "
                   "\"K\": {}, \"device\": {}, \"host\": {}, \"total\": {}, "
                   "\"comm_elements\": {}, \"comm_bytes\": {}, \"wire_bytes\": {}, "
                   "\"gathered_units_params\": {}, \"snapshot_slots\": {}}}{}\n",
                   e.options.stage, e.options.world, e.padded_params, e.p, e.g, e.k,
                   json_breakdown(e.device), json_breakdown(e.host), e.total(), e.comm_elements,
                   e.comm_bytes, e.wire_bytes, e.gathered_units_params, e.snapshot_slots,
                   i + 1 < rows.size() ? "," : "");
      }
      fmt::print("]}}\n");
      return 0;
    }

    const est::Estimate& first = rows.front();
    fmt::print("Model: {} — Ψ = {} parameters ({:.1f}M); precision {} (P={} G={} B), optimizer {} "
               "(K={} B), offload {}, buckets {}{}{}\n\n",
               preset.empty() ? "custom" : "BERT-" + preset, psi, psi / 1e6, precision_arg, first.p,
               first.g, optimizer_arg, first.k, offload_arg,
               bucket_mib > 0 ? fmt::format("{:g} MiB", bucket_mib) : "sized from the model",
               std::find(stages.begin(), stages.end(), 3) != stages.end()
                   ? fmt::format(", stage-3 gathered units {:.2f}M params{}",
                                 rows.back().gathered_units_params / 1e6,
                                 units == 0 ? " (two buckets)" : "")
                   : std::string(),
               deferred ? fmt::format(", reduction deferred{} (every bucket kept for the step)",
                                      pipeline_ranks > 1 ? " under --pp" : "")
                        : std::string());
    fmt::print("Per rank, MB = 10^6 bytes{}.\n\n", offload ? "; device + host (offloaded)" : "");
    if (offload) {
      fmt::print("| stage | ranks | params | grads | optim state | buffers | device total | host "
                 "grads | host state | host total | comm elems/step | comm MB/step |\n");
      fmt::print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    } else {
      fmt::print("| stage | ranks | params | grads | optim state | buffers | total | model state | "
                 "comm elems/step | comm MB/step |\n");
      fmt::print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    for (const auto& e : rows) {
      if (offload) {
        fmt::print("| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | "
                   "{:.1f} | {} | {:.1f} |\n",
                   e.options.stage, e.options.world, mb(e.device.params), mb(e.device.grads),
                   mb(e.device.optimizer_state), mb(e.device.buffers), mb(e.device.total()),
                   mb(e.host.grads), mb(e.host.optimizer_state), mb(e.host.total()),
                   e.comm_elements, mb(e.comm_bytes));
      } else {
        fmt::print("| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {} | {:.1f} |\n",
                   e.options.stage, e.options.world, mb(e.device.params), mb(e.device.grads),
                   mb(e.device.optimizer_state), mb(e.device.buffers), mb(e.device.total()),
                   mb(e.device.model_state()), e.comm_elements, mb(e.comm_bytes));
      }
    }
    fmt::print("\nComm per step and rank: 2Ψ elements (stages 0-2), 3Ψ (stage 3); with ring/pairwise "
               "algorithms a rank sends (N-1)/N of the bytes.\n");
    if (memory_snapshots) {
      fmt::print("\nMemorySnapshots, host memory (tmpfs) per rank: two slots of its own and two for "
                 "its buddy, each its 1/N of the master parameters and optimizer state; not in the "
                 "totals above.\n\n| stage | ranks | snapshot slots MB |\n|---:|---:|---:|\n");
      for (const auto& e : rows) {
        fmt::print("| {} | {} | {:.1f} |\n", e.options.stage, e.options.world, mb(e.snapshot_slots));
      }
    }
  } catch (const CLI::Error& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardopt-estimate: %s\n", e.what());
    return 2;
  }
  return 0;
}
