// bert_pretrain's options and their checks (see options.hpp).
#include "options.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>

#include "bert_config.hpp"
#include "data.hpp"
#include "tokenizer.hpp"
#include "common/cli.hpp"

namespace bert {
namespace fs = std::filesystem;
using examples::integer_at_least;
using examples::integer_in;
using examples::number;

namespace {

// The header of a data file, or the reason it is not one.
std::string read_header(const std::string& path, DataHeader* h) {
  try {
    PretrainingData d(path);
    *h = d.header();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

std::string vocab_next_to(const std::string& data) {
  std::error_code ec;
  for (const fs::path& p : {fs::path(data + ".vocab.txt"), fs::path(data).parent_path() / "vocab.txt"}) {
    if (fs::is_regular_file(p, ec)) return p.string();
  }
  return "";
}

void add_options(CLI::App& app, Args& a, Commands& c) {
  // A later occurrence of an option wins (scripts pass defaults, users append overrides).
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--corpus", a.corpus, "named corpus (manpages-intl: Debian's manpages-dev and its "
                 "French, German and Spanish translations; manpages: the English pages; licenses: "
                 "/usr/share/common-licenses) or text files and directories")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--corpus-format", a.corpus_format, "auto | sentences | prose | man")
      ->check(CLI::IsMember({"auto", "sentences", "prose", "man"}));
  app.add_option("--vocab", a.vocab, "WordPiece vocab.txt (default: learned from the corpus, or "
                 "the one next to --data)");
  app.add_option("--vocab-size", a.vocab_size, "size of the learned vocabulary")
      ->check(integer_in(6, 1 << 20));
  auto* cased = app.add_flag("--cased", a.cased, "keep case and accents (BERT's do_lower_case="
                             "False; default: the vocabulary's convention)");
  auto* lower = app.add_flag("--lower-case", a.lower_case, "lower-case and strip accents "
                             "(do_lower_case=True; the default for a learned or uncased vocabulary)");
  cased->excludes(lower);
  app.add_option("--data", a.data, "pretraining data file from create-data (default: made from "
                 "the corpus and cached under OUT/cache)");
  app.add_option("--eval-data", a.eval_data, "held-out data file (create-data --eval-output; "
                 "default without --data: the held-out documents of the corpus)");
  app.add_option("--eval-every", a.eval_every, "evaluate every N steps (0: at the end only)")
      ->check(integer_at_least(0));
  app.add_option("--eval-fraction", a.eval_fraction, "documents held out for evaluation when the "
                 "data is made from the corpus (0: none)")->check(number(0, false, 0.5));
  app.add_option("--eval-max-instances", a.eval_max_instances, "at most this many held-out "
                 "instances (the eval set)")->check(integer_at_least(1));
  app.add_option("--eval-batch-size", a.eval_batch_size, "rows per evaluation batch")
      ->check(integer_at_least(1));
  app.add_flag("--eval-only", a.eval_only, "evaluate the model (with --resume: the checkpoint's) "
               "and exit");
  auto* preset = app.add_option("--preset", a.preset, "named config: tiny | mini | small | base | "
                                "large | peer")
      ->check(CLI::IsMember(BertConfig::preset_names()));
  app.add_option("--bert-config", a.bert_config, "the model from a Google bert_config.json or a "
                 "Hugging Face config.json instead of --preset")
      ->excludes(preset);
  app.add_option("--init-checkpoint", a.init_checkpoint, "start from these weights: a model.pt, "
                 "a shardopt checkpoint directory, a model.safetensors or a Hugging Face "
                 "directory (fresh optimizer, step 0)");
  app.add_option("--export-hf", a.export_hf, "at the end, write a Hugging Face BertForPreTraining "
                 "directory here, from any --tp/--pp/stage: config.json, model.safetensors (or "
                 "model-0000k-of-0000n.safetensors and model.safetensors.index.json), vocab.txt, "
                 "tokenizer files (--save-model: OUT/hf)");
  app.add_option("--dump-logits", a.dump_logits, "with --eval-only: write the first eval batch's "
                 "inputs, MLM logits (at its masked positions) and NSP logits to this safetensors "
                 "file");
  app.add_option("--device", a.device, "cpu | cuda | cuda:N: where the model and batches live "
                 "(cuda: NCCL between ranks where built with it)");
  app.add_option("--stage", a.stage, "ZeRO stage")->check(integer_in(0, 3));
  app.add_option("--units", a.units, "stage 3's units: explicit (the model declares one per layer "
                 "and runs each through Units::run) | auto (the model is built without Units and "
                 "the optimizer derives them from the parameter names)")
      ->check(CLI::IsMember({"explicit", "auto"}));
  app.add_option("--precision", a.precision, "fp32 | bf16 (CPU) | fp16 (GPU only)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  app.add_option("--batch-size", a.batch_size, "sequences per rank per micro-step")
      ->check(integer_at_least(1));
  app.add_option("--grad-accum", a.grad_accum, "micro-steps per optimizer step")
      ->check(integer_at_least(1));
  app.add_option("--lr", a.lr, "peak learning rate")->check(number(0, true));
  app.add_option("--optimizer", a.optimizer, "adamw | lamb (LAMB: Adam's update scaled per tensor "
                 "by ||w|| / ||update||, for large batches) | adafactor (torch.optim.Adafactor's "
                 "defaults but --lr and --weight-decay; no betas or eps) | adamw8bit (AdamW with "
                 "blockwise 8-bit moments, bitsandbytes' AdamW8bit) | muon "
                 "(torch.optim.Muon on the encoder's matrices, Newton-Schulz in bf16, the update "
                 "RMS matched to AdamW's; AdamW on embeddings, biases and LayerNorm)")
      ->check(CLI::IsMember({"adamw", "lamb", "adafactor", "adamw8bit", "muon"}));
  app.add_option("--adam-eps", a.adam_eps, "Adam's epsilon (default: adamw 1e-8 as torch, lamb "
                 "1e-6; BERT's recipe: 1e-6)")->check(number(0, true));
  app.add_option("--adam-betas", a.adam_betas, "Adam's beta1,beta2")
      ->delimiter(',')->expected(2)->check(number(0, false, 0.999999));
  auto* warmup = app.add_option("--warmup-steps", a.warmup_steps, "linear warm-up steps")
      ->check(integer_at_least(0));
  app.add_option("--warmup-proportion", a.warmup_proportion, "warm-up as a share of --steps "
                 "(BERT's warmup_proportion, e.g. 0.1)")
      ->check(number(0, false, 1))->excludes(warmup);
  app.add_option("--lr-schedule", a.lr_schedule, "after the warm-up: linear (decay to 0 at "
                 "--steps, BERT's) | constant | cosine (to 0 at --steps)")
      ->check(CLI::IsMember({"linear", "constant", "cosine"}));
  app.add_option("--steps", a.steps, "optimizer steps (where --lr-schedule ends)")
      ->check(integer_at_least(1));
  app.add_option("--weight-decay", a.weight_decay, "decoupled weight decay of AdamW and LAMB (not "
                 "on bias and LayerNorm)")->check(number(0, false));
  app.add_option("--timeout", a.timeout_s, "seconds a rank waits for the others in any collective "
                 "before the job ends with an error (default: SHARDOPT_TIMEOUT, else 600)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-grad-norm", a.max_grad_norm, "global gradient clipping, 0 disables")
      ->check(number(0, false));
  app.add_option("--checkpoint-every", a.checkpoint_every, "also save OUT/checkpoint every N steps "
                 "of this run (the final state is always saved; atomically: the previous "
                 "checkpoint stays until the new one is complete)")->check(integer_at_least(0));
  app.add_option("--keep-checkpoints", a.keep_checkpoints, "committed saves kept under "
                 "OUT/checkpoint (each save commits the whole grid with one record; older ones "
                 "are removed once the new one is committed)")->check(integer_at_least(1));
  app.add_flag("--async-checkpoints", a.async_checkpoints, "write checkpoints on a background "
               "thread: a save blocks the step only for a copy of the state into host memory "
               "(shardopt::AsyncCheckpoint); the blocking and background times are printed");
  app.add_option("--snapshot-every", a.snapshot_every, "keep the state in host memory every K "
                 "steps, on this host (tmpfs) and on a buddy rank of the next host "
                 "(shardopt::MemorySnapshots); a restarted run (scripts/shardopt-run) continues "
                 "from the newest one, else from OUT/checkpoint (0: none)")
      ->check(integer_at_least(0));
  app.add_option("--snapshot-dir", a.snapshot_dir, "this host's directory of the snapshots "
                 "(default: /dev/shm/shardopt-<hash of OUT>); `{host}` becomes the rank's host "
                 "number (rank / --ranks-per-host), to emulate hosts on one machine");
  app.add_option("--ranks-per-host", a.ranks_per_host, "ranks on each host, so that a rank's "
                 "buddy (rank + H) is on the next host (0: counted)")->check(integer_at_least(0));
  app.add_flag("--save-model", a.save_model, "at the end, also write OUT/model.pt (the whole "
               "state dict, torch.load()-able, strict-loadable into Hugging Face's "
               "BertForPreTraining) and OUT/hf (--export-hf)");
  app.add_option("--resume", a.resume, "continue from a checkpoint: optimizer, "
                                "step, data position, RNG and LR schedule (default directory: "
                                "OUT/checkpoint)")
      ->expected(0, 1);
  app.add_option("--stop-after", a.stop_after, "stop after N steps of this run, as if preempted "
                 "(the LR schedule still spans --steps; --resume continues)")
      ->check(integer_at_least(0));
  app.add_option("--out", a.out, "output directory (metrics.jsonl, loss.png, summary.json, "
                 "config.json, checkpoint/, cache/; model.pt and hf/ with --save-model)");
  app.add_option("--seed", a.seed, "seed of the data, the model and the batch order");
  app.add_option("--max-seq-length", a.max_seq_length)->check(integer_in(8, 512));
  app.add_option("--max-predictions", a.max_predictions, "masked positions per sequence at most")
      ->check(integer_at_least(1));
  app.add_option("--masked-lm-prob", a.masked_lm_prob)->check(number(0, false, 1));
  app.add_option("--short-seq-prob", a.short_seq_prob)->check(number(0, false, 1));
  app.add_option("--dupe-factor", a.dupe_factor, "times each document is masked differently")
      ->check(integer_at_least(1));
  app.add_flag("--whole-word-mask", a.whole_word_mask, "mask all pieces of a word together");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout (default: the config's, "
                 "BERT's 0.1)")
      ->check(number(0, false, 1));
  app.add_option("--threads", a.threads, "torch threads per rank")->check(integer_at_least(1));
  app.add_option("--log-every", a.log_every, "steps between progress lines when not on a terminal")
      ->check(integer_at_least(1));
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size in MiB (0: the library's default)")
      ->check(number(0, false));
  app.add_option("--progress", a.progress, "tty: a progress bar rewritten with \\r; lines: a plain "
                 "line every --log-every steps; auto: tty when stdout is a terminal and the process "
                 "was not started by mpirun (which gives ranks a terminal even when its own output "
                 "is redirected)")
      ->check(CLI::IsMember({"auto", "tty", "lines"}));
  app.add_flag("--synthetic", a.synthetic, "random-token MLM batches (uniform over the preset's "
               "vocabulary, --masked-lm-prob masked, --max-seq-length long), no corpus; NSP off");
  app.add_flag("--no-nsp", a.no_nsp, "no pooler and next-sentence head: MLM only");
  app.add_option("--mlm-positions", a.mlm_positions, "masked: MLM logits only at masked positions "
                 "(Google); all: at every position (Hugging Face); preset: the preset's choice")
      ->check(CLI::IsMember({"masked", "all", "preset"}));
  app.add_option("--attn-implementation", a.attn_implementation, "sdpa: torch's fused "
                 "scaled_dot_product_attention (torch 2.1+); eager: matmul, softmax, dropout, matmul; "
                 "auto: sdpa where available (Hugging Face's names)")
      ->check(CLI::IsMember({"auto", "sdpa", "eager"}));
  app.add_option("--timing-warmup", a.timing_warmup, "first steps left out of the timing medians "
                 "in summary.json")->check(integer_at_least(0));
  app.add_option("--block-cache-mb", a.block_cache_mb, "keep freed tensor blocks of >= 32 MiB (up "
                 "to this many MiB) for the next allocation of their size; 0: off")
      ->check(number(0, false));
  app.add_option("--shard-group-size", a.shard_group_size, "hybrid sharding: shard within groups "
                 "of this many consecutive ranks (the ranks of a host), replicate across groups; "
                 "0: over all ranks")->check(CLI::NonNegativeNumber);
  app.add_option("--tp", a.tp, "tensor parallelism: split each encoder layer, the embeddings and "
                 "the MLM decoder over this many consecutive ranks (Megatron's layers); the "
                 "optimizer shards over the world / T data-parallel ranks")
      ->check(integer_at_least(1));
  app.add_flag("--sequence-parallel", a.sequence_parallel, "with --tp: keep LayerNorm, dropout and "
               "the residuals split along the sequence between the split layers (less activation "
               "memory, the same bytes communicated)");
  app.add_option("--pp", a.pp, "pipeline parallelism: this many stages of encoder layers "
                 "(embeddings on the first, heads on the last); world = T x D x P")
      ->check(integer_at_least(1));
  app.add_option("--micro-batches", a.micro_batches, "with --pp: the M micro-batches of "
                 "--batch-size sequences per data-parallel rank a step pipelines (what "
                 "--grad-accum M accumulates; the default: --grad-accum)")
      ->check(integer_at_least(1));
  app.add_option("--schedule", a.schedule, "with --pp: gpipe | 1f1b | interleaved | zb-h1")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1"}));
  app.add_option("--virtual-stages", a.virtual_stages, "with --schedule interleaved: model chunks "
                 "per pipeline rank (V >= 2)")->check(integer_at_least(1));
  app.add_option("--reduce-dtype", a.reduce_dtype, "dtype gradients are reduced in: fp32 | bf16 | "
                 "fp16 (half the bytes on the wire)")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_flag("--defer-reduction", a.defer_reduction, "stages 2-3 (and bf16): sum gradients over "
               "the micro-batches in full-size buckets and reduce them once per step instead of "
               "every micro-batch (Megatron's way with --pp)");
  app.add_flag("--no-overlap", a.no_overlap, "reduce gradients after backward instead of from its "
               "hooks (ZeroOptions::overlap_comm = false)");
  app.add_flag("--recompute", a.recompute, "recompute every encoder layer's activations in "
               "backward instead of keeping them (less memory, about a third more compute)");
  app.add_flag("--no-plot", a.no_plot, "do not draw loss.png");
  app.add_flag("--check-loss-decrease", a.check_loss_decrease,
               "exit 3 unless the mean of the last 5 losses is below that of the first 5");
  app.add_option("--golden", a.golden, "compare the per-step loss with this \"step loss\" file; "
                 "exit 4 beyond --golden-tol");
  app.add_option("--golden-tol", a.golden_tol, "largest absolute loss difference to the golden file")
      ->check(number(0, false));
  app.add_option("--write-golden", a.write_golden, "write the per-step losses as a golden file");
  // Data preparation alone, one process (the trainer does both itself when --data is absent).
  app.fallthrough();
  c.build_vocab = app.add_subcommand(
      "build-vocab", "learn a WordPiece vocab.txt of --vocab-size tokens from --corpus, then exit");
  c.build_vocab->add_option("--output,-o", c.output, "vocab.txt to write")->required();
  c.create_data = app.add_subcommand(
      "create-data", "write the pretraining data file of --corpus with --vocab and the masking "
                     "options (and DATA.vocab.txt, a copy of the vocabulary), then exit");
  c.create_data->add_option("--output,-o", c.output, "data file to write")->required();
  c.create_data->add_option("--eval-output", c.eval_output, "also hold out --eval-fraction of the "
                            "documents (by document) into this eval data file");
  c.tokenize = app.add_subcommand(
      "tokenize", "print the WordPiece ids of each line of a UTF-8 text file with --vocab (and "
                  "--cased / --lower-case), one line of space-separated ids per line, no [CLS] "
                  "or [SEP]; then exit");
  c.tokenize->add_option("--input,-i", c.input, "text file to encode")->required();
}

void resolve_args(Args& a) {
  if (a.warmup_proportion >= 0) {
    a.warmup_steps = std::llround(a.warmup_proportion * static_cast<double>(a.steps));
  }
}

double adam_eps(const Args& a) {
  if (a.adam_eps > 0) return a.adam_eps;
  return a.optimizer == "lamb" ? 1e-6 : 1e-8;
}

double lr_at(const Args& a, int64_t step) {
  if (step < a.warmup_steps) return a.lr * static_cast<double>(step + 1) / a.warmup_steps;
  const double rest = static_cast<double>(a.steps - a.warmup_steps);
  if (a.lr_schedule == "constant" || rest <= 0) return a.lr;
  const double done = std::min(1.0, static_cast<double>(step - a.warmup_steps) / rest);
  if (a.lr_schedule == "cosine") return a.lr * 0.5 * (1.0 + std::cos(M_PI * done));
  return a.lr * std::max(0.0, static_cast<double>(a.steps - step) / rest);
}

// --pp and its companions; the features not built for pipelines yet are refused by name.
static std::string check_pipeline_args(const Args& a) {
  if (a.pp == 1) {
    if (a.micro_batches > 0) return "--micro-batches: needs --pp 2 or more (else: --grad-accum)";
    if (a.virtual_stages > 1) return "--virtual-stages: needs --pp 2 or more and --schedule interleaved";
    return "";
  }
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
  const std::pair<bool, const char*> unsupported[] = {
      {!a.dump_logits.empty(), "--dump-logits"},
      {a.recompute && a.schedule == "zb-h1", "--recompute with --schedule zb-h1 (its weight pass "
                                             "cannot reach a recomputed layer's parameters; use "
                                             "1f1b or interleaved)"}};
  for (const auto& [given, flag] : unsupported) {
    if (given) return fmt::format("--pp: {} is not supported with pipeline parallelism yet", flag);
  }
  return "";
}

std::string check_args(const Args& a, const Commands& c) {
  std::error_code ec;
  if (a.device != "cpu" && a.device != "cuda" && a.device.rfind("cuda:", 0) != 0) {
    return fmt::format("--device: expected cpu, cuda or cuda:N, got '{}'", a.device);
  }
  if (a.precision == "fp16" && a.device == "cpu") {
    return "--precision: fp16 needs --device cuda (libtorch's CPU kernels have no fp16 matrix "
           "products); use bf16 on CPU";
  }
  if (!a.bert_config.empty()) {
    try {
      BertConfig::load(a.bert_config);
    } catch (const std::exception& e) {
      return fmt::format("--bert-config: {}", e.what());
    }
  }
  if (!a.init_checkpoint.empty()) {
    if (a.resume_requested) {
      return "--init-checkpoint: cannot be combined with --resume (the checkpoint's parameters "
             "would replace the initial weights)";
    }
    if (!fs::exists(a.init_checkpoint, ec)) {
      return fmt::format("--init-checkpoint: no such file or directory '{}'", a.init_checkpoint);
    }
  }
  if (!a.dump_logits.empty() && !a.eval_only) return "--dump-logits: needs --eval-only";
  if (a.sequence_parallel && a.tp < 2) return "--sequence-parallel: needs --tp 2 or more";
  if (a.snapshot_dir.find("{host}") != std::string::npos && a.ranks_per_host == 0) {
    return fmt::format("--snapshot-dir {}: {{host}} needs --ranks-per-host", a.snapshot_dir);
  }
  if (a.optimizer == "adamw8bit" && a.snapshot_every > 0) {
    return "--snapshot-every: snapshots in memory do not hold adamw8bit's quantised state yet "
           "(its checkpoints do: --checkpoint-every)";
  }
  if (auto why = check_pipeline_args(a); !why.empty()) return why;
  if (a.tp > 1) {
    // Not built yet for split models: refused rather than done wrongly.
    if (a.shard_group_size > 0) return "--tp: hybrid sharding (--shard-group-size) is not supported with tensor parallelism yet";
    if (!a.dump_logits.empty()) return "--tp: --dump-logits is not supported with tensor parallelism yet (the logits are split over the vocabulary)";
  }
  // Refused rather than ignored: stages 0-2 keep every parameter whole, so a run asking for
  // automatic units there would measure or test something other than what it names.
  if (a.units == "auto" && a.stage != 3) {
    return fmt::format("--units auto: automatic units are a stage-3 mechanism, got --stage {} "
                       "(stages 0-2 gather no units; use --stage 3 or drop --units)", a.stage);
  }
  if (a.max_predictions > a.max_seq_length) {
    return fmt::format("--max-predictions: expected at most --max-seq-length ({}), got {}",
                       a.max_seq_length, a.max_predictions);
  }
  const bool subcommand = c.build_vocab->parsed() || c.create_data->parsed() || c.tokenize->parsed();
  if (c.create_data->parsed() && a.vocab.empty()) {
    return "create-data: --vocab is required (bert_pretrain build-vocab -o vocab.txt makes one)";
  }
  if (c.tokenize->parsed() && a.vocab.empty()) {
    return "tokenize: --vocab is required (the vocab.txt whose ids to print)";
  }
  if (c.tokenize->parsed() && !fs::is_regular_file(c.input, ec)) {
    return fmt::format("tokenize: --input: no such file '{}'", c.input);
  }
  if (!c.eval_output.empty() && a.eval_fraction <= 0) {
    return "--eval-output: needs --eval-fraction > 0 (the share of documents held out)";
  }
  if (a.synthetic) return "";
  // Files are checked here, before any work, so that a typo costs no corpus pass.
  Vocab vocab;
  std::string vocab_path = a.vocab;
  if (vocab_path.empty() && !a.data.empty()) {
    vocab_path = vocab_next_to(a.data);
    if (vocab_path.empty()) {
      return fmt::format("--data: needs the vocabulary it was made with: pass --vocab (no {}.vocab.txt "
                         "or vocab.txt next to it)", a.data);
    }
  }
  if (!vocab_path.empty()) {
    try {
      vocab = Vocab::load(vocab_path);
    } catch (const std::exception& e) {
      std::string why = e.what();
      if (why.rfind("vocab: ", 0) == 0) why.erase(0, 7);  // Vocab::load's prefix
      return fmt::format("--vocab: {}", why);
    }
  }
  auto check_data = [&](const char* flag, const std::string& path) -> std::string {
    if (!fs::is_regular_file(path, ec)) {
      return fmt::format("{}: no such file '{}' (bert_pretrain create-data makes one; without --data "
                         "the trainer makes and caches it)", flag, path);
    }
    DataHeader h{};
    const std::string why = read_header(path, &h);
    if (!why.empty()) return fmt::format("{}: {}", flag, why);
    const bool same = h.vocab_hash != 0 ? h.vocab_hash == vocab_fingerprint(vocab)
                                        : static_cast<int32_t>(h.vocab_size) == vocab.size();
    if (!same) {
      return fmt::format("{}: '{}' was made with another vocabulary ({} tokens) than {} ({} tokens)",
                         flag, path, h.vocab_size, vocab_path, vocab.size());
    }
    if (h.max_seq_length > 512) {
      return fmt::format("{}: '{}' has sequences of {} tokens; at most 512 are supported", flag,
                         path, h.max_seq_length);
    }
    return "";
  };
  if (!a.data.empty() && !subcommand) {
    if (auto why = check_data("--data", a.data); !why.empty()) return why;
  }
  if (!a.eval_data.empty() && !subcommand) {
    if (vocab_path.empty()) {
      return "--eval-data: needs --data or --vocab (the vocabulary the eval data was made with)";
    }
    if (auto why = check_data("--eval-data", a.eval_data); !why.empty()) return why;
  }
  if (a.eval_every > 0 && !a.data.empty() && a.eval_data.empty()) {
    return "--eval-every: needs --eval-data when --data is given (create-data --eval-output "
           "makes one)";
  }
  if (a.data.empty() || subcommand) {
    for (const auto& spec : a.corpus) {
      try {
        corpus_files(spec);
      } catch (const std::exception& e) {
        return e.what();
      }
    }
  }
  if (a.resume_requested && !subcommand) {
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

}  // namespace bert
