// snapshot_bench: MemorySnapshots at K = 1 on the example's BERT (issue 58: "snapshot cost at K = 1
// on BERT-base, N = 2: step time at most 1.05x of no snapshot"), each figure against a reference
// measured in the same run, rounds interleaved:
//   - a step followed by snapshot() (its blocking copy; the previous snapshot's checksum, buddy
//     exchange and commit overlapping this step) vs a step with none;
//   - the blocking copy vs one memcpy of the rank's state;
//   - restore() of the newest snapshot on a second MemorySnapshots over the same slots;
//   - with --reshard, restore() of it by the first half of the ranks (Note [Snapshots at another
//     world size]: the records resharded from N ranks to N/2);
//   - host_bytes() vs the estimator's Estimate::snapshot_slots.
//
//   mpirun -np 2 build/bench/snapshot_bench --preset base --dir /dev/shm/snapbench --ranks-per-host 1
//
// --ranks-per-host 1 makes every rank its own "host" (each keeps its buddy's copies: the cost of
// a multi-host job); the world's size: one host, no buddy copy.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bert_bench.hpp"
#include "shardopt/estimate.hpp"
#include "shardopt/job.hpp"
#include "shardopt/shardopt.hpp"
#include "shardopt/snapshot.hpp"
#include "timing.hpp"

