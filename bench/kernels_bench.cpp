// Fused CPU AdamW (src/kernels) against torch::optim::AdamW over the same tensors and against a
// STREAM triad measured in the same binary, on 100M fp32 parameters by default. After the
// Google Benchmark output it prints a markdown table with the ratios from this run (medians
// when --benchmark_repetitions > 1), the one bench/README.md records.
//
//   build/bench/kernels_bench --benchmark_repetitions=5 [--numel=100000000]
//
// 8-bit AdamW (src/kernels/adam8bit.hpp) against the fp32 fused AdamW, interleaved:
//   build/bench/kernels_bench --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true
//     --benchmark_filter='fused_adamw(8bit)?/threads:[0-9]+/isa:0(/bf16:0)?/real_time'
//   (one command line)
// and their compute ceilings (in L2, 1 thread): --benchmark_filter='fused_adamw(8bit)?_in_l2/isa:3'
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/adam8bit.hpp"
#include "kernels/finite.hpp"
#include "kernels/fused.hpp"
#include "triad.hpp"

namespace {

namespace k = shardopt::detail::kernels;

int64_t g_numel = 100'000'000;
constexpr double kAdamBytes = 28;     // read p, g, m, v; write p, m, v (fp32)
constexpr double kAdamLowBytes = 30;  // + the bf16 copy
constexpr double kAdam8bitBytes = 16;  // read p, g, two codes; write p, two codes (+8/256)
using shardopt::bench::kTriadBytes;

// One set of pre-faulted buffers shared by every benchmark (first touch is slow, docs/design.md).
struct Data {
  at::Tensor p, g, m, v, low, triad_a;
  at::Tensor q1, q2, a1, a2;  // 8-bit AdamW's state (allocated by its first run)
  std::unique_ptr<torch::optim::AdamW> torch_opt;
};
Data& data() {
  static Data d = [] {
    Data d;
    at::manual_seed(0);
    d.p = at::randn({g_numel});
    d.g = at::randn({g_numel}).mul_(1e-2);
    d.m = at::zeros({g_numel});
    d.v = at::zeros({g_numel});
    d.low = at::zeros({g_numel}, at::kBFloat16);
    d.triad_a = at::zeros({g_numel});
    d.p.set_requires_grad(true);
    d.p.mutable_grad() = d.g;  // torch sees the same parameter and gradient
    d.torch_opt = std::make_unique<torch::optim::AdamW>(
        std::vector<at::Tensor>{d.p}, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
    d.torch_opt->step();  // allocates and touches torch's own state outside the timings
    return d;
  }();
  return d;
}

k::AdamHyper hyper(int64_t step) {
  k::AdamHyper h;
  h.lr = 1e-4, h.weight_decay = 0.01, h.step = step;
  return h;
}

void set_counters(benchmark::State& state, double bytes_per_param, int64_t numel = g_numel) {
  const double n = static_cast<double>(state.iterations()) * static_cast<double>(numel);
  state.counters["param/s"] = benchmark::Counter(n, benchmark::Counter::kIsRate);
  state.counters["B/s"] = benchmark::Counter(n * bytes_per_param, benchmark::Counter::kIsRate);
}

const k::CpuIsa kIsas[] = {k::CpuIsa::Auto, k::CpuIsa::Scalar, k::CpuIsa::Avx2, k::CpuIsa::Avx512};

// args: threads, isa (index into kIsas), bf16 copy (0/1)
void BM_FusedAdamW(benchmark::State& state) {
  const k::CpuIsa isa = kIsas[state.range(1)];
  if (!k::cpu_isa_supported(isa)) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  at::set_num_threads(static_cast<int>(state.range(0)));
  Data& d = data();
  const bool low = state.range(2) != 0;
  const k::AdamSegment s{d.p.data_ptr<float>(),
                         d.g.data_ptr<float>(),
                         d.m.data_ptr<float>(),
                         d.v.data_ptr<float>(),
                         nullptr,
                         {low ? k::LowPrecision::BFloat16 : k::LowPrecision::None,
                          low ? static_cast<uint16_t*>(d.low.data_ptr()) : nullptr},
                         g_numel};
  int64_t step = 0;
  for (auto _ : state) k::fused_adam(hyper(++step), s, isa);
  set_counters(state, low ? kAdamLowBytes : kAdamBytes);
  state.SetLabel(k::to_string(k::resolve_cpu_isa(isa)));
}

// 8-bit AdamW's state over the first `numel` parameters (allocated by the first run).
k::Adam8bitSegment adam8bit_segment(Data& d, int64_t numel) {
  if (!d.q1.defined()) {
    const int64_t blocks = (g_numel + k::kQuantBlock - 1) / k::kQuantBlock;
    d.q1 = at::zeros({g_numel}, at::kByte), d.q2 = at::zeros({g_numel}, at::kByte);
    d.a1 = at::zeros({blocks}), d.a2 = at::zeros({blocks});
  }
  return {d.p.data_ptr<float>(),    d.g.data_ptr<float>(),   d.q1.data_ptr<uint8_t>(),
          d.q2.data_ptr<uint8_t>(), d.a1.data_ptr<float>(),  d.a2.data_ptr<float>(), numel};
}

// args: threads, isa (index into kIsas). The same p and g as the fp32 kernel's.
void BM_FusedAdamW8bit(benchmark::State& state) {
  const k::CpuIsa isa = kIsas[state.range(1)];
  if (!k::cpu_isa_supported(isa)) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  at::set_num_threads(static_cast<int>(state.range(0)));
  const k::Adam8bitSegment s = adam8bit_segment(data(), g_numel);
  int64_t step = 0;
  for (auto _ : state) {
    k::Adam8bitHyper h;
    h.lr = 1e-4, h.weight_decay = 0.01, h.step = ++step;
    k::fused_adam8bit(h, s, isa);
  }
  set_counters(state, kAdam8bitBytes);
  state.SetLabel(k::to_string(k::resolve_cpu_isa(isa)));
}

void BM_TorchAdamW(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  Data& d = data();
  for (auto _ : state) d.torch_opt->step();
  set_counters(state, kAdamBytes);  // the bytes a fused pass needs, for comparison
}

// STREAM triad (bench/triad.hpp) over g_numel floats, the threads and chunks of the kernels.
void BM_Triad(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  Data& d = data();
  float* a = d.triad_a.data_ptr<float>();
  const float* b = d.g.data_ptr<float>();
  const float* c = d.v.data_ptr<float>();
  for (auto _ : state) {
    shardopt::bench::triad(a, b, c, 3.0f, g_numel);
    benchmark::ClobberMemory();
  }
  set_counters(state, kTriadBytes);
}

// The same four streams moved with no arithmetic (bench/triad.hpp): the bound in the kernel's
// own units. Works on copies, so the benchmarks' optimizer state stays as it was.
void BM_AdamStreams(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  Data& d = data();
  at::Tensor p = d.p.clone(), m = d.m.clone(), v = d.v.clone();
  for (auto _ : state) {
    shardopt::bench::adam_streams(p.data_ptr<float>(), d.g.data_ptr<float>(), m.data_ptr<float>(),
                                  v.data_ptr<float>(), g_numel);
    benchmark::ClobberMemory();
  }
  set_counters(state, shardopt::bench::kAdamStreamsBytes);
}

// The non-finite check (kernels/finite.hpp) over the gradient: one read stream, 4 B per value;
// its bound is the read rate, and the one-process loop pays it once per gradient (issue 56).
void BM_CheckFinite(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  Data& d = data();
  const k::CheckSegment s{k::ValueKind::Float32, d.g.data_ptr(), g_numel};
  for (auto _ : state) {
    if (k::check_finite(s).non_finite) state.SkipWithError("the benchmark's gradient holds a non-finite value");
  }
  set_counters(state, 4);
}

// The kernel's compute ceiling: 32K parameters (4 x 128 KiB) stay in L2, one thread.
constexpr int64_t kInCacheNumel = 32768;
void BM_FusedAdamWInCache(benchmark::State& state) {
  const k::CpuIsa isa = kIsas[state.range(0)];
  if (!k::cpu_isa_supported(isa)) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  at::set_num_threads(1);
  Data& d = data();
  const k::AdamSegment s{d.p.data_ptr<float>(),
                         d.g.data_ptr<float>(),
                         d.m.data_ptr<float>(),
                         d.v.data_ptr<float>(),
                         nullptr,
                         {},
                         kInCacheNumel};
  int64_t step = 0;
  for (auto _ : state) k::fused_adam(hyper(++step), s, isa);
  set_counters(state, kAdamBytes, kInCacheNumel);
  state.SetLabel(k::to_string(k::resolve_cpu_isa(isa)));
}

// 8-bit AdamW's compute ceiling, as fused_adamw_in_l2 (avx512: the VBMI kernel where the CPU has
// VBMI, Note [Fast 8-bit kernel]).
void BM_FusedAdamW8bitInCache(benchmark::State& state) {
  const k::CpuIsa isa = kIsas[state.range(0)];
  if (!k::cpu_isa_supported(isa)) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  at::set_num_threads(1);
  const k::Adam8bitSegment s = adam8bit_segment(data(), kInCacheNumel);
  int64_t step = 0;
  for (auto _ : state) {
    k::Adam8bitHyper h;
    h.lr = 1e-4, h.weight_decay = 0.01, h.step = ++step;
    k::fused_adam8bit(h, s, isa);
  }
  set_counters(state, kAdam8bitBytes, kInCacheNumel);
  state.SetLabel(k::to_string(k::resolve_cpu_isa(isa)));
}

// Wall-clock time: the work runs on at::parallel_for's threads, not the benchmark thread.
void setup(benchmark::internal::Benchmark* b) { b->UseRealTime()->Unit(benchmark::kMillisecond); }

void register_benchmarks() {
  const int max_threads = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<int64_t> threads = {1};
  if (max_threads > 1) threads.push_back(max_threads);
  for (int64_t t : threads) {
    setup(benchmark::RegisterBenchmark("triad", BM_Triad)->Arg(t)->ArgName("threads"));
    setup(benchmark::RegisterBenchmark("adam_streams", BM_AdamStreams)->Arg(t)->ArgName("threads"));
    setup(benchmark::RegisterBenchmark("fused_adamw", BM_FusedAdamW)
              ->Args({t, 0, 0})
              ->Args({t, 0, 1})
              ->ArgNames({"threads", "isa", "bf16"}));
    setup(benchmark::RegisterBenchmark("torch_adamw", BM_TorchAdamW)->Arg(t)->ArgName("threads"));
    setup(benchmark::RegisterBenchmark("check_finite", BM_CheckFinite)->Arg(t)->ArgName("threads"));
    setup(benchmark::RegisterBenchmark("fused_adamw8bit", BM_FusedAdamW8bit)
              ->Args({t, 0})
              ->ArgNames({"threads", "isa"}));
  }
  // Every instruction set on one thread (isa: 1 scalar, 2 avx2, 3 avx512).
  for (int64_t isa = 1; isa <= 3; ++isa) {
    setup(benchmark::RegisterBenchmark("fused_adamw", BM_FusedAdamW)
              ->Args({1, isa, 0})
              ->ArgNames({"threads", "isa", "bf16"}));
    setup(benchmark::RegisterBenchmark("fused_adamw_in_l2", BM_FusedAdamWInCache)
              ->Arg(isa)
              ->ArgName("isa"));
    if (isa != 2) {  // 8-bit AdamW has no AVX2 kernel
      setup(benchmark::RegisterBenchmark("fused_adamw8bit_in_l2", BM_FusedAdamW8bitInCache)
                ->Arg(isa)
                ->ArgName("isa"));
    }
  }
}

// Google Benchmark 1.8 replaced Run::error_occurred with Run::skipped; both versions build.
template <class R>
auto run_failed(const R& r, int) -> decltype(static_cast<bool>(r.skipped)) {
  return static_cast<bool>(r.skipped);
}
template <class R>
bool run_failed(const R& r, long) {
  return r.error_occurred;
}

// Console output as usual, plus the ratio table at the end.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  // Colours only on a terminal (Google Benchmark applies --benchmark_color to its own reporter).
  TableReporter() : ConsoleReporter(isatty(fileno(stdout)) ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (run_failed(r, 0)) continue;
      const bool median = r.aggregate_name == "median";
      if (!r.aggregate_name.empty() && !median) continue;
      Entry& e = results_[r.run_name.function_name + "/" + r.run_name.args];
      if (median || !e.median) {
        e.median = median;
        e.params = r.counters.at("param/s").value;
        e.bytes = r.counters.at("B/s").value;
        e.label = r.report_label;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf(
        "\n| threads | fused AdamW Gparam/s | fused GB/s (28 B/param) | torch AdamW "
        "Gparam/s | fused / torch | triad GB/s (12 B/elem) | fused GB/s / triad GB/s |"
        " AdamW's streams alone GB/s (28 B) | fused time / streams time |"
        " fused + bf16 copy Gparam/s |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int t = 1; t <= 64; ++t) {
      const std::string ts = std::to_string(t);
      const Entry* fused = find("fused_adamw/threads:" + ts + "/isa:0/bf16:0");
      const Entry* low = find("fused_adamw/threads:" + ts + "/isa:0/bf16:1");
      const Entry* torch = find("torch_adamw/threads:" + ts);
      const Entry* triad = find("triad/threads:" + ts);
      const Entry* streams = find("adam_streams/threads:" + ts);
      if (fused == nullptr || torch == nullptr || triad == nullptr) continue;
      std::printf("| %d | %.3f (%s) | %.1f | %.3f | %.1fx | %.1f | %.0f%% | %s | %s | %s |\n", t,
                  fused->params / 1e9, fused->label.c_str(), fused->bytes / 1e9,
                  torch->params / 1e9, fused->params / torch->params, triad->bytes / 1e9,
                  100 * fused->bytes / triad->bytes,
                  streams ? fmt(streams->bytes / 1e9).c_str() : "-",
                  streams ? fmt(streams->bytes / fused->bytes).c_str() : "-",
                  low ? fmt(low->params / 1e9).c_str() : "-");
    }
    std::printf(
        "\n| instruction set (1 thread) | Gparam/s | GB/s | in L2 (32K params) Gparam/s |"
        "\n|---|---:|---:|---:|\n");
    for (int isa = 1; isa <= 3; ++isa) {
      const Entry* e = find("fused_adamw/threads:1/isa:" + std::to_string(isa) + "/bf16:0");
      const Entry* l2 = find("fused_adamw_in_l2/isa:" + std::to_string(isa));
      if (e != nullptr) {
        std::printf("| %s | %.3f | %.1f | %s |\n", e->label.c_str(), e->params / 1e9,
                    e->bytes / 1e9, l2 ? fmt(l2->params / 1e9).c_str() : "-");
      }
    }
    std::printf(
        "\n| threads | fused AdamW ms/step (28 B/param) | fused 8-bit AdamW ms/step (16 B/param) |"
        " 8-bit speed-up |\n|---:|---:|---:|---:|\n");
    for (int t = 1; t <= 64; ++t) {
      const std::string ts = std::to_string(t);
      const Entry* fused = find("fused_adamw/threads:" + ts + "/isa:0/bf16:0");
      const Entry* q8 = find("fused_adamw8bit/threads:" + ts + "/isa:0");
      if (fused == nullptr || q8 == nullptr) continue;
      const double n = static_cast<double>(g_numel);
      std::printf("| %d | %.1f (%s) | %.1f (%s) | %.2fx |\n", t, 1e3 * n / fused->params,
                  fused->label.c_str(), 1e3 * n / q8->params, q8->label.c_str(),
                  q8->params / fused->params);
    }
    for (int isa : {1, 3}) {
      const Entry* l2 = find("fused_adamw_in_l2/isa:" + std::to_string(isa));
      const Entry* q8 = find("fused_adamw8bit_in_l2/isa:" + std::to_string(isa));
      if (l2 == nullptr || q8 == nullptr) continue;
      std::printf("| in L2 (32K, 1 thread) | %.3f us (%s) | %.3f us (%s) | %.2fx |\n",
                  1e6 * kInCacheNumel / l2->params, l2->label.c_str(),
                  1e6 * kInCacheNumel / q8->params, q8->label.c_str(), q8->params / l2->params);
    }
    std::printf("\nnumel %lld; %s\n", static_cast<long long>(g_numel),
                any_median_ ? "medians over repetitions" : "single runs");
  }

 private:
  struct Entry {
    bool median = false;
    double params = 0, bytes = 0;
    std::string label;
  };
  const Entry* find(const std::string& key) {
    auto it = results_.find(key);
    if (it == results_.end()) return nullptr;
    any_median_ = any_median_ || it->second.median;
    return &it->second;
  }
  static std::string fmt(double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", x);
    return buf;
  }
  std::map<std::string, Entry> results_;
  bool any_median_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--numel=", 8) == 0) {
      g_numel = std::atoll(argv[i] + 8);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n_args = static_cast<int>(args.size());
  benchmark::Initialize(&n_args, args.data());
  if (benchmark::ReportUnrecognizedArguments(n_args, args.data())) return 1;
  register_benchmarks();
  benchmark::AddCustomContext("numel", std::to_string(g_numel));
  benchmark::AddCustomContext("auto_isa", k::to_string(k::resolve_cpu_isa(k::CpuIsa::Auto)));
  TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
