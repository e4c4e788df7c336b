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

// --export-hf DIR (and OUT/hf with --save-model): the fp32 master parameters of `checkpoint` when
// given, else the model's own, gathered; rank 0 writes.
void export_model(Run& r, const std::string& checkpoint);

// The end of training: the final state is always saved (a stopped run too: --resume continues
// it), model.pt and the Hugging Face export with --save-model / --export-hf.
void finish(Run& r);

// summary.json and the closing lines (rank 0); returns rank 0's exit code on every rank
// (--golden, --check-loss-decrease).
int summarize(Run& r);

}  // namespace bert
