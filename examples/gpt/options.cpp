#include "options.hpp"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "common/cli.hpp"
#include "config.hpp"

namespace gpt {
namespace fs = std::filesystem;

using examples::integer_at_least;
using examples::number;

void add_options(CLI::App& app, Args& a) {
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--corpus", a.corpus,
                 "folder (or file) of text to train on; its bytes are the "
                 "tokens (vocabulary 256); default: the repository's tests/assets/corpus");
  app.add_option("--preset", a.preset, "model shape: tiny | mini | small (GPT-2 small's shape)")
      ->check(CLI::IsMember(GptConfig::preset_names()));
  app.add_option("--layers", a.layers, "decoder layers (default: the preset's)")
      ->check(integer_at_least(1));
  app.add_option("--hidden", a.hidden, "hidden size (default: the preset's)")
      ->check(integer_at_least(1));
  app.add_option("--heads", a.heads, "attention heads (default: the preset's)")
      ->check(integer_at_least(1));
  app.add_option("--steps", a.steps, "optimizer steps (where the learning rate reaches 0)")
      ->check(integer_at_least(1));
  app.add_option("--lr", a.lr, "peak learning rate (AdamW)")->check(number(0, true));
  app.add_option("--warmup-steps", a.warmup_steps, "linear warm-up steps")
      ->check(integer_at_least(0));
  app.add_option("--batch-size", a.batch_size, "sequences per data-parallel rank per micro-step")
      ->check(integer_at_least(1));
  app.add_option("--max-seq-length", a.max_seq_length, "tokens (bytes) per sequence")
      ->check(integer_at_least(2));
  app.add_option("--dropout", a.dropout,
                 "embedding, attention and residual dropout (default: "
                 "the preset's 0.1)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--stage", a.stage, "ZeRO stage")->check(CLI::Range(0, 3));
  app.add_option("--grad-accum", a.grad_accum, "micro-steps per optimizer step")
      ->check(integer_at_least(1));
  app.add_option("--weight-decay", a.weight_decay,
                 "AdamW's decoupled weight decay (not on biases "
                 "and LayerNorms)")
      ->check(number(0, false));
  app.add_option("--max-grad-norm", a.max_grad_norm,
                 "global gradient clipping (0: none, and no "
                 "gradient norm is computed or reported)")
      ->check(number(0, false));
  app.add_option("--dtype", a.dtype,
                 "float32 | float64: the parameters' and activations' dtype "
                 "(float64: layouts agree to rounding, for tests)")
      ->check(CLI::IsMember({"float32", "float64"}));
  app.add_option("--tp", a.tp,
                 "tensor parallelism: split each layer, the embedding and the LM head "
                 "over this many consecutive ranks")
      ->check(integer_at_least(1));
  app.add_option("--pp", a.pp,
                 "pipeline parallelism: this many stages of layers (the embeddings "
                 "on the first, the head on the last); world = T x D x P")
      ->check(integer_at_least(1));
  app.add_option("--schedule", a.schedule, "with --pp: gpipe | 1f1b | interleaved | zb-h1")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1"}));
  app.add_option("--virtual-stages", a.virtual_stages,
                 "with --schedule interleaved: model chunks "
                 "per pipeline rank (V >= 2)")
      ->check(integer_at_least(1));
  app.add_option("--micro-batches", a.micro_batches,
                 "with --pp: the M micro-batches a step "
                 "pipelines (what --grad-accum M accumulates)")
      ->check(integer_at_least(1));
  app.add_option("--out", a.out, "output folder: metrics.jsonl, checkpoint/");
  app.add_option("--resume", a.resume,
                 "continue from a checkpoint (default folder: "
                 "OUT/checkpoint): parameters, optimizer, step, RNG")
      ->expected(0, 1);
  app.add_option("--stop-after", a.stop_after,
                 "stop after N steps of this run and save, as if "
                 "preempted (the schedule still spans --steps)")
      ->check(integer_at_least(0));
  app.add_option("--golden", a.golden,
                 "compare with this \"step loss [grad_norm]\" file; exit 4 "
                 "beyond --golden-tol (and --golden-norm-tol)");
  app.add_option("--golden-tol", a.golden_tol, "largest absolute loss difference to --golden")
      ->check(number(0, false));
  app.add_option("--golden-norm-tol", a.golden_norm_tol,
                 "largest relative difference of the "
                 "gradient norm to --golden's third column (default: not compared)");
  app.add_option("--write-golden", a.write_golden, "write \"step loss grad_norm\" lines here");
  app.add_option("--progress", a.progress,
                 "tty: one line rewritten with \\r; lines: a "
                 "parseable line per step; auto: tty on a terminal outside mpirun")
      ->check(CLI::IsMember({"auto", "tty", "lines"}));
  app.add_option("--seed", a.seed, "seed of the weights, the rows and dropout");
  app.add_option("--threads", a.threads, "torch threads per rank")->check(integer_at_least(1));
  app.add_option("--timeout", a.timeout_s,
                 "seconds a rank waits in any collective (default: "
                 "SHARDOPT_TIMEOUT, else the library's)")
      ->check(number(0, false));
}

