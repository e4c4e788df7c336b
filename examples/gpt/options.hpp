// gpt_train's options, spelled as bert_pretrain's (--preset, --steps, --lr, --tp, --pp, ...), their
// CLI11 registration and the checks that turn a bad combination into one line naming it (exit 2,
// printed by rank 0). Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace CLI {
class App;
}

// The build's tests/assets/corpus (the licence texts), set by examples/CMakeLists.txt.
#ifndef GPT_DEFAULT_CORPUS
#define GPT_DEFAULT_CORPUS ""
#endif

namespace gpt {

struct Args {
  std::string corpus = GPT_DEFAULT_CORPUS;  // a folder (or file) of text; bytes are the tokens
  std::string preset = "tiny";
  int64_t layers = 0, hidden = 0, heads = 0;  // 0: the preset's
  int64_t steps = 100;
  double lr = 1e-3;
  int64_t warmup_steps = 10;
  int64_t batch_size = 8;  // sequences per data-parallel rank per micro-batch
  int64_t max_seq_length = 64;
  double dropout = -1;  // < 0: the preset's 0.1
  int stage = 2;
  int grad_accum = 1;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;
  std::string dtype = "float32";  // float32 | float64 (exact comparisons across layouts)
  int tp = 1, pp = 1;
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1
  int virtual_stages = 1;
  int micro_batches = 0;  // --pp's name for --grad-accum
  std::string out = "out/gpt";
  std::string resume;  // "" with resume_requested: OUT/checkpoint
  bool resume_requested = false;
  int64_t stop_after = 0;  // stop (and save) after N steps of this run
  std::string golden, write_golden;
  double golden_tol = 0.05;       // absolute, on the loss
  double golden_norm_tol = -1;    // relative, on the gradient norm; < 0: not compared
  std::string progress = "auto";  // auto | tty | lines
  uint64_t seed = 42;
  int threads = 1;
  double timeout_s = 0;
};

// Registers the options on `app` (a later occurrence of an option wins).
void add_options(CLI::App& app, Args& a);
// "" when the options agree with each other and the files exist, else one line naming the flag.
// Local: every rank reaches the same verdict on the same arguments.
std::string check_args(const Args& a);
// The learning rate of 0-based step `step`: linear warm-up to --lr, then linear decay to 0 at
// --steps (BERT's and GPT-2's fine-tuning schedule).
double lr_at(const Args& a, int64_t step);

}  // namespace gpt
