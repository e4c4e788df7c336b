// async_checkpoint_bench: AsyncCheckpoint::save_checkpoint_async on the example's BERT (issue 55,
// acceptance (a)), each figure against a reference measured in the same run, interleaved round by
// round:
//   - blocking time per save (inside save_checkpoint_async) vs one memcpy of the rank's state (the
//     owned slices of the master parameters and of every optimizer state buffer, into a buffer
//     allocated once, as the snapshot is);
//   - the steps that run while the save writes (each started before it finished) vs the steps
//     with no save in flight, and the CPU of each step's thread and of the process's others;
//   - the background write (the world's checkpoint bytes over the slowest rank's background time)
//     vs `dd conv=fsync` of as many bytes into the same folder, run by rank 0 alone.
//
//   mpirun -np 2 build/bench/async_checkpoint_bench --preset base --dir /tmp/ackpt   # fp32, stage 2
//   ... --rounds 40 --dd-rounds 4   # the step's noise (+-10% a step here) wants many rounds
//
// Steps are forward + backward + step() on one synthetic MLM batch (--batch x --seq), with
// --threads intra-op threads per rank. Prints one line per round and a summary with the ratios.
#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bert_bench.hpp"
#include "shardopt/async_checkpoint.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/job.hpp"
#include "shardopt/shardopt.hpp"
#include "timing.hpp"

