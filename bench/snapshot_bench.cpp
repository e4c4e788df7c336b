// snapshot_bench: MemorySnapshots at K = 1 on the example's BERT (issue 58: "snapshot cost at K = 1
// on BERT-base, N = 2: step time at most 1.05x of no snapshot"), each figure against a reference
// measured in the same run, rounds interleaved:
//   - a step followed by snapshot() (its blocking copy; the previous snapshot's checksum, buddy
//     exchange and commit overlapping this step) vs a step with none;
//   - the blocking copy vs one memcpy of the rank's state;
//   - restore() of the newest snapshot on a second MemorySnapshots over the same slots;
//   - with --reshard, restore() of it by the first half of the ranks (Note [Snapshots at another
//     world size]: the records resharded from N ranks to N/2);
//   - host_bytes() vs the estimator's Estimate::snapshot_slots;
//   - CPU time (clock_gettime) per step of the process and of the main thread, without and with
//     snapshots (the window of the steps with snapshots includes joining the last one), and the
//     background thread's own (SnapshotTiming::background_cpu_s): on a shared machine, where wall
//     ratios are noise, the CPU a snapshot adds is the figure to cut. "Other threads" is the
//     process less the main and background threads: the communicators' workers (MPI's, moving the
//     exchange's bytes).
//
//   mpirun -np 2 build/bench/snapshot_bench --preset base --dir /dev/shm/snapbench --ranks-per-host 1
//
// --ranks-per-host 1 makes every rank its own "host" (each keeps its buddy's copies: the cost of
// a multi-host job); the world's size: one host, no buddy copy.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <unistd.h>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bert_bench.hpp"
#include "checkpoint/snapshot_slot.hpp"  // Note [Huge pages for the slots]
#include "shardopt/estimate.hpp"
#include "shardopt/job.hpp"
#include "shardopt/shardopt.hpp"
#include "shardopt/snapshot.hpp"
#include "timing.hpp"

