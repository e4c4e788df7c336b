// What a run leaves behind (see outputs.hpp).
#include "outputs.hpp"

#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "pretrained.hpp"
#include "shardopt/hf_export.hpp"
#include "progress.hpp"
#include "report.hpp"

namespace bert {

// Joins an asynchronous save in flight (its failure thrown on every rank) and says how long it
// wrote.
void join_async_save(Run& r) {
  if (!r.saver || !r.saver->in_flight()) return;
  r.saver->wait();
  if (r.lead) {
    fmt::print("{}[bert] checkpoint: step {} committed ({:.2f} s in the background)\n", r.clear(),
               r.async_step, r.saver->last_timing().background_s);
  }
}

shardopt::TrainerState run_trainer_state(Run& r, int64_t done) {
  RunState s = r.state;
  s.step = done;
  const nlohmann::json layout = {{"tp", r.tp()}, {"pp", r.pp()},
                                 {"virtual_stages", r.pp() > 1 ? r.a.virtual_stages : 1}};
  auto trainer_state = make_trainer_state(s, r.schedule, layout);
  // --tp: the split regions' dropout stream too, so a resume draws the same masks.
  if (const auto& rng = r.model->model_parallel().rng) trainer_state.tensors["tp_dropout_rng"] = rng->state();
  return trainer_state;
}

void snapshot(Run& r, int64_t done) {
  const bool first = r.snapshots->host_bytes() == 0;
  r.snapshots->snapshot(run_trainer_state(r, done));
  if (r.fault.is("kill-in-snapshot", r.rank, done)) std::raise(SIGKILL);
  if (r.lead && first) {
    const int buddy = r.snapshots->buddy();
    fmt::print("{}[bert] snapshot: step {} in host memory ({:.3f} s blocking; {:.1f} MiB of "
               "slots per rank; {}), every {} steps\n",
               r.clear(), done, r.snapshots->last_timing().blocking_s,
               static_cast<double>(r.snapshots->host_bytes()) / (1 << 20),
               buddy >= 0 ? fmt::format("rank 0's buddy: rank {}", buddy)
                          : std::string("one host: no buddy copy"),
               r.a.snapshot_every);
  }
}

void save(Run& r, int64_t done) {
  const auto t0 = Clock::now();
  if (!r.opt->parameters_finite()) {  // never replace the last good checkpoint with NaN/Inf
    if (r.lead) fmt::print("\n[bert] checkpoint: step {} NOT saved: NaN/Inf parameters\n", done);
    return;
  }
  shardopt::SaveOptions save_options = model_save_options(r.model);
  if (r.pipeline) {  // a stage's folder names only the parameters it holds
    for (auto it = save_options.aliases.begin(); it != save_options.aliases.end();) {
      it = r.pipeline->holds(it->second) ? std::next(it) : save_options.aliases.erase(it);
    }
  }
  save_options.after_shard_written = [&r, done](int rank) {  // by value: may run after save()
    if (r.fault.is("kill-in-save", rank, done)) std::raise(SIGKILL);
  };
  // Every (pipeline, tensor) folder written, then the whole grid committed by world rank 0 with
  // one record (Note [One commit for a grid] in shardopt/grid_checkpoint.hpp).
  shardopt::GridSaveOptions grid;
  grid.keep = r.a.keep_checkpoints;
  grid.after_folder_written = [&r, done](int world_rank) {
    if (r.fault.is("kill-before-commit", world_rank, done)) std::raise(SIGKILL);
  };
  const auto trainer_state = run_trainer_state(r, done);
  if (r.a.async_checkpoints) {
    join_async_save(r);
    if (!r.saver) r.saver = std::make_unique<shardopt::AsyncCheckpoint>(*r.opt, r.groups);
    r.saver->save_checkpoint_async(r.checkpoint_dir.string(), trainer_state, save_options, grid);
    r.async_step = r.last_saved = done;
    if (r.lead) {
      fmt::print("{}[bert] checkpoint: step {} -> {} ({:.3f} s blocking, {:.1f} MiB copied; "
                 "writing in the background)\n",
                 r.clear(), done, r.checkpoint_dir.string(), r.saver->last_timing().blocking_s,
                 static_cast<double>(r.saver->snapshot_bytes()) / (1 << 20));
    }
    return;
  }
  shardopt::save_grid_checkpoint(*r.opt, r.groups, r.checkpoint_dir.string(), trainer_state,
                                 save_options, grid);
  r.last_saved = done;
  if (r.lead) {
    fmt::print("{}[bert] checkpoint: step {} -> {} ({:.1f} s)\n", r.clear(), done,
               r.checkpoint_dir.string(), seconds_since(t0));
  }
}

void export_model(Run& r) {
  r.hf_export = r.a.export_hf.empty() ? (fs::path(r.a.out) / "hf").string() : r.a.export_hf;
  // This rank's tensors: its stages' parameters (tensor-parallel slices under --tp) and buffers;
  // the library gathers each one in turn from the ranks that hold its pieces (Note [Streaming
  // Hugging Face export] in shardopt/hf_export.hpp).
  torch::OrderedDict<std::string, at::Tensor> tensors;
  for (const auto& p : r.model->named_parameters()) {
    if (!r.pipeline || r.pipeline->holds(p.key())) tensors.insert(p.key(), p.value());
  }
  for (const auto& b : r.model->named_buffers()) {
    if (!r.pipeline || r.pipeline->holds(b.key())) tensors.insert(b.key(), b.value());
  }
  std::vector<std::string> extra;
  const auto options = hf_export_options(r.config, r.prepared.vocab_path, r.prepared.lower_case, &extra);
  // Tensor bytes the export adds to each rank's model and optimizer (the tracker's peak window
  // is the export's; the run's peak so far is kept in tracked_peak).
  auto& tracker = r.tracking->tracker();
  r.tracked_peak = std::max(r.tracked_peak, tracker.reset_peak());
  const int64_t before = tracker.live_bytes();
  const auto t0 = Clock::now();
  const auto report = shardopt::export_hf_safetensors(r.hf_export, tensors, r.groups, r.opt.get(), options);
  const double seconds = seconds_since(t0);
  r.tracked_peak = std::max(r.tracked_peak, tracker.peak_bytes());
  auto mine = torch::tensor({static_cast<double>(tracker.peak_bytes() - before)}, torch::kDouble);
  auto all = torch::zeros({r.world}, torch::kDouble);
  r.comm->all_gather(mine, all);
  if (!r.lead) return;
  const auto extra_bytes = all.max().item<double>();
  const auto worst = all.argmax().item<int64_t>();
  std::vector<std::string> files = extra;
  files.insert(files.end(), report.files.begin(), report.files.end());
  fmt::print("[bert] Hugging Face export: {} ({}) in {:.2f} s\n", r.hf_export, fmt::join(files, ", "),
             seconds);
  const auto mib = [](double bytes) { return bytes / (1 << 20); };
  fmt::print("[bert] Hugging Face export: extra memory per rank at most {:.3f} MiB (rank {}); one "
             "tensor gathered takes at most {:.3f} MiB (the largest, {:.3f} MiB unsplit, with the "
             "vocabulary's padding); {:.3f} MiB of tensors\n",
             mib(extra_bytes), worst, mib(static_cast<double>(report.largest_buffer_bytes)),
             mib(static_cast<double>(report.largest_tensor_bytes)),
             mib(static_cast<double>(report.total_bytes)));
}

void finish(Run& r) {
  const int64_t step = r.state.step;
  if (step == r.start_step) return;
  if (r.last_saved != step) save(r, step);
  join_async_save(r);  // the last save committed before anything reads it
  // The final state is committed on disk: the snapshots give their memory back to tmpfs.
  if (r.snapshots) r.snapshots->remove();
  if (r.a.save_model) {
    shardopt::agree_on_errors(*r.comm, "writing model.pt", [&] {
      if (!r.lead) return;
      const fs::path model_path = fs::path(r.a.out) / "model.pt";
      // Any layout: every (pipeline, tensor) folder of the committed save, split parameters
      // put back together (consolidate_checkpoint of a grid's base).
      shardopt::consolidate_checkpoint(r.checkpoint_dir.string(), model_path.string());
      fmt::print("[bert] model: {} (consolidated parameters of step {})\n", model_path.string(), step);
    });
  }
  if (r.a.save_model || !r.a.export_hf.empty()) export_model(r);
}

// ---- summary: summary.json, the closing lines, the exit code ------------------------------------
namespace {

std::string plot(const Run& r) {
  if (r.a.no_plot) return "skipped (--no-plot)";
  const fs::path png = fs::path(r.a.out) / "loss.png";
  const char* env = std::getenv("BERT_PLOT_SCRIPT");
  const std::string script = env ? env : BERT_PLOT_SCRIPT;
  const std::string cmd = fmt::format("/usr/bin/python3 '{}' '{}' '{}'", script,
                                      r.metrics_path.string(), png.string());
  return std::system(cmd.c_str()) == 0 ? png.string() : "failed (command: " + cmd + ")";
}

// Rank 0: summary.json and the closing lines; returns the exit code (--golden, --check-loss-decrease).
int write_summary(Run& r, const std::vector<double>& peaks) {
  const Args& a = r.a;
  r.metrics.close();
  const std::string plot_note = plot(r);
  // Timing medians over this run's steps after --timing-warmup, per rank.
  const int64_t ran = r.state.step - r.start_step;
  const int64_t skip = std::min<int64_t>(a.timing_warmup, std::max<int64_t>(0, ran - 1));
  const auto timing = summarize_timings(r.timings, r.world, skip, r.global_batch);
  std::vector<int64_t> rss, tensor_peak;
  for (int k = 0; k < r.world; ++k) {
    rss.push_back(static_cast<int64_t>(peaks[2 * k]));
    tensor_peak.push_back(static_cast<int64_t>(peaks[2 * k + 1]));
  }
  const auto& losses = r.state.losses;
  const size_t k = std::min<size_t>(5, losses.size());
  const double first = k ? std::accumulate(losses.begin(), losses.begin() + k, 0.0) / k : 0.0;
  const double final_ = k ? std::accumulate(losses.end() - k, losses.end(), 0.0) / k : 0.0;
  const auto overall = rates(ran, ran * r.global_batch, r.run_tokens, r.state.train_s - r.start_train_s);
  const fs::path model_path = fs::path(a.out) / "model.pt";
  nlohmann::json summary = {
      {"preset", a.bert_config.empty() ? a.preset : ""}, {"bert_config", a.bert_config},
      {"config", (fs::path(a.out) / "config.json").string()},
      {"parameters", r.model->num_parameters()}, {"ranks", r.world}, {"stage", a.stage},
      {"optimizer", a.optimizer}, {"lr_schedule", a.lr_schedule}, {"device", a.device},
      {"steps", a.steps}, {"step", r.state.step}, {"steps_this_run", ran},
      {"global_batch", r.global_batch}, {"first5_loss", first}, {"last5_loss", final_},
      {"train_s", r.state.train_s}, {"train_s_this_run", r.state.train_s - r.start_train_s},
      {"wall_s", seconds_since(r.t_start)}, {"tokens", r.state.tokens}, {"loss_window", k},
      {"steps_per_s", overall.steps_per_s}, {"samples_per_s", overall.samples_per_s},
      {"tokens_per_s", overall.tokens_per_s}, {"last", r.last},
      {"vocab", r.prepared.vocab_path}, {"data", r.prepared.data_path},
      {"eval_data", r.prepared.eval_path}, {"lower_case", r.prepared.lower_case},
      {"synthetic", a.synthetic}, {"nsp", r.config.nsp},
      {"mlm_all_positions", r.config.mlm_all_positions},
      {"attn_implementation", r.config.attn_implementation}, {"batch_size", a.batch_size},
      {"threads", a.threads}, {"timing", timing.json}, {"peak_rss_bytes", rss},
      {"peak_tensor_bytes", tensor_peak}, {"plot", plot_note}, {"metrics", r.metrics_path.string()},
      {"checkpoint", r.last_saved >= 0 ? r.checkpoint_dir.string() : ""},
      {"checkpoint_step", r.last_saved}, {"pipeline_stages", r.pp()},
      {"pipeline_schedule", r.pp() > 1 ? a.schedule : ""},
      {"model", a.save_model && ran > 0 ? model_path.string() : ""}, {"hf_export", r.hf_export},
      {"model_state_rank0", r.last.value("memory_rank0", nlohmann::json::object())}};
  if (!r.last_eval.is_null()) {
    summary["eval"] = r.last_eval;
    summary["first_eval"] = r.first_eval;
    summary["nsp_above_baseline"] =
        r.last_eval["nsp_acc"].get<double>() - r.last_eval["nsp_baseline"].get<double>();
  }
  if (r.block_cache) {
    const auto c = r.block_cache->stats();
    summary["block_cache_rank0"] = {{"hits", c.hits}, {"misses", c.misses},
                                    {"peak_cached_bytes", c.peak_cached_bytes},
                                    {"dropped_unused", c.dropped_unused}};
  }
  const fs::path summary_path = fs::path(a.out) / "summary.json";
  std::ofstream(summary_path) << summary.dump(2) << '\n';
  print_summary(summary, timing, r.start_step + skip + 1, summary_path.string());
  int rc = 0;
  if (!a.write_golden.empty()) write_golden(a.write_golden, losses);
  if (!a.golden.empty() && !matches_golden(a.golden, losses, a.golden_tol)) rc = 4;
  if (a.check_loss_decrease && !(final_ < first)) {
    fmt::print(stderr, "[bert] --check-loss-decrease: the loss did not fall ({:.4f} -> {:.4f})\n",
               first, final_);
    rc = 3;
  }
  std::fflush(stdout);
  return rc;
}

}  // namespace

int summarize(Run& r) {
  // Peak resident memory and peak tensor storage of every rank.
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  const int64_t tracked = std::max(r.tracked_peak, r.tracking->tracker().peak_bytes());
  auto peaks = torch::tensor({static_cast<double>(usage.ru_maxrss) * 1024.0,
                              static_cast<double>(tracked)},
                             torch::kDouble);
  auto all_peaks = torch::zeros({2 * r.world}, torch::kDouble);
  r.comm->all_gather(peaks, all_peaks);
  // Rank 0 alone writes the summary; an error there reaches every rank (no rank waits in the
  // verdict's broadcast for a rank that is gone).
  int rc = 0;
  shardopt::agree_on_errors(*r.comm, "writing the summary", [&] {
    if (!r.lead) return;
    const double* p = all_peaks.data_ptr<double>();
    rc = write_summary(r, std::vector<double>(p, p + 2 * r.world));
  });
  // Every rank exits with rank 0's verdict.
  auto verdict = torch::tensor({static_cast<int64_t>(rc)}, torch::kLong);
  r.comm->broadcast(verdict, 0);
  return static_cast<int>(verdict.item<int64_t>());
}

}  // namespace bert
