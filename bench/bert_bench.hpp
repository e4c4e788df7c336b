// The example's BERT under a DistributedOptimizer on one synthetic MLM batch, and one memcpy of a
// rank's state: what async_checkpoint_bench and snapshot_bench time their saves against.
#pragma once

#include <torch/torch.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "model.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/shardopt.hpp"
#include "timing.hpp"

namespace shardopt::bench {

// BERT-<preset> fp32 with AdamW (no decay on biases and LayerNorm) at ZeRO `stage` over the
// grid's data-parallel group; each rank's batch (`batch` rows of `seq` tokens) drawn once.
struct BertBench {
  bert::BertConfig config;
  bert::BertForPreTraining model{nullptr};
  std::unique_ptr<DistributedOptimizer> opt;
  bert::BertInputs in;

  BertBench(const ParallelGroups& groups, const std::string& preset, int stage, int64_t batch,
            int64_t seq) {
    torch::manual_seed(0);
    config = bert::BertConfig::preset(preset);
    model = bert::BertForPreTraining(config);
    ZeroOptions zo;
    zo.stage = stage_from_int(stage);
    zo.grid = groups;
    auto pg = weight_decay_groups(model->named_parameters(), [](const std::string& n) {
      return n.find("bias") != std::string::npos || n.find("LayerNorm") != std::string::npos;
    });
    opt = std::make_unique<DistributedOptimizer>(pg, AdamW(1e-4).weight_decay(0.01), groups.dp, zo);
    torch::manual_seed(1 + groups.world->rank());
    const int64_t predictions = (seq * 15 + 99) / 100;
    const auto ids = torch::TensorOptions().dtype(torch::kLong);
    in.input_ids = torch::randint(config.vocab_size, {batch, seq}, ids);
    in.token_type_ids = torch::zeros({batch, seq}, ids);
    in.attention_mask = torch::ones({batch, seq}, ids);
    in.masked_positions = torch::randint(seq, {batch, predictions}, ids);
    in.masked_labels = torch::randint(config.vocab_size, {batch, predictions}, ids);
    in.nsp_labels = torch::zeros({batch}, ids);
  }
  // forward + backward + step(); its seconds.
  double step() {
    const auto t0 = Clock::now();
    opt->zero_grad();
    auto out = model->forward(in);
    opt->backward(out.loss);
    opt->step();
    return seconds_since(t0);
  }
};

// One memcpy of this rank's state (what a snapshot copies: the owned slices of the master
// parameters and of every optimizer state buffer) into `dst`, allocated and touched once.
inline double memcpy_state(detail::ShardAccess& a, std::vector<char>& dst) {
  std::vector<at::Tensor> parts;
  for (size_t b = 0; b < a.layout().buckets.size(); ++b) {
    parts.push_back(a.owned_param_slice(static_cast<int>(b)));
    for (int k = 0; k < a.state_buffer_count(); ++k) {
      parts.push_back(a.owned_state_slice(k, static_cast<int>(b)));
    }
  }
  size_t bytes = 0;
  for (const auto& t : parts) bytes += t.nbytes();
  if (dst.size() < bytes) dst.assign(bytes, 1);  // touched once, outside the timing
  const auto t0 = Clock::now();
  size_t at = 0;
  for (const auto& t : parts) {
    std::memcpy(dst.data() + at, t.data_ptr(), t.nbytes());
    at += t.nbytes();
  }
  return seconds_since(t0);
}

}  // namespace shardopt::bench
