// The example BERT's forward and backward by op, for bench/profile_bert_step.py (which profiles the
// PyTorch peer the same way and prints both by phase). One process, no optimizer: the model's own
// work only. Steps alternate unprofiled (timed) and profiled with torch's legacy CPU profiler; the
// profiled steps' events go to --out as JSON: [name, sequence number, start us, end us, thread].
// The model marks its phases with named ranges (Note [Step phases] in examples/bert/model.cpp).
#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "block_cache.hpp"
#include "data.hpp"
#include "model.hpp"
#include "timing.hpp"

namespace {

namespace prof = torch::autograd::profiler;
using shardopt::bench::Clock;
using shardopt::bench::median;
using shardopt::bench::seconds_since;

// Push/pop pairs of every thread -> [name, sequence number, start us, end us, thread].
nlohmann::json closed_ranges(const prof::thread_event_lists& lists) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& list : lists) {
    std::map<uint64_t, const prof::LegacyEvent*> open;  // by RecordFunction handle
    for (const auto& e : list) {
      if (e.kind() == prof::EventKind::PushRange) {
        open[e.handle()] = &e;
      } else if (e.kind() == prof::EventKind::PopRange) {
        const auto it = open.find(e.handle());
        if (it == open.end()) continue;
        const auto* p = it->second;
        // cpuUs(): one clock for every thread and profiled step, so steps never overlap.
        out.push_back({p->name(), p->sequenceNr(), p->cpuUs(), e.cpuUs(), p->threadId()});
        open.erase(it);
      }
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The example BERT's forward and backward by op (see bench/profile_bert_step.py)"};
  std::string preset = "peer", out_path = "profile_bert_step.json";
  int64_t batch = 8, seq = 128;
  int steps = 5, warmup = 2;
  app.add_option("--preset", preset, "BERT preset (peer: the PyTorch peer's model, all logits)");
  app.add_option("--batch", batch, "sequences")->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "sequence length")->check(CLI::Range(8, 512));
  app.add_option("--steps", steps, "timed and profiled steps, alternating")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "unmeasured steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--out", out_path, "events JSON");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  // As the trainer (--block-cache-mb 1024): the [tokens x vocab] tensors reuse mapped memory.
  bert::ScopedBlockCache cache(int64_t{32} << 20, int64_t{1024} << 20);
  const auto config = bert::BertConfig::preset(preset);
  torch::manual_seed(0);
  bert::BertForPreTraining model(config);
  model->train();
  std::vector<double> fwd, bwd;
  nlohmann::json events = nlohmann::json::array();
  for (int s = 0; s < warmup + 2 * steps; ++s) {
    const bool profiled = s >= warmup && (s - warmup) % 2 == 1;
    const auto inputs = bert::to_inputs(
        bert::synthetic_batch(batch, seq, config.vocab_size, 0.15, 103, 0, s, 0));
    model->zero_grad(/*set_to_none=*/true);  // as the peer
    if (profiled) {
      prof::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(
          torch::profiler::impl::ProfilerState::CPU));
    }
    const auto t0 = Clock::now();
    at::Tensor loss;
    {
      RECORD_USER_SCOPE("step::forward");
      loss = model->forward(inputs).loss;
    }
    const double f = seconds_since(t0);
    const auto t1 = Clock::now();
    {
      RECORD_USER_SCOPE("step::backward");
      loss.backward();
    }
    const double b = seconds_since(t1);
    cache.next_step();
    if (profiled) {
      for (auto& e : closed_ranges(prof::disableProfilerLegacy())) events.push_back(std::move(e));
    } else if (s >= warmup) {
      fwd.push_back(f), bwd.push_back(b);
    }
  }
  // The phase ranges are what the script attributes by: a model without them profiles nothing.
  const auto phases = std::count_if(events.begin(), events.end(), [](const nlohmann::json& e) {
    return e[0].get<std::string>().rfind("phase::", 0) == 0;
  });
  if (phases == 0) {
    fmt::print(stderr, "profile_bert_step: no phase::* ranges recorded (Note [Step phases])\n");
    return 1;
  }
  std::ofstream(out_path) << nlohmann::json{{"profiled_steps", steps},
                                            {"fwd_s", median(fwd)},
                                            {"bwd_s", median(bwd)},
                                            {"events", events}}
                                 .dump();
  fmt::print("forward {:.4f} s, backward {:.4f} s (medians, unprofiled); {} events, {} in phases\n",
             median(fwd), median(bwd), events.size(), phases);
  return 0;
}
