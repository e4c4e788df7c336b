// One BERT-base pretraining step on one GPU (MLM logits at every position, no NSP head: the model
// of bench/gpu_bert_peer.py), through DistributedOptimizer at --stage 2 or 3 (--units explicit, the
// model's declared units, or auto, units from the parameters' names) with bf16 compute and fp32
// master weights, fused AdamW. Reports samples/s (median step time after --warmup) and
// the caching allocator's peak bytes, as one JSON object. Without a GPU: {"skipped": ...}, exit 0.
#include <ATen/Context.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "model.hpp"
#include "shardopt/config.hpp"
#include "shardopt/shardopt.hpp"
#if SHARDOPT_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

long long arg(int argc, char** argv, const char* name, long long fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

// Peak bytes the caching allocator has handed out since the last reset (-1 where unknown).
int64_t peak_allocated() {
#if SHARDOPT_HAS_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return stats.allocated_bytes[0].peak;  // StatType::AGGREGATE
#else
  return -1;
#endif
}

void reset_peak() {
#if SHARDOPT_HAS_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const int stage = static_cast<int>(arg(argc, argv, "--stage", 2));
  const int64_t batch = arg(argc, argv, "--batch", 32);
  const int64_t seq = arg(argc, argv, "--seq", 128);
  const int warmup = static_cast<int>(arg(argc, argv, "--warmup", 3));
  const int steps = static_cast<int>(arg(argc, argv, "--steps", 10));
  bool auto_units = false;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--units") == 0) auto_units = std::strcmp(argv[i + 1], "auto") == 0;
  }
  if (!at::hasCUDA()) {
    std::printf("{\"skipped\": \"this libtorch has no CUDA or no GPU is visible\"}\n");
    return 0;
  }
  torch::manual_seed(0);
  using bert::BertConfig, bert::BertForPreTraining, bert::BertInputs;
  BertConfig config = BertConfig::preset("base");
  config.nsp = false;
  config.mlm_all_positions = true;
  BertForPreTraining model(config);
  model->to(torch::kCUDA);
  shardopt::ZeroOptions zo;
  zo.stage = shardopt::stage_from_int(stage);
  zo.precision = shardopt::Precision::BF16;
  if (stage == 3 && !auto_units) zo.units = model->units();
  auto groups = shardopt::weight_decay_groups(model->named_parameters(), [](const std::string& n) {
    return n.find("bias") != std::string::npos || n.find("LayerNorm") != std::string::npos;
  });
  shardopt::DistributedOptimizer opt(groups, shardopt::AdamW(1e-4).weight_decay(0.01),
                                     shardopt::make_single_communicator(), zo);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kLong);
  const int64_t predictions = (seq * 15 + 99) / 100;
  BertInputs in;
  in.input_ids = torch::randint(config.vocab_size, {batch, seq}, cuda);
  in.token_type_ids = torch::zeros({batch, seq}, cuda);
  in.attention_mask = torch::ones({batch, seq}, cuda);
  in.masked_positions = torch::randint(seq, {batch, predictions}, cuda);
  in.masked_labels = torch::randint(config.vocab_size, {batch, predictions}, cuda);
  in.nsp_labels = torch::zeros({batch}, cuda);

  std::vector<double> ms;
  double loss = 0;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) reset_peak();
    torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    auto out = model->forward(in);
    opt.backward(out.loss);
    opt.step();
    torch::cuda::synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    if (s >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    loss = out.loss.item<double>();
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  std::printf(
      "{\"what\": \"shardopt stage %d%s bf16\", \"batch\": %lld, \"seq\": %lld, \"steps\": %d,\n"
      " \"median_step_ms\": %.2f, \"samples_per_s\": %.1f, \"peak_allocated_bytes\": %lld,\n"
      " \"last_loss\": %.4f}\n",
      stage, stage == 3 ? (auto_units ? " (automatic units)" : " (explicit units)") : "",
      static_cast<long long>(batch), static_cast<long long>(seq), steps, median,
      batch * 1000.0 / median, static_cast<long long>(peak_allocated()), loss);
  return 0;
}