namespace {

double cpu_s(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds of the process and of the calling thread since construction.
struct CpuWindow {
  double process0 = cpu_s(CLOCK_PROCESS_CPUTIME_ID), thread0 = cpu_s(CLOCK_THREAD_CPUTIME_ID);
  double process() const { return cpu_s(CLOCK_PROCESS_CPUTIME_ID) - process0; }
  double thread() const { return cpu_s(CLOCK_THREAD_CPUTIME_ID) - thread0; }
};

// User and system CPU seconds of every live thread of the process, by thread id
// (/proc/self/task/<tid>/stat, clock ticks): to see which thread pays.
std::map<int, std::pair<double, double>> thread_times() {
  std::map<int, std::pair<double, double>> out;
  const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(e.path() / "stat");
    std::string line;
    std::getline(in, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    double utime = 0, stime = 0;
    for (int k = 3; k <= 15 && rest >> field; ++k) {
      if (k == 14) utime = std::stod(field) * tick;
      if (k == 15) stime = std::stod(field) * tick;
    }
    out[std::stoi(e.path().filename().string())] = {utime, stime};
  }
  return out;
}

// CPU seconds of thread `tid` of this process (Linux's per-thread CPU clock of a thread id).
double thread_cpu_s(int tid) {
  timespec ts{};
  if (clock_gettime((~static_cast<clockid_t>(tid) << 3) | 6, &ts) != 0) return 0;  // it ended
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

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
    const auto threads_before = thread_times();
    shardopt::MemorySnapshots snaps(*bench.opt, comm, so);
    // The threads its construction started: its private communicator's (MPI's worker).
    std::vector<int> snapshot_threads;
    for (const auto& entry : thread_times()) {
      if (threads_before.count(entry.first) == 0) snapshot_threads.push_back(entry.first);
    }
    auto snapshot_threads_cpu = [&] {
      double t = 0;
      for (int tid : snapshot_threads) t += thread_cpu_s(tid);
      return t;
    };
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
                 "rank, ranks per host {} (buddy: rank {}); slots {:.1f} MiB per rank in {} "
                 "({})\n",
                 comm->size(), comm->backend(), stage, preset, batch, seq, threads, per_host,
                 snaps.buddy(), static_cast<double>(snaps.host_bytes()) / (1 << 20), dir,
                 shardopt::detail::tmpfs_without_huge_pages(dir) ? "tmpfs without huge pages"
                                                                 : "not a tmpfs without huge pages");
      fmt::print("round  memcpy_s  quiet_step_s  snapshot_step_s  blocking_s  background_s  "
                 "| cpu per step (process, main thread) quiet / with  memcpy_cpu_s  "
                 "blocking_cpu_s  background_cpu_s  its_comm_cpu_s\n");
    }
    std::vector<double> memcpys, quiet, with, blockings, backgrounds;
    // CPU per step: process and main thread, quiet and with; per snapshot: blocking, background.
    std::vector<double> q_proc, q_main, w_proc, w_main, b_cpu, g_cpu, m_cpu, c_cpu;
    for (int round = 0; round < rounds; ++round) {
      comm->barrier();
      const CpuWindow copy_cpu;
      const double copy_s = shardopt::bench::memcpy_state(access, copy_buffer);
      m_cpu.push_back(copy_cpu.thread());
      std::vector<double> q, w, b, g, bc, gc;
      const CpuWindow quiet_cpu;
      const auto quiet_threads0 = thread_times();
      for (int s = 0; s < steps; ++s) q.push_back(bench.step());
      const auto quiet_threads = thread_times();
      q_proc.push_back(quiet_cpu.process() / steps);
      q_main.push_back(quiet_cpu.thread() / steps);
      comm->barrier();
      const CpuWindow with_cpu;
      const double comm_cpu0 = snapshot_threads_cpu();
      const auto threads0 = thread_times();
      for (int s = 0; s < steps; ++s) {
        const auto t0 = shardopt::bench::Clock::now();
        bench.step();
        if (s > 0) gc.push_back(snaps.last_timing().background_cpu_s);  // joined inside snapshot()
        snaps.snapshot();  // joins the previous one: its background overlapped this step
        w.push_back(shardopt::bench::seconds_since(t0));
        b.push_back(snaps.last_timing().blocking_s);
        bc.push_back(snaps.last_timing().blocking_cpu_s);
      }
      snaps.wait();
      if (lead && std::getenv("SNAPSHOT_BENCH_THREADS") != nullptr) {
        for (const auto& [tid, t] : thread_times()) {
          const auto was = threads0.count(tid) ? threads0.at(tid) : std::pair<double, double>{0, 0};
          const auto q0 =
              quiet_threads0.count(tid) ? quiet_threads0.at(tid) : std::pair<double, double>{0, 0};
          const auto q1 = quiet_threads.count(tid) ? quiet_threads.at(tid) : q0;
          fmt::print("  thread {}: user, system a step: quiet {:.3f}, {:.3f} s; with {:.3f}, "
                     "{:.3f} s\n",
                     tid, (q1.first - q0.first) / steps, (q1.second - q0.second) / steps,
                     (t.first - was.first) / steps, (t.second - was.second) / steps);
        }
      }
      c_cpu.push_back((snapshot_threads_cpu() - comm_cpu0) / steps);
      w_proc.push_back(with_cpu.process() / steps);
      w_main.push_back(with_cpu.thread() / steps);
      g.push_back(snaps.last_timing().background_s);
      gc.push_back(snaps.last_timing().background_cpu_s);
      for (double x : bc) b_cpu.push_back(x);
      for (double x : gc) g_cpu.push_back(x);
      memcpys.push_back(copy_s);
      for (double x : q) quiet.push_back(x);
      for (double x : w) with.push_back(x);
      for (double x : b) blockings.push_back(x);
      backgrounds.push_back(g.back());
      if (lead) {
        fmt::print("{:5d}  {:8.4f}  {:12.3f}  {:15.3f}  {:10.4f}  {:12.3f}  | {:.3f}, {:.3f} / "
                   "{:.3f}, {:.3f}  {:12.4f}  {:14.4f}  {:16.4f}  {:14.4f}\n",
                   round, copy_s, median(q), median(w), median(b), g.back(), q_proc.back(),
                   q_main.back(), w_proc.back(), w_main.back(), m_cpu.back(), median(bc),
                   median(gc), c_cpu.back());
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
      // What a snapshot adds, in CPU seconds per step (= per snapshot at K = 1).
      const double proc = median(w_proc) - median(q_proc);
      const double main_thread = median(w_main) - median(q_main), bg = median(g_cpu);
      const double own = median(b_cpu) + bg + median(c_cpu);
      fmt::print("cpu per snapshot (medians, rank 0): {:.4f} s = blocking {:.4f} s (one memcpy of "
                 "the state: {:.4f} s -> {:.2f}x) + background thread {:.4f} s + its "
                 "communicator's threads {:.4f} s; payload {:.1f} MiB\n",
                 own, median(b_cpu), median(m_cpu), median(b_cpu) / median(m_cpu), bg,
                 median(c_cpu), static_cast<double>(snaps.host_bytes()) / 4 / (1 << 20));
      fmt::print("cpu per step (medians, rank 0): process {:.3f} s quiet, {:.3f} s with snapshots "
                 "-> {:+.3f} s, of which main thread {:+.3f} s\n",
                 median(q_proc), median(w_proc), proc, main_thread);
    }
    comm->barrier();
    if (lead) fs::remove_all(dir);
    return 0;
  });
}