int main(int argc, char** argv) {
  CLI::App app{"MemorySnapshots at K = 1 on the example's BERT: step, blocking and restore times"};
  std::string preset = "base", dir = "/dev/shm/snapshot_bench";
  int64_t batch = 1, seq = 128;
  int rounds = 4, steps = 3, threads = 1, stage = 2, per_host = 1;
  app.add_option("--preset", preset, "BERT preset (tiny | mini | small | base | large)");
  app.add_option("--batch", batch, "rows per step and rank");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--rounds", rounds, "rounds, each of --steps steps without and with snapshots");
  app.add_option("--steps", steps, "steps per half-round");
  app.add_option("--threads", threads, "intra-op threads per rank");
  app.add_option("--stage", stage, "ZeRO stage");
  app.add_option("--ranks-per-host", per_host, "SnapshotOptions::ranks_per_host");
  app.add_option("--dir", dir, "the slots' directory (tmpfs)");
  bool reshard = false;
  app.add_flag("--reshard", reshard, "also restore at N/2 ranks (a second model on each of them)");
  CLI11_PARSE(app, argc, argv);

  namespace fs = std::filesystem;
  using shardopt::bench::median;
  auto comm = shardopt::init_from_env();
  return shardopt::run_or_abort(*comm, [&] {
    at::set_num_threads(threads);
    const bool lead = comm->rank() == 0;
    auto groups = shardopt::make_parallel_groups(comm, shardopt::ParallelLayout{1, 1, 0});
    shardopt::bench::BertBench bench(groups, preset, stage, batch, seq);
    if (lead) fs::remove_all(dir);
    comm->barrier();
    const shardopt::SnapshotOptions so{dir, per_host};
    shardopt::MemorySnapshots snaps(*bench.opt, comm, so);
    auto& access = shardopt::detail::shard_access(*bench.opt);
    std::vector<char> copy_buffer;
    for (int s = 0; s < 2; ++s) bench.step();  // warm-up: the optimizer's state exists
    for (int s = 0; s < 2; ++s) {              // both slots mapped and touched
      bench.step();
      snaps.snapshot();
    }
    snaps.wait();
    if (lead) {
      fmt::print("# {} ranks ({}), stage {}, BERT-{} fp32, batch {} x seq {}, {} thread(s) per "
                 "rank, ranks per host {} (buddy: rank {}); slots {:.1f} MiB per rank\n",
                 comm->size(), comm->backend(), stage, preset, batch, seq, threads, per_host,
                 snaps.buddy(), static_cast<double>(snaps.host_bytes()) / (1 << 20));
      fmt::print("round  memcpy_s  quiet_step_s  snapshot_step_s  blocking_s  background_s\n");
    }
    std::vector<double> memcpys, quiet, with, blockings, backgrounds;
    for (int round = 0; round < rounds; ++round) {
      comm->barrier();
      const double copy_s = shardopt::bench::memcpy_state(access, copy_buffer);
      std::vector<double> q, w, b, g;
      for (int s = 0; s < steps; ++s) q.push_back(bench.step());
      comm->barrier();
      for (int s = 0; s < steps; ++s) {
        const auto t0 = shardopt::bench::Clock::now();
        bench.step();
        snaps.snapshot();  // joins the previous one: its background overlapped this step
        w.push_back(shardopt::bench::seconds_since(t0));
        b.push_back(snaps.last_timing().blocking_s);
      }
      snaps.wait();
      g.push_back(snaps.last_timing().background_s);
      memcpys.push_back(copy_s);
      for (double x : q) quiet.push_back(x);
      for (double x : w) with.push_back(x);
      for (double x : b) blockings.push_back(x);
      backgrounds.push_back(g.back());
      if (lead) {
        fmt::print("{:5d}  {:8.4f}  {:12.3f}  {:15.3f}  {:10.4f}  {:12.3f}\n", round, copy_s,
                   median(q), median(w), median(b), g.back());
        std::fflush(stdout);
      }
    }
    // Restore on a second MemorySnapshots over the same slots (a restart's path, in-process).
    shardopt::RestoreReport report;
    {
      shardopt::MemorySnapshots again(*bench.opt, comm, so);
      again.restore(&report);
    }
    auto slowest = torch::tensor({report.seconds});
    comm->all_reduce(slowest, shardopt::ReduceOp::Max)->wait();
    // The same snapshot restored by the first half of the ranks, resharded.
    double reshard_s = -1;
    if (reshard && comm->size() >= 2) {
      auto half = comm->split(comm->rank() < comm->size() / 2 ? 0 : -1, comm->rank());
      if (half) {
        shardopt::bench::BertBench smaller(
            shardopt::make_parallel_groups(half, shardopt::ParallelLayout{1, 1, 0}), preset, stage,
            batch, seq);
        shardopt::RestoreReport r2;
        shardopt::MemorySnapshots at_half(*smaller.opt, half, {dir, half->size()});
        const bool ok = at_half.restore(&r2).has_value();
        auto t = torch::tensor({ok ? r2.seconds : -1.0});
        half->all_reduce(t, shardopt::ReduceOp::Max)->wait();
        reshard_s = t.item<double>();
        if (half->rank() == 0) {
          fmt::print("resharded restore: snapshot {} of {} ranks at {} ranks in {:.3f} s (slowest "
                     "rank){}\n",
                     r2.number, r2.saved_world, half->size(), reshard_s,
                     ok ? "" : " -- not restored: " + r2.reason);
        }
      }
      comm->barrier();
    }
    shardopt::estimate::Options o;
    o.params = bench.opt->padded_numel();
    o.world = comm->size();
    o.stage = stage;
    o.params_on_host = true;
    o.memory_snapshots = true;
    o.snapshot_buddy = snaps.buddy() >= 0;
    const int64_t estimated = shardopt::estimate::model_states(o).snapshot_slots;
    if (lead) {
      const double m = median(memcpys), qs = median(quiet), ws = median(with),
                   bl = median(blockings);
      fmt::print("summary (medians, rank 0): step {:.3f} s quiet, {:.3f} s with a snapshot each "
                 "step -> {:.3f}x (aim <= 1.05); blocking {:.4f} s, memcpy {:.4f} s -> {:.2f}x; "
                 "background {:.3f} s; restore {:.3f} s (slowest rank; snapshot {}); slots {:.1f} "
                 "MiB per rank, estimator {:.1f} MiB\n",
                 qs, ws, ws / qs, bl, m, bl / m, median(backgrounds), slowest.item<double>(),
                 report.number, static_cast<double>(snaps.host_bytes()) / (1 << 20),
                 static_cast<double>(estimated) / (1 << 20));
    }
    comm->barrier();
    if (lead) fs::remove_all(dir);
    return 0;
  });
}
