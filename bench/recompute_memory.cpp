// Activation memory with and without recomputation: BERT (the example's model, dropout 0.1) through
// DistributedOptimizer at --stage 2 or 3 on the ranks of the launcher (mpirun -np 2 ...). Steps
// alternate between plain and every-encoder-layer-recomputed (BertForPreTraining::set_recompute),
// same model, optimizer and process, so both see the same machine load. Per mode: the median of
// the peak tracked bytes during a step above what was live when it began (rank 0's and the
// largest over ranks) and the median step time. One JSON object on rank 0's stdout.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "data.hpp"
#include "model.hpp"
#include "shardopt/shardopt.hpp"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BERT step: peak tracked bytes and step time with and without recomputation"};
  std::string model_name = "base";
  int stage = 2, steps = 3, warmup = 1;
  int64_t batch = 1, seq = 128;
  app.add_option("--model", model_name, "BERT preset");
  app.add_option("--stage", stage, "ZeRO stage")->check(CLI::Range(0, 3));
  app.add_option("--batch", batch, "sequences per rank")->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "sequence length")->check(CLI::Range(8, 512));
  app.add_option("--steps", steps, "measured steps per mode")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "unmeasured steps per mode first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  auto comm = shardopt::init_from_env();
  at::set_num_threads(1);
  shardopt::ScopedMemoryTracking tracking;
  auto& tracker = tracking.tracker();
  bert::BertConfig config = bert::BertConfig::preset(model_name);
  torch::manual_seed(0);
  bert::BertForPreTraining model(config);
  model->train();
  shardopt::ZeroOptions zo;
  zo.stage = shardopt::stage_from_int(stage);
  zo.units = model->units();
  shardopt::DistributedOptimizer opt(model->named_parameters(),
                                     shardopt::AdamW(1e-4).weight_decay(0.01), comm, zo);

  std::vector<double> peak[2], ms[2];
  for (int s = 0; s < 2 * (warmup + steps); ++s) {
    const int mode = s % 2;  // 0 plain, 1 recomputed: interleaved
    model->set_recompute(mode == 1);
    const auto b = bert::synthetic_batch(batch, seq, config.vocab_size, 0.15, 103, 0, s,
                                         comm->rank());
    const auto inputs = bert::to_inputs(b);
    comm->barrier();
    const int64_t live = tracker.live_bytes();
    tracker.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    auto out = model->forward(inputs);
    opt.backward(out.loss);
    opt.step();
    const auto t1 = std::chrono::steady_clock::now();
    if (s / 2 < warmup) continue;
    peak[mode].push_back(static_cast<double>(tracker.peak_bytes() - live));
    ms[mode].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  // Largest peak over ranks (the step time is rank 0's: ranks wait for each other every step).
  auto peaks = torch::tensor({median(peak[0]), median(peak[1])}, torch::kDouble);
  auto largest = peaks.clone();
  comm->all_reduce(largest, shardopt::ReduceOp::Max);
  if (comm->rank() == 0) {
    nlohmann::json j = {
        {"model", model_name}, {"stage", stage}, {"ranks", comm->size()}, {"batch_per_rank", batch},
        {"seq", seq}, {"steps_per_mode", steps},
        {"plain", {{"peak_step_bytes", peaks[0].item<double>()},
                   {"peak_step_bytes_max_rank", largest[0].item<double>()},
                   {"median_step_ms", median(ms[0])}}},
        {"recompute", {{"peak_step_bytes", peaks[1].item<double>()},
                       {"peak_step_bytes_max_rank", largest[1].item<double>()},
                       {"median_step_ms", median(ms[1])}}},
        {"peak_ratio", largest[1].item<double>() / largest[0].item<double>()},
        {"time_ratio", median(ms[1]) / median(ms[0])}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}
