// What a bert_pretrain run leaves behind: checkpoints, model.pt, the Hugging Face export,
// summary.json and the closing lines. Every function here is collective: all ranks call it.
#pragma once

#include <cstdint>
#include <string>

#include "run.hpp"

namespace bert {

// Saves the run as of step `done` into OUT/checkpoint with the model's buffers, frozen parameters
// and tied aliases (model_save_options), so its consolidated model.pt is the whole state dict;
// skipped, with a line, when a parameter is NaN/Inf.
void save(Run& r, int64_t done);

// What a checkpoint or a snapshot of step `done` keeps besides the optimizer: the run state (step,
// data position, losses, schedule, layout) and the generators.
shardopt::TrainerState run_trainer_state(Run& r, int64_t done);

// --snapshot-every: the state of step `done` into host memory and the buddy's
// (shardopt::MemorySnapshots); the step waits for one copy only.
void snapshot(Run& r, int64_t done);

// --export-hf DIR (and OUT/hf with --save-model), from any layout: the optimizer's fp32 master
// parameters streamed by shardopt::export_hf_safetensors, each stage's file(s) written by its
// data-parallel rank 0 of tensor rank 0; prints the files and the extra memory per rank.
void export_model(Run& r);

// The end of training: the final state is always saved (a stopped run too: --resume continues
// it), the snapshots in memory removed, model.pt and the Hugging Face export with --save-model /
// --export-hf.
void finish(Run& r);

// summary.json and the closing lines (rank 0); returns rank 0's exit code on every rank
// (--golden, --check-loss-decrease).
int summarize(Run& r);

}  // namespace bert
