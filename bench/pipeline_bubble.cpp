// pipeline_bubble: each pipeline schedule's bubble measured from run_pipeline()'s action timings,
// against the simulator fed the measured costs and the formula, and the first stage's activation
// peak, at p = the world size and m in --microbatches (issue 41; bench/pipeline_bubble.sh).
//
//   mpirun -np 4 build/bench/pipeline_bubble --microbatches 4,8 --rounds 4
//
// The defaults (64 layers of 512 x 512 on 512 rows: ~1.6 ms a layer's forward on one core) make
// the shortest action (interleaved at p = 4: 8 layers) ~13 ms, several times a message's latency
// when 4 ranks share 2 cores (the "hop ms" column: a few ms of scheduling delay per hand-over).
//
// Note [Measured bubble]: the simulator's definition (Note [Bubble] in pipeline.hpp), on the
// trace: makespan = the last action's end minus the first action's start over all ranks (one
// steady clock per host: the ranks must share a host), C = the largest per-rank sum of compute
// action durations (F, B, I, W; sends and receives are idle, as the simulator's communication
// costs nothing), bubble = (makespan - C) / C. Wall time, not CPU time: a rank blocked in a
// receive sleeps (the MPI engine's worker polls with back-off), so wall time is what idles it.
// With more ranks than cores a runnable rank also waits for a core, inside its compute actions:
// that stretches C and the makespan by the load rather than by the schedule, so the table also
// gives the simulator run at the measured mean CPU time of each kind of action (thread CPU
// clock, which waiting for a core does not stretch) and states the ranks per CPU and the load.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "shardopt/shardopt.hpp"

namespace {

using shardopt::ActionType;
using shardopt::PipelineScheduleKind;

// A stack of Linear + GELU layers as plain leaf tensors; stage s of S runs layers
// [s*L/S, (s+1)*L/S), the last stage ends with the loss mean(x^2).
struct Model {
  std::vector<at::Tensor> weights, biases;
};

Model make_model(int layers, int64_t hidden) {
  at::manual_seed(0);
  Model m;
  for (int l = 0; l < layers; ++l) {
    m.weights.push_back((at::randn({hidden, hidden}) / std::sqrt(double(hidden))).requires_grad_());
    m.biases.push_back(at::zeros({hidden}).requires_grad_());
  }
  return m;
}

// One schedule ready to run on this rank: its lists and this rank's chunks over its own model.
struct Setup {
  shardopt::PipelineSchedule schedule;
  std::shared_ptr<const Model> model;  // shared with the chunks' closures
  std::vector<shardopt::PipelineChunk> chunks;
};

Setup make_setup(PipelineScheduleKind kind, int p, int m, int rank, int layers, int64_t hidden) {
  const int v = kind == PipelineScheduleKind::Interleaved1F1B ? 2 : 1;
  Setup s{shardopt::compile_schedule(kind, p, m, v),
          std::make_shared<const Model>(make_model(layers, hidden)), {}};
  const int stages = s.schedule.stages();
  if (layers % stages != 0) {
    throw std::invalid_argument(fmt::format(
        "pipeline_bubble: --layers {} must divide into the {} stages of {} at p = {}", layers,
        stages, shardopt::to_string(kind), p));
  }
  const int per_stage = layers / stages;
  for (int c = 0; c < v; ++c) {
    const int stage = c * p + rank, first = stage * per_stage;
    shardopt::PipelineChunk chunk;
    chunk.forward = [model = s.model, first, per_stage, last = stage == stages - 1](const at::Tensor& in,
                                                                          int) {
      at::Tensor x = in;
      for (int l = first; l < first + per_stage; ++l) {
        x = at::gelu(at::addmm(model->biases[l], x, model->weights[l].t()));
      }
      return last ? x.pow(2).mean() : x;
    };
    for (int l = first; l < first + per_stage; ++l) {
      chunk.parameters.push_back(s.model->weights[l]);
      chunk.parameters.push_back(s.model->biases[l]);
    }
    s.chunks.push_back(std::move(chunk));
  }
  return s;
}

// What one rank sends rank 0 about one run (all_gather of doubles; times in ns).
enum Field { kStart, kEnd, kComputeWall, kComputeCpu, kActPeak, kCpuF, kNF, kCpuB, kNB, kCpuI, kNI, kCpuW, kNW,
             kFields };

std::vector<double> summarize(const shardopt::PipelineTrace& trace,
                              const std::vector<shardopt::Action>& list) {
  std::vector<double> out(kFields, 0.0);
  out[kStart] = double(trace.actions.front().start_ns);
  out[kEnd] = double(trace.actions.back().end_ns);
  int64_t peak = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& t = trace.actions[i];
    peak = std::max(peak, t.live_bytes - trace.live_bytes_before);
    if (!shardopt::is_compute(list[i].type)) continue;
    out[kComputeWall] += double(t.end_ns - t.start_ns);
    const Field cpu = list[i].type == ActionType::Forward    ? kCpuF
                      : list[i].type == ActionType::Backward ? kCpuB
                      : list[i].type == ActionType::BackwardInput ? kCpuI
                                                                  : kCpuW;
    out[cpu] += double(t.cpu_ns);
    out[kComputeCpu] += double(t.cpu_ns);
    out[cpu + 1] += 1;
  }
  out[kActPeak] = double(peak);
  return out;
}

