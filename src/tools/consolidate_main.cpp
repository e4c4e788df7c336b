// shardopt-consolidate: turns a sharded checkpoint directory into one full fp32 state dict file
// {name: tensor} that torch.load (Python) and torch::pickle_load (C++) read.
//
//   shardopt-consolidate out/bert/checkpoint model.pt [--optimizer-state optim.pt]
//   shardopt-consolidate out/bert/checkpoint --info
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"

int main(int argc, char** argv) {
  std::string dir, out, optimizer_out;
  bool info = false;
  CLI::App app{
      "Write the full fp32 state dict of a shardopt checkpoint as one torch.load()-able "
      "file (all shards' checksums are verified)"};
  app.add_option("dir", dir, "checkpoint directory (holds manifest.json)")->required();
  app.add_option("out", out, "output file, e.g. model.pt: {parameter name: tensor}");
  app.add_option("--optimizer-state", optimizer_out,
                 "also write the full optimizer state here: {\"step\", \"rule\", \"param_groups\", "
                 "\"state\": {parameter name: {buffer name: tensor}}}");
  app.add_flag("--info", info, "print what the manifest holds and exit");
  CLI11_PARSE(app, argc, argv);
  try {
    const shardopt::CheckpointInfo ci = shardopt::read_checkpoint_info(dir);
    int64_t elements = 0;
    for (const auto& p : ci.params) {
      int64_t n = 1;
      for (int64_t s : p.shape) n *= s;
      elements += n;
    }
    fmt::print(
        "{}: format {}, step {}, written by {} rank(s) at ZeRO stage {} ({}), {} ({}), "
        "{} parameters, {} elements\n",
        dir, ci.format_version, ci.step, ci.world_size, ci.stage, ci.precision, ci.rule,
        fmt::join(ci.state_names, ", "), ci.params.size(), elements);
    if (info) {
      for (const auto& p : ci.params) {
        fmt::print("  {} [{}] {} (group {})\n", p.name, fmt::join(p.shape, ", "), p.dtype, p.group);
      }
      fmt::print("  trainer state: {}\n", ci.trainer_json);
      return 0;
    }
    if (out.empty()) {
      fmt::print(stderr, "shardopt-consolidate: give an output file (or --info)\n");
      return 2;
    }
    shardopt::ConsolidateOptions options;
    options.optimizer_state_out = optimizer_out;
    shardopt::consolidate_checkpoint(dir, out, options);
    fmt::print("wrote {}{}\n", out,
               optimizer_out.empty() ? "" : fmt::format(" and {}", optimizer_out));
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "shardopt-consolidate: {}\n", e.what());
    return 1;
  }
}