namespace {

namespace fs = std::filesystem;
using shardopt::bench::Clock;
using shardopt::bench::median;
double since(Clock::time_point t0) { return shardopt::bench::seconds_since(t0); }

double cpu_seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// A step's wall time, the CPU its own thread took, and the CPU every other thread of the process
// took meanwhile (the writer, MPI's and torch's threads): where a slower step's time went.
struct StepTimes {
  double wall = 0, own_cpu = 0, others_cpu = 0;
};
template <typename Step>
StepTimes timed(Step&& step) {
  const double own0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
  const double all0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
  StepTimes t;
  t.wall = step();
  t.own_cpu = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - own0;
  t.others_cpu = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - all0 - t.own_cpu;
  return t;
}

// Seconds dd takes to write `bytes` into `dir` with conv=fsync (8 MiB blocks); the file removed.
double dd_seconds(const fs::path& dir, int64_t bytes) {
  const fs::path file = dir / "dd.bench";
  const int64_t blocks = (bytes + (8 << 20) - 1) / (8 << 20);
  const std::string cmd = fmt::format("dd if=/dev/zero of='{}' bs=8M count={} conv=fsync 2>/dev/null",
                                      file.string(), blocks);
  const auto t0 = Clock::now();
  const int rc = std::system(cmd.c_str());
  const double s = since(t0);
  fs::remove(file);
  if (rc != 0) throw std::runtime_error("dd failed: " + cmd);
  return s * static_cast<double>(bytes) / static_cast<double>(blocks * (8 << 20));
}

int64_t folder_bytes(const fs::path& dir) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"AsyncCheckpoint on the example's BERT: blocking, step and write times"};
  std::string preset = "base", dir = "/tmp/async_checkpoint_bench";
  int64_t batch = 1, seq = 128;
  int rounds = 3, quiet_steps = 2, threads = 1, stage = 2, niceness = 0;
  app.add_option("--preset", preset, "BERT preset (tiny | mini | small | base | large)");
  app.add_option("--batch", batch, "rows per step and rank");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--rounds", rounds, "measured rounds (after one unmeasured save)");
  app.add_option("--quiet-steps", quiet_steps, "steps without a save per round");
  app.add_option("--threads", threads, "intra-op threads per rank");
  app.add_option("--stage", stage, "ZeRO stage");
  app.add_option("--writer-niceness", niceness, "AsyncCheckpointOptions::writer_niceness");
  app.add_option("--dir", dir, "checkpoint folder (the filesystem measured)");
  int dd_rounds = -1;
  app.add_option("--dd-rounds", dd_rounds,
                 "rounds that run the dd reference first (-1: every round; it takes 3 s each)");
  CLI11_PARSE(app, argc, argv);

  auto comm = shardopt::init_from_env();
  return shardopt::run_or_abort(*comm, [&] {
    at::set_num_threads(threads);
    const bool lead = comm->rank() == 0;
    auto groups = shardopt::make_parallel_groups(comm, shardopt::ParallelLayout{1, 1, 0});
    shardopt::bench::BertBench bench(groups, preset, stage, batch, seq);
    auto& opt = *bench.opt;
    auto step = [&] { return bench.step(); };

    const fs::path base = fs::path(dir) / "checkpoint";
    if (lead) fs::create_directories(dir);
    comm->barrier();
    shardopt::AsyncCheckpointOptions ao;
    ao.writer_niceness = niceness;
    shardopt::AsyncCheckpoint saver(opt, groups, ao);
    auto& access = shardopt::detail::shard_access(opt);
    std::vector<char> copy_buffer;
    for (int s = 0; s < 2; ++s) step();  // warm-up: the optimizer's state exists
    saver.save_checkpoint_async(base.string());  // the first save allocates the snapshot
    const double first_blocking = saver.last_timing().blocking_s;
    saver.wait();
    if (lead) {
      fmt::print("# {} ranks ({}), stage {}, BERT-{} fp32, batch {} x seq {}, {} thread(s) per "
                 "rank, writer niceness +{}; snapshot {:.1f} MiB per rank; first save blocked "
                 "{:.3f} s (allocation)\n",
                 comm->size(), comm->backend(), stage, preset, batch, seq, threads, niceness,
                 static_cast<double>(saver.snapshot_bytes()) / (1 << 20), first_blocking);
      fmt::print("round  memcpy_s  blocking_s  quiet_step_s  writing_step_s  background_s  "
                 "bytes  dd_s  write_MBps  dd_MBps  writer_cpu_s  step_cpu_s(quiet/writing)  "
                 "others_cpu_s(quiet/writing)\n");
    }
    std::vector<double> memcpys, blockings, quiet, writing, rates, dd_rates;
    for (int round = 0; round < rounds; ++round) {
      comm->barrier();
      const double copy_s = shardopt::bench::memcpy_state(access, copy_buffer);
      std::vector<double> q, q_own, q_others;
      for (int s = 0; s < quiet_steps; ++s) {
        const StepTimes t = timed(step);
        q.push_back(t.wall);
        q_own.push_back(t.own_cpu);
        q_others.push_back(t.others_cpu);
      }
      comm->barrier();
      saver.save_checkpoint_async(base.string());
      const double blocking = saver.last_timing().blocking_s;
      // Steps until the save has finished on every rank (the step's end after it: one more at
      // most); each rank's flag reaches every rank through an all-reduce.
      std::vector<double> w;
      StepTimes first_writing;
      for (;;) {
        const StepTimes t = timed(step);
        if (w.empty()) first_writing = t;
        w.push_back(t.wall);
        auto done = torch::tensor({saver.last_timing().background_s > 0 ? 0.0f : 1.0f});
        comm->all_reduce(done, shardopt::ReduceOp::Sum)->wait();
        if (done.item<float>() == 0) break;
      }
      saver.wait();
      double background = saver.last_timing().background_s;
      const double writer_cpu = saver.last_timing().background_cpu_s;
      auto slowest = torch::tensor({background});
      comm->all_reduce(slowest, shardopt::ReduceOp::Max)->wait();
      background = slowest.item<double>();
      comm->barrier();
      int64_t bytes = 0;
      double dd = 0;
      const bool with_dd = dd_rounds < 0 || round < dd_rounds;
      if (lead) {
        bytes = folder_bytes(shardopt::committed_folder(base.string()));
        if (with_dd) dd = dd_seconds(dir, bytes);
      }
      comm->barrier();
      memcpys.push_back(copy_s);
      blockings.push_back(blocking);
      for (double x : q) quiet.push_back(x);
      // Every step here started with the write in flight (a slow disk's write spans several).
      for (double x : w) writing.push_back(x);
      if (lead) {
        const double rate = static_cast<double>(bytes) / background / 1e6;
        const double dd_rate = with_dd ? static_cast<double>(bytes) / dd / 1e6 : 0.0;
        rates.push_back(rate);
        if (with_dd) dd_rates.push_back(dd_rate);
        fmt::print("{:5d}  {:8.4f}  {:10.4f}  {:12.3f}  {:14.3f}  {:12.3f}  {}  {:.3f}  {:10.1f}  "
                   "{:7.1f}  {:12.3f}  {:.3f}/{:.3f}  {:.3f}/{:.3f}  (steps while writing: {})\n",
                   round, copy_s, blocking, median(q), median(w), background, bytes, dd, rate,
                   dd_rate, writer_cpu, median(q_own), first_writing.own_cpu, median(q_others),
                   first_writing.others_cpu, w.size());
        std::fflush(stdout);
      }
    }
    if (lead) {
      const double m = median(memcpys), b = median(blockings), qs = median(quiet),
                   ws = median(writing), r = median(rates), d = median(dd_rates);
      fmt::print("summary (medians, rank 0): memcpy {:.4f} s, blocking {:.4f} s -> {:.2f}x memcpy "
                 "(aim <= 1.2); step {:.3f} s quiet, {:.3f} s while writing -> {:.3f}x (aim <= "
                 "1.05); write {:.1f} MB/s, dd conv=fsync {:.1f} MB/s -> {:.0f}% (aim >= 80%)\n",
                 m, b, b / m, qs, ws, ws / qs, r, d, 100 * r / d);
    }
    return 0;
  });
}
