// bert_pretrain's options: the Args struct, their CLI11 registration, and the checks that turn a
// bad flag or file into one line naming it (exit code 2, printed by rank 0 only). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "corpus.hpp"

namespace CLI {
class App;
}

namespace bert {

struct Args {
  std::vector<std::string> corpus = {kDefaultCorpus};
  std::string corpus_format = "auto";
  std::string vocab;
  int32_t vocab_size = 8000;
  bool cased = false, lower_case = false;  // neither: the vocab's convention (uncased if learned)
  std::string data;
  std::string eval_data;
  int64_t eval_every = 0;           // 0: only at the end (when there is eval data)
  double eval_fraction = 0.05;      // documents held out when the trainer makes the data
  int64_t eval_max_instances = 2048;
  int64_t eval_batch_size = 32;     // rows per eval chunk; part of the eval's result (fixed shapes)
  bool eval_only = false;
  std::string preset = "mini";
  std::string bert_config;      // bert_config.json / config.json instead of --preset
  std::string init_checkpoint;  // model.pt, checkpoint directory, model.safetensors
  std::string export_hf;        // Hugging Face directory written at the end ("" and --save-model: OUT/hf)
  std::string dump_logits;      // --eval-only: the first eval batch's inputs and logits (safetensors)
  std::string device = "cpu";   // cpu | cuda | cuda:N
  int stage = 2;
  std::string units = "explicit";  // stage 3: explicit (the model's Units) | auto (from the names)
  std::string precision = "fp32";
  int64_t batch_size = 8;
  int grad_accum = 1;
  double lr = 5e-4;
  std::string optimizer = "adamw";     // adamw | lamb
  double adam_eps = -1;                // < 0: the optimizer's default (adamw 1e-8, lamb 1e-6)
  std::vector<double> adam_betas = {0.9, 0.999};
  int64_t warmup_steps = 30;
  double warmup_proportion = -1;       // >= 0: warm-up steps = round(proportion * --steps)
  std::string lr_schedule = "linear";  // after the warm-up: linear | constant | cosine
  int64_t steps = 300;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;
  double timeout_s = 0;  // collective deadline; 0: SHARDOPT_TIMEOUT or the library's default
  int64_t checkpoint_every = 0;  // 0: only the final checkpoint
  int keep_checkpoints = 1;      // committed saves kept under OUT/checkpoint
  bool async_checkpoints = false;  // write them on a background thread
  int64_t snapshot_every = 0;      // 0: no snapshots in memory (shardopt::MemorySnapshots)
  std::string snapshot_dir;        // empty: /dev/shm/shardopt-<hash of OUT>; {host}: rank / H
  int ranks_per_host = 0;          // 0: counted from the hosts
  bool save_model = false;       // also OUT/model.pt, consolidated, at the end
  std::string resume;
  bool resume_requested = false;  // --resume given (its value may be empty: OUT/checkpoint)
  int64_t stop_after = 0;
  std::string out = "out/bert";
  uint64_t seed = 42;
  int32_t max_seq_length = 128;
  int32_t max_predictions = 20;
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  int32_t dupe_factor = 5;
  bool whole_word_mask = false;
  double dropout = -1;  // < 0: the preset's 0.1
  int threads = 1;
  int64_t log_every = 10;
  std::string progress = "auto";
  bool no_plot = false;
  bool check_loss_decrease = false;
  std::string golden;        // "step loss" lines to compare against
  double golden_tol = 0.05;  // absolute
  std::string write_golden;
  double bucket_mb = 0;  // 0: the library's default
  bool synthetic = false;             // random-token MLM batches, no corpus
  bool no_nsp = false;
  std::string mlm_positions = "preset";  // masked | all | preset
  std::string attn_implementation = "auto";  // auto | sdpa | eager (BertConfig)
  int64_t timing_warmup = 5;          // first steps left out of the timing medians
  double block_cache_mb = 1024;       // freed blocks >= 32 MiB kept for reuse; 0: off
  bool no_overlap = false;
  bool defer_reduction = false;        // bucketed gradients reduced once per step (ZeroOptions)
  bool recompute = false;  // every encoder layer recomputed in backward
  int shard_group_size = 0;            // hybrid sharding; 0: over all ranks
  int tp = 1;                          // tensor-parallel ranks (world = tp x data-parallel)
  bool sequence_parallel = false;      // with --tp: LayerNorm/dropout split along the sequence
  int pp = 1;                          // pipeline stages (world = tp x data-parallel x pp)
  int micro_batches = 0;               // --micro-batches M: --grad-accum M, run as a pipeline
  std::string schedule = "1f1b";       // gpipe | 1f1b | interleaved | zb-h1
  int virtual_stages = 1;              // model chunks per pipeline rank (interleaved)
  std::string reduce_dtype = "fp32";  // dtype gradients are reduced in

  bool corpus_given = false;  // --corpus was passed (else the default is announced)
};

// The subcommands and what they write.
struct Commands {
  CLI::App* build_vocab = nullptr;
  CLI::App* create_data = nullptr;
  CLI::App* tokenize = nullptr;
  std::string output;       // -o of build-vocab / create-data
  std::string input;        // -i of tokenize
  std::string eval_output;  // create-data --eval-output
};

// Registers the trainer's options and subcommands on `app`.
void add_options(CLI::App& app, Args& a, Commands& c);

// What the options mean together and what the files hold: "" when fine, else one line naming the
// flag and what is allowed. Reads only headers and file metadata (no collective: every rank can
// call it and reach the same verdict on the same files).
std::string check_args(const Args& a, const Commands& c);

// The vocabulary next to a data file (DATA.vocab.txt, or vocab.txt in its folder), or "".
std::string vocab_next_to(const std::string& data);

// Fills in what other options imply (--warmup-proportion -> warmup_steps). Call after parsing.
void resolve_args(Args& a);

// --adam-eps as given, else the optimizer's default.
double adam_eps(const Args& a);

// The learning rate of step `step` (0-based): linear warm-up over warmup_steps to --lr, then
// --lr-schedule: linear decay to 0 at --steps (BERT's), constant, or a cosine to 0.
double lr_at(const Args& a, int64_t step);

}  // namespace bert