std::string check_args(const Args& a) {
  std::error_code ec;
  if (a.corpus.empty())
    return "--corpus: required (a folder of text files, e.g. tests/assets/corpus)";
  if (!fs::exists(a.corpus, ec))
    return fmt::format("--corpus: no such file or folder '{}'", a.corpus);
  if (a.pp == 1) {
    if (a.micro_batches > 0) return "--micro-batches: needs --pp 2 or more (else: --grad-accum)";
    if (a.virtual_stages > 1)
      return "--virtual-stages: needs --pp 2 or more and --schedule interleaved";
  } else {
    if (a.micro_batches > 0 && a.grad_accum != 1 && a.grad_accum != a.micro_batches) {
      return fmt::format("--micro-batches {} contradicts --grad-accum {}: give one of them",
                         a.micro_batches, a.grad_accum);
    }
    if ((a.virtual_stages > 1) != (a.schedule == "interleaved")) {
      return "--virtual-stages: V >= 2 goes with --schedule interleaved, and only with it";
    }
    const int m = a.micro_batches > 0 ? a.micro_batches : a.grad_accum;
    if (a.schedule == "interleaved" && m < a.pp) {
      // Megatron-core's rule (Note [Micro-batch groups]): any m >= p runs, in groups of N.
      return fmt::format("--schedule interleaved: --micro-batches {} must be at least --pp {} "
                         "(Megatron-core: p <= microbatch_group_size_per_vp_stage <= m)",
                         m, a.pp);
    }
  }
  GptConfig c = GptConfig::preset(a.preset);
  if (a.layers > 0) c.layers = a.layers;
  if (a.hidden > 0) c.hidden = a.hidden;
  if (a.heads > 0) c.heads = a.heads;
  if (auto why = c.check(a.tp, a.pp * a.virtual_stages); !why.empty()) return why;
  if (a.max_seq_length > c.n_ctx) {
    return fmt::format("--max-seq-length {} exceeds the model's {} positions (--preset {})",
                       a.max_seq_length, c.n_ctx, a.preset);
  }
  if (a.resume_requested) {
    const fs::path dir = a.resume.empty() ? fs::path(a.out) / "checkpoint" : fs::path(a.resume);
    if (!fs::is_directory(dir, ec) || fs::is_empty(dir, ec)) {
      return fmt::format("--resume: no checkpoint in '{}'", dir.string());
    }
  }
  if (!a.golden.empty() && !fs::is_regular_file(a.golden, ec)) {
    return fmt::format("--golden: no such file '{}'", a.golden);
  }
  return "";
}

double lr_at(const Args& a, int64_t step) {
  if (step < a.warmup_steps) return a.lr * static_cast<double>(step + 1) / a.warmup_steps;
  const double rest = static_cast<double>(a.steps - a.warmup_steps);
  if (rest <= 0) return a.lr;
  return a.lr * std::max(0.0, static_cast<double>(a.steps - step) / rest);
}

}  // namespace gpt