// The mean latency of a message, in ms: a receive's end minus the later of its own start and its
// send's start (the k-th send from rank a to rank b is the k-th receive on b from a). `times`
// holds every rank's (start, end) per action, `longest` actions per rank.
double hop_latency_ms(const shardopt::PipelineSchedule& s, const at::Tensor& times,
                      int64_t longest) {
  const auto t = times.accessor<double, 1>();
  const auto start = [&](int r, size_t i) { return t[(r * longest + int64_t(i)) * 2]; };
  const auto end = [&](int r, size_t i) { return t[(r * longest + int64_t(i)) * 2 + 1]; };
  std::map<std::pair<int, int>, std::vector<double>> sent;  // (from, to) -> send starts
  for (int r = 0; r < s.ranks; ++r) {
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const auto type = s.actions[r][i].type;
      if (type == ActionType::SendActivation || type == ActionType::SendGrad) {
        sent[{r, s.actions[r][i].peer}].push_back(start(r, i));
      }
    }
  }
  std::map<std::pair<int, int>, size_t> taken;
  double sum = 0;
  int n = 0;
  for (int r = 0; r < s.ranks; ++r) {
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const auto& a = s.actions[r][i];
      if (a.type != ActionType::RecvActivation && a.type != ActionType::RecvGrad) continue;
      const double send_start = sent[{a.peer, r}][taken[{a.peer, r}]++];
      sum += end(r, i) - std::max(start(r, i), send_start);
      ++n;
    }
  }
  return n > 0 ? sum / n / 1e6 : 0.0;
}

struct Row {
  std::vector<double> bubble, replay, peak_mb, hop_ms, stretch;
  std::vector<double> f_ms, b_ms, i_ms, w_ms;
  double sim_unit = 0, formula = 0;
  int sim_in_flight = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return fmt::format("{} {} {}", one, five, fifteen);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pipeline bubble and first-stage activation peak per schedule (issue 41)"};
  std::vector<int> microbatches{4, 8};
  std::vector<std::string> kinds{"gpipe", "1f1b", "interleaved", "zb-h1"};
  int layers = 64, rounds = 4;
  int64_t hidden = 512, rows = 512;
  app.add_option("--microbatches", microbatches, "m values")->delimiter(',');
  app.add_option("--schedules", kinds, "gpipe, 1f1b, interleaved (v = 2), zb-h1")->delimiter(',');
  app.add_option("--layers", layers, "Linear+GELU layers in the whole model");
  app.add_option("--hidden", hidden, "width of each layer");
  app.add_option("--rows", rows, "rows (sequences x tokens) per micro-batch");
  app.add_option("--rounds", rounds, "timed runs of each schedule, interleaved; median reported");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  shardopt::ScopedMemoryTracking tracking;  // before the engine's threads allocate
  auto comm = shardopt::init_from_env();
  const int p = comm->size(), rank = comm->rank();
  const unsigned cores = std::thread::hardware_concurrency();
  const std::string load_before = load_average();
  std::vector<std::string> lines;

