// run_pipeline(): one loop over this rank's action list (Note [Pipeline action lists]). Sends are
// isend (waited for at the end), receives block, which are the semantics the validator proved
// deadlock-free; on NCCL a Send and the Recv right after it from the same peer go as one batch
// (Note [Paired exchanges], proved likewise). Activations and their graphs live from a chunk's
// Forward to its last backward pass for that micro-batch.
#include "shardopt/pipeline_runner.hpp"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/autograd.h>

#include <time.h>

#include <chrono>
#include <map>
#include <utility>

#include "pipeline/split_backward.hpp"
#include "shardopt/error.hpp"
#include "shardopt/memory_tracker.hpp"

namespace shardopt {
namespace {

// What one (chunk, micro-batch) keeps between its passes on this rank.
struct InFlight {
  at::Tensor input;   // the received activation (a leaf requiring grad); stage 0: the data
  at::Tensor output;  // the chunk's output (the loss on the last stage)
  at::Tensor grad;    // the gradient of `output` received from the next stage
  detail::SplitBackward split;  // zero-bubble schedules: what B keeps for W
};

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t thread_cpu_ns() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

}  // namespace

std::vector<at::Tensor> run_pipeline(const PipelineSchedule& schedule, Communicator& comm,
                                     const std::vector<PipelineChunk>& chunks,
                                     const std::function<at::Tensor(int microbatch)>& data,
                                     const PipelineRunOptions& options) {
  SHARDOPT_CHECK(schedule.ranks == comm.size(), InvalidArgument,
                 "pipeline: the schedule is for p = {} ranks, but the communicator has {}",
                 schedule.ranks, comm.size());
  SHARDOPT_CHECK(static_cast<int>(chunks.size()) == schedule.chunks, InvalidArgument,
                 "pipeline: the {} schedule places v = {} chunks on each rank, got {} chunks",
                 to_string(schedule.kind), schedule.chunks, chunks.size());
  const int rank = comm.rank();
  const int last_stage = schedule.stages() - 1;
  const auto activation = [&] {
    return at::empty(options.activation_shape, at::TensorOptions()
                                                    .dtype(options.activation_dtype)
                                                    .device(options.activation_device));
  };
  std::map<std::pair<int, int>, InFlight> live;  // by (chunk, micro-batch)
  std::vector<at::Tensor> losses(rank == schedule.rank_of(last_stage) ? schedule.microbatches : 0);
  std::vector<WorkPtr> sends;
  std::vector<at::Tensor> sent;  // alive until their sends complete
  const auto isend = [&](const at::Tensor& t, int peer) {
    // Completed sends release their tensors, so activations do not outlive the schedule's bound.
    for (size_t i = sends.size(); i-- > 0;) {
      if (sends[i]->is_completed()) {
        sends[i]->wait();  // rethrows an engine error
        sends.erase(sends.begin() + static_cast<std::ptrdiff_t>(i));
        sent.erase(sent.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    sent.push_back(t.contiguous());
    sends.push_back(comm.isend(sent.back(), peer));
  };
  const auto check_shape = [&](const at::Tensor& t, const Action& a, const char* what) {
    SHARDOPT_CHECK(t.sizes().vec() == options.activation_shape &&
                       t.scalar_type() == options.activation_dtype &&
                       t.device() == options.activation_device,
                   InvalidArgument,
                   "pipeline: the {} of {} on rank {} is {}, but activations between stages "
                   "must be [{}] {} {} (PipelineRunOptions)",
                   what, to_string(a), rank, describe(t), fmt::join(options.activation_shape, ", "),
                   c10::toString(options.activation_dtype), options.activation_device.str());
  };

  // Where a received tensor goes: the input of a Forward (a leaf requiring grad), or the
  // gradient of an output.
  const auto store = [&](const Action& a, const at::Tensor& received) {
    InFlight& g = live[{a.chunk, a.microbatch}];
    if (a.type == ActionType::RecvActivation) {
      g.input = received;
      g.input.requires_grad_(true);
    } else {
      g.grad = received;
    }
  };
  const bool pair =
      options.pair_exchanges == PipelineRunOptions::Pairing::Always ||
      (options.pair_exchanges == PipelineRunOptions::Pairing::Auto &&
       comm.backend().find("nccl") != std::string::npos);
  if (pair) {
    const std::string deadlock = paired_deadlock(schedule);
    SHARDOPT_CHECK(deadlock.empty(), Unsupported,
                   "pipeline: {} pairs each send with the receive after it (Note [Paired "
                   "exchanges]: NCCL's way), under which this schedule would hang: {}",
                   comm.backend(), deadlock);
  }
  // Sends this rank's message and, where it pairs with the next action, that Recv in one batch
  // (Note [Paired exchanges]); returns whether it did the latter.
  const auto send = [&](const std::vector<Action>& list, size_t i, const at::Tensor& t) {
    if (!pair || !pairs_with_next(list, i)) {
      isend(t, list[i].peer);
      return false;
    }
    const at::Tensor received = activation();
    comm.batch_isend_irecv({P2pOp{P2pOp::Kind::Send, t.contiguous(), list[i].peer},
                            P2pOp{P2pOp::Kind::Recv, received, list[i].peer}})
        ->wait();
    store(list[i + 1], received);
    return true;
  };

  // A (chunk, micro-batch)'s tensors and graph are dropped after its last action here.
  const std::vector<Action>& list = schedule.actions.at(rank);
  std::map<std::pair<int, int>, int> uses;
  bool split_backward = false;
  for (const Action& a : list) {
    ++uses[{a.chunk, a.microbatch}];
    split_backward = split_backward || a.type == ActionType::BackwardInput;
  }

  PipelineTrace* const trace = options.trace;
  if (trace) {
    trace->actions.assign(list.size(), PipelineActionTiming{});
    trace->live_bytes_before = MemoryTracker::cpu().live_bytes();
  }
  size_t received_with_send = list.size();  // the Recv that a paired Send received already
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    const int64_t start_ns = trace ? steady_ns() : 0;
    const int64_t start_cpu_ns = trace ? thread_cpu_ns() : 0;
    InFlight& f = live[{a.chunk, a.microbatch}];
    const PipelineChunk& chunk = chunks.at(a.chunk);
    switch (a.type) {
      case ActionType::RecvActivation:
      case ActionType::RecvGrad:
        if (i != received_with_send) {
          const at::Tensor received = activation();
          comm.recv(received, a.peer);
          store(a, received);
        }
        break;
      case ActionType::Forward: {
        if (a.stage == 0) {
          f.input = data(a.microbatch);
          // A split backward needs a trunk to the input (Note [Cheap weight pass]); stage 0's
          // floating data gets one for the price of its unused gradient.
          if (split_backward && at::isFloatingType(f.input.scalar_type()) &&
              !f.input.requires_grad()) {
            f.input = f.input.detach().requires_grad_(true);
          }
        }
        f.output = chunk.forward(f.input, a.microbatch);
        if (a.stage == last_stage) {
          SHARDOPT_CHECK(f.output.numel() == 1, InvalidArgument,
                         "pipeline: the last stage must return the micro-batch's loss, a "
                         "scalar, got {} for micro-batch {}",
                         describe(f.output), a.microbatch);
          losses[a.microbatch] = f.output.detach();
        }
        break;
      }
      case ActionType::SendActivation:
        check_shape(f.output, a, "output");
        if (send(list, i, f.output.detach())) received_with_send = i + 1;
        break;
      case ActionType::Backward:
        // Accumulates into the parameters' .grad and, off stage 0, into input.grad.
        torch::autograd::backward({f.output}, {f.grad});
        break;
      case ActionType::BackwardInput:
        // Only the input's gradient now; the graph stays for the weight pass, which will run
        // only the parameters' own branches (Note [Cheap weight pass]).
        if (f.input.requires_grad()) {
          f.input.mutable_grad() = f.split.backward_input(f.output, f.grad, f.input,
                                                          chunk.parameters);
        }
        break;
      case ActionType::BackwardWeight:
        SHARDOPT_CHECK(!chunk.parameters.empty(), InvalidArgument,
                       "pipeline: schedule {} splits the backward pass, which needs the "
                       "parameters of chunk {} (PipelineChunk::parameters)",
                       to_string(schedule.kind), a.chunk);
        if (options.weight_pass) {
          options.weight_pass([&] { f.split.backward_weight(f.output, f.grad, chunk.parameters); });
        } else {
          f.split.backward_weight(f.output, f.grad, chunk.parameters);
        }
        break;
      case ActionType::SendGrad:
        SHARDOPT_CHECK(f.input.grad().defined(), Internal,
                       "pipeline: no input gradient for {} on rank {}", to_string(a), rank);
        if (send(list, i, f.input.grad())) received_with_send = i + 1;
        break;
    }
    if (--uses[{a.chunk, a.microbatch}] == 0) live.erase({a.chunk, a.microbatch});
    if (trace) {
      trace->actions[i] = {start_ns, steady_ns(), thread_cpu_ns() - start_cpu_ns,
                           MemoryTracker::cpu().live_bytes()};
    }
  }
  for (auto& work : sends) work->wait();
  return losses;
}

}  // namespace shardopt
