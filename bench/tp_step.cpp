// The example BERT's forward + backward under tensor parallelism (bench/tp_timing.sh runs it at
// t = 1 and t = 2, interleaved): the model split over all the launched ranks (mpirun -np t), no
// optimizer, 1 thread per rank. With --time-collectives the tensor group is wrapped in a decorator
// that runs each collective synchronously and adds up its wall time, which gives the share of the
// step spent in tensor-parallel communication (waits for a slower rank included; the overlap of
// Note [Overlapped input gradients] is lost in that run, so its step time is reported apart).
#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "data.hpp"
#include "model.hpp"
#include "timing.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/parallel_layout.hpp"

namespace {

using shardopt::bench::Clock;
using shardopt::bench::median;
using shardopt::bench::seconds_since;

// Every collective run to completion inside the call and timed (the tensor group's only).
class TimedCommunicator final : public shardopt::Communicator {
 public:
  TimedCommunicator(shardopt::CommunicatorPtr inner, std::shared_ptr<double> seconds)
      : Communicator(inner->rank(), inner->size()), inner_(std::move(inner)),
        seconds_(std::move(seconds)) {
    set_timeout(inner_->timeout());
  }
  std::string backend() const override { return "timed:" + inner_->backend(); }
  shardopt::Capabilities capabilities() const override {
    shardopt::Capabilities caps = inner_->capabilities();
    caps.overlaps_caller = false;  // each call returns complete
    return caps;
  }

 protected:
  template <class Call>
  shardopt::WorkPtr timed(Call call) {
    const auto start = Clock::now();
    shardopt::WorkPtr work = call();
    *seconds_ += seconds_since(start);
    return work;
  }
  shardopt::WorkPtr do_all_reduce(const at::Tensor& t, shardopt::ReduceOp op) override {
    return timed([&] { return inner_->all_reduce(t, op, false); });
  }
  shardopt::WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out,
                                      shardopt::ReduceOp op) override {
    return timed([&] { return inner_->reduce_scatter(in, out, op, false); });
  }
  shardopt::WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    return timed([&] { return inner_->all_gather(in, out, false); });
  }
  shardopt::WorkPtr do_broadcast(const at::Tensor& t, int root) override {
    return timed([&] { return inner_->broadcast(t, root, false); });
  }
  void do_barrier() override { inner_->barrier(); }
  shardopt::CommunicatorPtr do_split(int color, int key) override {
    return inner_->split(color, key);
  }
  shardopt::CommunicatorPtr do_split_by_host() override { return inner_->split_by_host(); }

 private:
  shardopt::CommunicatorPtr inner_;
  std::shared_ptr<double> seconds_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BERT forward + backward split over the launched ranks (bench/tp_timing.sh)"};
  std::string preset = "base";
  int64_t batch = 8, seq = 128;
  int steps = 6, warmup = 2;
  bool time_collectives = false;
  app.add_option("--preset", preset, "BERT preset");
  app.add_option("--batch", batch, "sequences")->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "sequence length")->check(CLI::Range(8, 512));
  app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "unmeasured steps first")->check(CLI::NonNegativeNumber);
  app.add_flag("--time-collectives", time_collectives,
               "run the tensor group's collectives synchronously and time them");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  auto world = shardopt::init_from_env();
  const int t = world->size();
  const auto groups = shardopt::make_parallel_groups(world, shardopt::ParallelLayout{t});
  auto collective_s = std::make_shared<double>(0.0);
  bert::ModelParallel mp;
  if (t > 1) {
    mp.tp.group = time_collectives
                      ? std::make_shared<TimedCommunicator>(groups.tp, collective_s)
                      : groups.tp;
    mp.rng = std::make_shared<shardopt::tp::RngTracker>(0, groups.tp_rank);
  }
  const auto config = bert::BertConfig::preset(preset);
  at::manual_seed(0);
  bert::BertForPreTraining model(config, /*declare_units=*/true, mp);
  model->train();
  std::vector<double> step_s, comm_s;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto inputs = bert::to_inputs(
        bert::synthetic_batch(batch, seq, config.vocab_size, 0.15, 103, 0, s, 0));
    model->zero_grad(/*set_to_none=*/true);
    world->barrier();
    *collective_s = 0;
    const auto start = Clock::now();
    model->forward(inputs).loss.backward();
    world->barrier();  // the step ends when the slowest rank's does
    if (s >= warmup) step_s.push_back(seconds_since(start)), comm_s.push_back(*collective_s);
  }
  if (world->rank() == 0) {
    fmt::print("{}\n", nlohmann::json{{"preset", preset},
                                      {"t", t},
                                      {"batch", batch},
                                      {"seq", seq},
                                      {"timed_collectives", time_collectives},
                                      {"step_s", median(step_s)},
                                      {"collective_s", median(comm_s)}}
                           .dump());
  }
  return 0;
}
