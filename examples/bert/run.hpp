// What the stages of a bert_pretrain run share: set up by set_up, load_data and build_model,
// advanced by train_loop (train.cpp), saved and reported by outputs.hpp's stages.
#pragma once

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_cache.hpp"
#include "checkpointing.hpp"
#include "data.hpp"
#include "metrics.hpp"
#include "model.hpp"
#include "options.hpp"
#include "pipeline_stages.hpp"
#include "prepare.hpp"
#include "shardopt/shardopt.hpp"
#include "test_fault.hpp"

namespace bert {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// An error in the user's input, found after start-up: printed as one line, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Where batches come from: the pretraining file of prepare_on_rank0, or random tokens.
struct BatchSource {
  std::unique_ptr<PretrainingData> data;
  std::unique_ptr<BatchLoader> loader;
  const Args* args = nullptr;
  int64_t vocab_size = 0;
  int rank = 0;
  Batch batch(int64_t index) {
    if (loader) return loader->batch(index);
    return synthetic_batch(args->batch_size, args->max_seq_length, vocab_size,
                           args->masked_lm_prob, kSyntheticMaskId, args->seed, index, rank);
  }
  static constexpr int64_t kSyntheticMaskId = 103;  // [MASK] in BERT's uncased vocabulary
};

// One run of the trainer (train.cpp's train(): set_up, load_data, build_model, restore, the
// loop, finish, summarize).
struct Run {
  const Args& a;
  shardopt::CommunicatorPtr comm;
  shardopt::InitOptions init;
  int rank = 0, world = 1;
  bool lead = false;
  torch::Device device{torch::kCPU};
  Clock::time_point t_start = Clock::now();
  std::unique_ptr<ScopedBlockCache> block_cache;
  std::optional<shardopt::ScopedMemoryTracking> tracking;
  int64_t tracked_peak = 0;  // tensor bytes, the run's peak before the current step's window
  // Data.
  BertConfig config;
  BatchSource loader;
  Prepared prepared;
  std::unique_ptr<PretrainingData> eval_data;
  int64_t max_seq_length = 0;
  // Model and optimizer.
  BertForPreTraining model{nullptr};
  std::unique_ptr<shardopt::DistributedOptimizer> opt;
  // --async-checkpoints: saves written in the background (after opt: destroyed, joined, first).
  std::unique_ptr<shardopt::AsyncCheckpoint> saver;
  int64_t async_step = -1;  // the step of the save in flight
  // --snapshot-every: the state in host memory (after opt: destroyed, joined, first).
  std::unique_ptr<shardopt::MemorySnapshots> snapshots;
  double restore_s = -1;  // a snapshot's restore, for the recovery line after the first step
  int64_t global_batch = 0;
  // Progress: checkpoints, metrics, evaluations.
  fs::path checkpoint_dir, metrics_path;
  std::ofstream metrics;
  nlohmann::json schedule;  // what the trajectory depends on; compared on resume
  RunState state;           // step, data position, losses, training time, tokens
  int64_t start_step = 0, last_saved = -1, run_samples = 0, run_tokens = 0;
  double start_train_s = 0;  // training seconds before this run (a resumed run's)
  std::vector<std::vector<double>> timings;  // rank 0: [step of this run][rank * kTimings + Timing]
  nlohmann::json last, first_eval, last_eval;
  std::unique_ptr<ProgressLine> progress;
  TestFault fault = TestFault::from_env();
  std::string hf_export;  // the directory written, if any

  // The rank grid (--tp): the data-parallel group `dp` (the optimizer's, the data's, the
  // metrics' sums) and the tensor-parallel group; at --tp 1 dp is the world.
  shardopt::ParallelGroups groups;
  shardopt::CommunicatorPtr dp;
  std::unique_ptr<PipelineStages> pipeline;  // --pp > 1: this rank's stages (Note [Pipelined BERT])

  Run(const Args& args, shardopt::CommunicatorPtr c, shardopt::InitOptions options)
      : a(args), comm(std::move(c)), init(std::move(options)), rank(comm->rank()),
        world(comm->size()), lead(rank == 0), device(args.device) {}
  int tp() const { return groups.layout.tp; }
  int pp() const { return groups.layout.pp; }
  std::string clear() const { return progress ? progress->prefix() : ""; }
};

}  // namespace bert