  for (const int m : microbatches) {
    std::vector<at::Tensor> inputs;
    at::manual_seed(1);
    for (int mb = 0; mb < m; ++mb) inputs.push_back(at::randn({rows, hidden}));
    std::vector<Setup> setups;
    for (const auto& name : kinds) {
      setups.push_back(make_setup(shardopt::parse_schedule_kind(name), p, m, rank, layers, hidden));
    }
    shardopt::PipelineRunOptions options;
    options.activation_shape = {rows, hidden};
    shardopt::PipelineTrace trace;
    options.trace = &trace;
    const auto data = [&](int mb) { return inputs[mb]; };
    std::vector<Row> table(setups.size());
    // Round 0 warms up (allocates .grad, first touch); the schedules take turns in each round so
    // that a drift in the machine's load reaches them alike.
    for (int round = 0; round <= rounds; ++round) {
      for (size_t k = 0; k < setups.size(); ++k) {
        Setup& s = setups[k];
        comm->barrier();
        shardopt::run_pipeline(s.schedule, *comm, s.chunks, data, options);
        const std::vector<double> mine = summarize(trace, s.schedule.actions[rank]);
        at::Tensor all = at::empty({p * kFields}, at::kDouble);
        comm->all_gather(at::tensor(mine, at::kDouble), all);
        int64_t longest = 0;
        for (const auto& list : s.schedule.actions) longest = std::max<int64_t>(longest, list.size());
        at::Tensor times = at::zeros({longest * 2}, at::kDouble);
        for (size_t i = 0; i < trace.actions.size(); ++i) {
          times[int64_t(i) * 2] = double(trace.actions[i].start_ns);
          times[int64_t(i) * 2 + 1] = double(trace.actions[i].end_ns);
        }
        at::Tensor all_times = at::empty({p * longest * 2}, at::kDouble);
        comm->all_gather(times, all_times);
        if (round == 0 || rank != 0) continue;
        const auto f = [&](int r, Field field) { return all[r * kFields + field].item<double>(); };
        double start = f(0, kStart), end = f(0, kEnd), compute = 0, wall = 0, on_cpu = 0;
        double cpu[4] = {0, 0, 0, 0}, n[4] = {0, 0, 0, 0};
        for (int r = 0; r < p; ++r) {
          start = std::min(start, f(r, kStart));
          end = std::max(end, f(r, kEnd));
          compute = std::max(compute, f(r, kComputeWall));
          wall += f(r, kComputeWall);
          on_cpu += f(r, kComputeCpu);
          for (int t = 0; t < 4; ++t) {
            cpu[t] += f(r, Field(kCpuF + 2 * t));
            n[t] += f(r, Field(kNF + 2 * t));
          }
        }
        const auto mean_us = [&](int t) { return n[t] > 0 ? cpu[t] / n[t] / 1e3 : 0.0; };
        Row& row = table[k];
        row.bubble.push_back((end - start - compute) / compute);
        row.peak_mb.push_back(f(0, kActPeak) / 1e6);
        row.f_ms.push_back(mean_us(0) / 1e3);
        row.b_ms.push_back(mean_us(1) / 1e3);
        row.i_ms.push_back(mean_us(2) / 1e3);
        row.w_ms.push_back(mean_us(3) / 1e3);
        // The simulator at the measured mean CPU cost of each kind of action (microseconds).
        shardopt::ActionCosts costs;
        costs.forward = std::max<int64_t>(1, int64_t(mean_us(0)));
        costs.backward_input = std::max<int64_t>(1, int64_t(n[1] > 0 ? mean_us(1) : mean_us(2)));
        costs.backward_weight = n[1] > 0 ? 0 : std::max<int64_t>(1, int64_t(mean_us(3)));
        row.replay.push_back(shardopt::simulate_schedule(s.schedule, costs).bubble);
        row.hop_ms.push_back(hop_latency_ms(s.schedule, all_times, longest));
        row.stretch.push_back(wall / on_cpu);  // > 1: compute waited for a core or ran slower
      }
    }
    if (rank != 0) continue;
    for (size_t k = 0; k < setups.size(); ++k) {
      const auto& s = setups[k].schedule;
      Row& row = table[k];
      const auto unit = shardopt::simulate_schedule(s);
      row.sim_unit = unit.bubble;
      row.sim_in_flight = unit.peak_in_flight[0];
      row.formula = shardopt::bubble_formula(s.kind, p, m, s.chunks);
      const double measured = median(row.bubble);
      lines.push_back(fmt::format(
          "{:<12} {:>2} {:>2} {:>2} | {:>8.4f} [{:.4f}, {:.4f}] {:>+7.1f}% | {:>10.4f} | {:>8.4f} "
          "{:>8.4f} | {:>6.2f} {:>6.2f} {:>6.2f} {:>6.2f} {:>6.2f} {:>5.2f} | {:>8.2f} {:>3}",
          shardopt::to_string(s.kind), p, m, s.chunks, measured,
          *std::min_element(row.bubble.begin(), row.bubble.end()),
          *std::max_element(row.bubble.begin(), row.bubble.end()),
          100.0 * (measured - row.formula) / row.formula, median(row.replay), row.sim_unit,
          row.formula, median(row.f_ms), median(row.b_ms), median(row.i_ms), median(row.w_ms),
          median(row.hop_ms), median(row.stretch),
          median(row.peak_mb), row.sim_in_flight));
      // The acceptance figures of issue 41 at p = 4, m = 8 (the script greps "check:").
      if (m == 8 && p == 4) {
        lines.push_back(fmt::format("  check: {} measured/formula - 1 = {:+.1f}%",
                                    shardopt::to_string(s.kind),
                                    100.0 * (measured - row.formula) / row.formula));
      }
    }
    if (m == 8 && p == 4) {
      std::map<std::string, const Row*> by;
      for (size_t k = 0; k < setups.size(); ++k) by[kinds[k]] = &table[k];
      if (by.count("zb-h1") && by.count("1f1b")) {
        lines.push_back(fmt::format("  check: zb-h1 bubble {:.4f} vs 1f1b {:.4f} in the same rounds",
                                    median(by["zb-h1"]->bubble), median(by["1f1b"]->bubble)));
      }
      if (by.count("gpipe") && by.count("1f1b")) {
        const double ratio = median(by["1f1b"]->peak_mb) / median(by["gpipe"]->peak_mb);
        lines.push_back(fmt::format(
            "  check: first-stage activation peak 1f1b/gpipe = {:.3f} (p/m = {:.3f}, bound "
            "p/m + 0.10 = {:.3f})",
            ratio, double(p) / m, double(p) / m + 0.10));
      }
    }
  }
  if (rank == 0) {
    fmt::print("pipeline_bubble: p = {} ranks on {} online CPUs ({:.1f} ranks per CPU), backend "
               "{}, {} layers of Linear({}, {}) + GELU, {} rows per micro-batch, {} rounds "
               "(median, [min, max]); load average before {}, after {}\n",
               p, cores, double(p) / cores, comm->backend(), layers, hidden, hidden, rows,
               rounds, load_before, load_average());
    fmt::print("{:<12} {:>2} {:>2} {:>2} | {:>8} {:<16} {:>8} | {:>10} | {:>8} {:>8} | {:>6} "
               "{:>6} {:>6} {:>6} {:>6} {:>5} | {:>8} {:>3}\n",
               "schedule", "p", "m", "v", "measured", "[min, max]", "vs form", "sim(cpu)",
               "sim(1)", "formula", "F ms", "B ms", "I ms", "W ms", "hop ms", "w/cpu", "act MB",
               "mb0");
    for (const auto& line : lines) fmt::print("{}\n", line);
    std::fflush(stdout);
  }
  comm->barrier();
  return 0;
}
