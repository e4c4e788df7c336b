// run_pipeline(): one loop over this rank's action list (Note [Pipeline action lists]). Sends are
// isend (waited for at the end), receives block, which are the semantics the validator proved
// deadlock-free; on NCCL the messages between two compute passes go as one batch (Note [Batched
// exchanges], proved likewise). Activations and their graphs live from a chunk's
// Forward to its last backward pass for that micro-batch. Nothing is sent before every rank of the
// group has checked the call and agreed on the schedule.
#include "shardopt/pipeline_runner.hpp"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/autograd.h>

#include <time.h>

#include <chrono>
#include <exception>
#include <map>
#include <optional>
#include <utility>

#include "pipeline/split_backward.hpp"
#include "shardopt/error.hpp"
#include "shardopt/memory_tracker.hpp"

namespace shardopt {

// Note [Pipeline handshake]
// Autograd alone tells an optimizer little about a pipeline step: every backward pass looks like a
// micro-step of the whole model, so the caller had to set grad_accumulation_steps = v*m, wrap
// ZB-H1's weight pass (one autograd run per split node) to count it once, and every pass's end
// reduced every bucket: interleaved stage 2 at m = 8 sent its gradients 16 times a step, half of
// them buckets of zeros for the chunk the pass did not run. Given PipelineRunOptions::optimizer,
// the runner says what it knows, as torch pipelining's REDUCE_GRAD actions: begin_pipeline(v, m)
// (the step's passes), chunk_backward(chunk, last, pass) around each Backward or BackwardWeight
// (ZB-H1's input pass computes no parameter gradient and is no pass; its units' output hooks
// no longer open one), end_pipeline(). The optimizer then reduces each bucket once a step: in
// place (stages 0-1) and in deferred buckets (stages 2-3, deferred by default under pipelines:
// Note [Deferred reduction]) a parameter's gradient is final after its chunk's last pass, and a
// bucket whose every parameter is final goes out (in layout order, Note [Bucket completion])
// while the other chunks' passes still run; the step's last pass flushes the rest (parameters
// that got no gradient). A parameter that gets a gradient in two chunks of one rank is refused by
// name when its second chunk's gradient arrives. Counted: StepStats::reduce_elements is the same
// at every stage and schedule (PipelineZero.Stage2SendsStage1GradientElements).

namespace {

// What one (chunk, micro-batch) keeps between its passes on this rank.
struct InFlight {
  std::vector<at::Tensor> inputs;   // received activations (floating ones leaves requiring
                                    // grad); stage 0: the data
  std::vector<at::Tensor> outputs;  // the chunk's outputs (the loss on the last stage)
  std::vector<at::Tensor> grads;    // per output, the gradient received from the next stage
  detail::SplitBackward split;      // zero-bubble schedules: what B keeps for W
};

// The dtype and shape of each tensor crossing one boundary.
struct TensorSpec {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  bool operator==(const TensorSpec& o) const { return dtype == o.dtype && shape == o.shape; }
};
using BoundarySpec = std::vector<TensorSpec>;

std::string to_string(const BoundarySpec& spec) {
  std::string out;
  for (const TensorSpec& t : spec) {
    out += fmt::format("{}[{}] {}", out.empty() ? "" : ", ", fmt::join(t.shape, ", "),
                       c10::toString(t.dtype));
  }
  return "(" + out + ")";
}

BoundarySpec spec_of(const std::vector<at::Tensor>& tensors) {
  BoundarySpec spec;
  for (const at::Tensor& t : tensors) spec.push_back({t.scalar_type(), t.sizes().vec()});
  return spec;
}

// Note [Boundary headers]: with no fixed activation_shape, the first message of each boundary
// (sender stage s -> s+1) is a header of kHeaderInts int64: a magic number, the number of tensors
// n, then per tensor its dtype, its rank and its sizes. The receiver's first Recv of that boundary
// takes the header, then the tensors; later micro-batches send the tensors alone, checked by the
// sender against the header (torch.distributed.pipelining infers shapes once, likewise). The
// header has a fixed size so that a batched exchange can post its receive before knowing what
// follows. Gradients need none: the sender of the activations knows their shapes.
constexpr int64_t kHeaderInts = 64;
constexpr int64_t kHeaderMagic = 0x5348504950;  // "SHPIP"

at::Tensor encode(const BoundarySpec& spec, c10::Device device, const std::string& where) {
  std::vector<int64_t> words{kHeaderMagic, static_cast<int64_t>(spec.size())};
  for (const TensorSpec& t : spec) {
    words.push_back(static_cast<int64_t>(t.dtype));
    words.push_back(static_cast<int64_t>(t.shape.size()));
    words.insert(words.end(), t.shape.begin(), t.shape.end());
  }
  SHARDOPT_CHECK(static_cast<int64_t>(words.size()) <= kHeaderInts, InvalidArgument,
                 "pipeline: {} returns {}, which takes {} header words, expected at most {} "
                 "(fewer tensors or dimensions per boundary)",
                 where, to_string(spec), words.size(), kHeaderInts);
  words.resize(kHeaderInts, 0);
  return at::tensor(words, at::kLong).to(device);
}

BoundarySpec decode(const at::Tensor& header, const std::string& where) {
  const at::Tensor h = header.to(at::kCPU);
  const int64_t* w = h.data_ptr<int64_t>();
  SHARDOPT_CHECK(w[0] == kHeaderMagic && w[1] >= 0, InvalidArgument,
                 "pipeline: {} expected a boundary header (magic {:#x}), got {:#x}: do all ranks "
                 "leave PipelineRunOptions::activation_shape empty?",
                 where, kHeaderMagic, w[0]);
  BoundarySpec spec;
  int64_t at_word = 2;
  for (int64_t i = 0; i < w[1]; ++i) {
    SHARDOPT_INTERNAL_ASSERT(at_word + 2 <= kHeaderInts && at_word + 2 + w[at_word + 1] <= kHeaderInts,
                             "pipeline: boundary header overflows");
    TensorSpec t{static_cast<at::ScalarType>(w[at_word]), {}};
    t.shape.assign(w + at_word + 2, w + at_word + 2 + w[at_word + 1]);
    at_word += 2 + w[at_word + 1];
    spec.push_back(std::move(t));
  }
  return spec;
}

// What goes on the wire for `t`: booleans (masks) as bytes of the same storage, which every
// engine carries; the rest as they are.
at::Tensor on_wire(const at::Tensor& t) {
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t;
}

// Every rank's view of the call, all-gathered before any message: the schedule's summary and
// fingerprint and whether the rank's own checks passed. Mismatches and local errors then stop
// every rank, named, where a lone throw would leave the others waiting in a receive.
void agree_on_call(const PipelineSchedule& schedule, Communicator& comm, c10::Device device,
                   const std::exception_ptr& local_error) {
  const uint64_t h = fingerprint(schedule);
  constexpr int64_t kWords = 7;
  // doubles hold the 32-bit halves exactly, and every engine gathers them.
  const at::Tensor mine =
      at::tensor({static_cast<double>(schedule.kind), static_cast<double>(schedule.ranks),
                  static_cast<double>(schedule.microbatches), static_cast<double>(schedule.chunks),
                  static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffu),
                  local_error ? 1.0 : 0.0},
                 at::kDouble)
          .to(device);
  at::Tensor all = at::empty({kWords * comm.size()}, mine.options());
  comm.all_gather(mine, all, /*async=*/true)->wait();
  all = all.to(at::kCPU).view({comm.size(), kWords});
  const auto row = [&](int r) {
    const double* w = all[r].data_ptr<double>();
    return std::vector<double>(w, w + kWords);
  };
  // Group the ranks by schedule; name each group by what a reader can compare.
  std::map<std::vector<double>, std::vector<int>> by_schedule;
  std::vector<int> refused;
  for (int r = 0; r < comm.size(); ++r) {
    std::vector<double> w = row(r);
    if (w[6] != 0) refused.push_back(r);
    w.pop_back();
    by_schedule[w].push_back(r);
  }
  if (by_schedule.size() > 1) {
    std::string groups;
    for (const auto& [w, ranks] : by_schedule) {
      groups += fmt::format(
          "{}rank{} {}: {} (p = {}, m = {}, v = {}, fingerprint {:08x}{:08x})",
          groups.empty() ? "" : "; ", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "),
          shardopt::to_string(static_cast<PipelineScheduleKind>(static_cast<int>(w[0]))),
          static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]),
          static_cast<uint32_t>(w[4]), static_cast<uint32_t>(w[5]));
    }
    SHARDOPT_FAIL(Mismatch,
                  "pipeline: the ranks of the pipeline group were handed different schedules, "
                  "expected the same one on every rank (same kind, p, m, v and action lists), "
                  "got: {}",
                  groups);
  }
  if (local_error) std::rethrow_exception(local_error);
  SHARDOPT_CHECK(refused.empty(), InvalidArgument,
                 "pipeline: rank{} {} refused this run_pipeline call (its error names why), "
                 "expected every rank of the pipeline group to accept it; stopping here rather "
                 "than wait for messages that will not come",
                 refused.size() > 1 ? "s" : "", fmt::join(refused, ", "));
}

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
  const int rank = comm.rank();
  const c10::Device device = options.activation_device;
  {
    std::exception_ptr local_error;
    try {
      SHARDOPT_CHECK(schedule.ranks == comm.size(), InvalidArgument,
                     "pipeline: the schedule is for p = {} ranks, but the communicator has {}",
                     schedule.ranks, comm.size());
      SHARDOPT_CHECK(static_cast<int>(chunks.size()) == schedule.chunks, InvalidArgument,
                     "pipeline: the {} schedule places v = {} chunks on each rank, got {} chunks",
                     to_string(schedule.kind), schedule.chunks, chunks.size());
      for (size_t c = 0; c < chunks.size(); ++c) {
        SHARDOPT_CHECK(chunks[c].forward || chunks[c].forward_tensors, InvalidArgument,
                       "pipeline: chunk {} on rank {} has no function, expected "
                       "PipelineChunk::forward or forward_tensors to be set",
                       c, rank);
      }
      validate_schedule(schedule);  // the same outcome on every rank handed the same schedule
    } catch (const Error&) {
      local_error = std::current_exception();
    }
    if (comm.size() > 1) {
      agree_on_call(schedule, comm, device, local_error);
    } else if (local_error) {
      std::rethrow_exception(local_error);
    }
  }
  const int last_stage = schedule.stages() - 1;
  const bool fixed = !options.activation_shape.empty();
  // Per local chunk: what crosses its input and output boundaries, once known (Note [Boundary
  // headers]); with a fixed activation_shape, known from the start.
  std::vector<std::optional<BoundarySpec>> in_spec(chunks.size()), out_spec(chunks.size());
  if (fixed) {
    const BoundarySpec one{{options.activation_dtype, options.activation_shape}};
    in_spec.assign(chunks.size(), one);
    out_spec.assign(chunks.size(), one);
  }
  const auto where = [&](const Action& a) {
    return fmt::format("{} on rank {} (stage {})", to_string(a), rank, a.stage);
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
    sent.push_back(t);
    sends.push_back(comm.isend(sent.back(), peer));
  };
  const auto buffers = [&](const BoundarySpec& spec, bool grads_only) {
    std::vector<at::Tensor> out;
    for (const TensorSpec& t : spec) {
      if (grads_only && !at::isFloatingType(t.dtype)) continue;
      out.push_back(at::empty(t.shape, at::TensorOptions().dtype(t.dtype).device(device)));
    }
    return out;
  };

  // The messages of one Send action, in order: a header the first time a boundary is crossed
  // (Note [Boundary headers]), then the tensors (gradients: one per floating activation).
  const auto outgoing = [&](const Action& a, InFlight& f) {
    std::vector<at::Tensor> msgs;
    if (a.type == ActionType::SendActivation) {
      const BoundarySpec spec = spec_of(f.outputs);
      auto& agreed = out_spec[a.chunk];
      if (!agreed) {
        msgs.push_back(encode(spec, device, where(a)));
        agreed = spec;
      }
      SHARDOPT_CHECK(spec == *agreed, InvalidArgument,
                     "pipeline: {} returns {}, but this boundary carries {} ({}), expected the "
                     "same on every micro-batch",
                     where(a), to_string(spec), to_string(*agreed),
                     fixed ? "PipelineRunOptions::activation_shape and activation_dtype"
                           : "agreed on its first micro-batch");
      for (const at::Tensor& t : f.outputs) {
        SHARDOPT_CHECK(t.device() == device, InvalidArgument,
                       "pipeline: {} returns a tensor on {}, expected {} "
                       "(PipelineRunOptions::activation_device)",
                       where(a), t.device().str(), device.str());
        msgs.push_back(on_wire(t.detach().contiguous()));
      }
    } else {
      for (const at::Tensor& in : f.inputs) {
        if (!at::isFloatingType(in.scalar_type())) continue;
        // An input the chunk did not differentiate through sends zeros: the peer waits for it.
        msgs.push_back(in.grad().defined() ? in.grad().contiguous() : at::zeros_like(in));
      }
    }
    return msgs;
  };
  // Where received tensors go: the inputs of a Forward (floating ones leaves requiring grad), or
  // the gradients of the floating outputs.
  const auto store = [&](const Action& a, std::vector<at::Tensor> received) {
    InFlight& g = live[{a.chunk, a.microbatch}];
    if (a.type == ActionType::RecvActivation) {
      for (at::Tensor& t : received) {
        if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
      }
      g.inputs = std::move(received);
      return;
    }
    g.grads.assign(g.outputs.size(), at::Tensor());
    size_t k = 0;
    for (size_t i = 0; i < g.outputs.size(); ++i) {
      if (at::isFloatingType(g.outputs[i].scalar_type())) g.grads[i] = received.at(k++);
    }
  };
  // A Recv's buffers; empty while its boundary's header has not arrived.
  const auto incoming = [&](const Action& a) {
    if (a.type == ActionType::RecvGrad) return buffers(*out_spec[a.chunk], /*grads_only=*/true);
    if (!in_spec[a.chunk]) return std::vector<at::Tensor>{};
    return buffers(*in_spec[a.chunk], false);
  };
  const auto receive_header = [&](const Action& a, const at::Tensor& header) {
    in_spec[a.chunk] = decode(header, where(a));
  };
  const auto recv = [&](const Action& a) {
    std::vector<at::Tensor> into = incoming(a);
    if (a.type == ActionType::RecvActivation && !in_spec[a.chunk]) {
      const at::Tensor header = at::empty({kHeaderInts}, at::TensorOptions(at::kLong).device(device));
      comm.recv(header, a.peer);
      receive_header(a, header);
      into = incoming(a);
    }
    for (const at::Tensor& t : into) comm.recv(on_wire(t), a.peer);
    store(a, std::move(into));
  };

  // Note [Batched exchanges]: the one place that decides, for every schedule.
  using Batching = PipelineRunOptions::Batching;
  const Batching batching = options.batch_exchanges != Batching::Auto ? options.batch_exchanges
                                                                      : options.pair_exchanges;
  const bool nccl = comm.backend().find("nccl") != std::string::npos;
  const bool batch = batching == Batching::Always || (batching == Batching::Auto && nccl);
  if (batch) {
    const std::string deadlock = exchange_deadlock(schedule, Exchanges::Batched);
    SHARDOPT_CHECK(deadlock.empty(), Unsupported,
                   "pipeline: {} issues the messages between two compute passes as one batch "
                   "(Note [Batched exchanges]: NCCL's way), under which this schedule would hang: "
                   "{}",
                   comm.backend(), deadlock);
  }
  // Issues actions [begin, end) of `list`, all messages, as one batch_isend_irecv (Note [Batched
  // exchanges]). A Recv whose boundary header is still to come takes only the header in the
  // batch, and the later receives from that peer wait for the batch: the tensors it announces
  // come first on that link.
  const auto exchange = [&](const std::vector<Action>& list, size_t begin, size_t end) {
    std::vector<P2pOp> ops;
    std::vector<at::Tensor> keep;  // the sent tensors, alive until the batch ends
    std::vector<std::vector<at::Tensor>> into(end - begin);
    std::vector<bool> header(end - begin, false), after(end - begin, false);
    std::map<int, bool> waits;  // peers whose later receives wait for a header
    for (size_t i = begin; i < end; ++i) {
      const Action& a = list[i];
      if (a.type == ActionType::SendActivation || a.type == ActionType::SendGrad) {
        for (at::Tensor& t : outgoing(a, live[{a.chunk, a.microbatch}])) {
          keep.push_back(t);
          ops.push_back({P2pOp::Kind::Send, keep.back(), a.peer});
        }
        continue;
      }
      if (waits[a.peer]) {
        after[i - begin] = true;
        continue;
      }
      into[i - begin] = incoming(a);
      if (a.type == ActionType::RecvActivation && !in_spec[a.chunk]) {
        header[i - begin] = waits[a.peer] = true;
        into[i - begin] = {at::empty({kHeaderInts}, at::TensorOptions(at::kLong).device(device))};
      }
      for (const at::Tensor& t : into[i - begin]) {
        ops.push_back({P2pOp::Kind::Recv, on_wire(t), a.peer});
      }
    }
    comm.batch_isend_irecv(ops)->wait();
    for (size_t i = begin; i < end; ++i) {
      const Action& a = list[i];
      if (a.type == ActionType::SendActivation || a.type == ActionType::SendGrad) continue;
      if (after[i - begin]) {
        recv(a);
        continue;
      }
      if (header[i - begin]) {
        receive_header(a, into[i - begin][0]);
        into[i - begin] = incoming(a);
        for (const at::Tensor& t : into[i - begin]) comm.recv(on_wire(t), a.peer);
      }
      store(a, std::move(into[i - begin]));
    }
  };

  // A (chunk, micro-batch)'s tensors and graph are dropped after its last action here.
  const std::vector<Action>& list = schedule.actions.at(rank);
  std::map<std::pair<int, int>, int> uses;
  bool split_backward = false;
  // Each chunk's last pass that produces parameter gradients (Note [Pipeline handshake]).
  std::vector<size_t> last_pass(chunks.size(), list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    ++uses[{a.chunk, a.microbatch}];
    split_backward = split_backward || a.type == ActionType::BackwardInput;
    if (a.type == ActionType::Backward || a.type == ActionType::BackwardWeight) {
      last_pass[a.chunk] = i;
    }
  }
  PipelineOptimizer* const optimizer = options.optimizer;
  if (optimizer) optimizer->begin_pipeline(schedule.chunks, schedule.microbatches);
  const auto backward_pass = [&](size_t i, const std::function<void()>& pass) {
    if (optimizer) {
      optimizer->chunk_backward(list[i].chunk, i == last_pass[list[i].chunk], pass);
    } else {
      pass();
    }
  };

  PipelineTrace* const trace = options.trace;
  if (trace) {
    trace->actions.assign(list.size(), PipelineActionTiming{});
    trace->live_bytes_before = MemoryTracker::cpu().live_bytes();
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    const int64_t start_ns = trace ? steady_ns() : 0;
    const int64_t start_cpu_ns = trace ? thread_cpu_ns() : 0;
    if (batch && !is_compute(a.type)) {
      const size_t end = exchange_end(list, i);
      exchange(list, i, end);
      const size_t first = i;
      for (; i < end; ++i) {
        const Action& done = list[i];
        if (--uses[{done.chunk, done.microbatch}] == 0) live.erase({done.chunk, done.microbatch});
      }
      if (trace) {  // the batch's time on its first action, the others take none after it
        const int64_t end_ns = steady_ns(), cpu_ns = thread_cpu_ns() - start_cpu_ns;
        for (size_t k = first; k < end; ++k) {
          trace->actions[k] = {k == first ? start_ns : end_ns, end_ns, k == first ? cpu_ns : 0,
                               MemoryTracker::cpu().live_bytes()};
        }
      }
      --i;
      continue;
    }
    InFlight& f = live[{a.chunk, a.microbatch}];
    const PipelineChunk& chunk = chunks.at(a.chunk);
    switch (a.type) {
      case ActionType::RecvActivation:
      case ActionType::RecvGrad:
        recv(a);
        break;
      case ActionType::Forward: {
        if (a.stage == 0) {
          at::Tensor input = data(a.microbatch);
          // A split backward needs a trunk to the input (Note [Cheap weight pass]); stage 0's
          // floating data gets one for the price of its unused gradient.
          if (split_backward && at::isFloatingType(input.scalar_type()) &&
              !input.requires_grad()) {
            input = input.detach().requires_grad_(true);
          }
          f.inputs = {input};
        }
        if (chunk.forward_tensors) {
          f.outputs = chunk.forward_tensors(f.inputs, a.microbatch);
        } else {
          SHARDOPT_CHECK(f.inputs.size() == 1, InvalidArgument,
                         "pipeline: {} receives {} tensors, but chunk {} takes one "
                         "(PipelineChunk::forward), expected forward_tensors to be set",
                         where(a), f.inputs.size(), a.chunk);
          f.outputs = {chunk.forward(f.inputs[0], a.microbatch)};
        }
        if (a.stage == last_stage) {
          SHARDOPT_CHECK(f.outputs.size() == 1 && f.outputs[0].numel() == 1, InvalidArgument,
                         "pipeline: the last stage must return the micro-batch's loss, one "
                         "scalar, got {} tensors ({}) for micro-batch {}",
                         f.outputs.size(), f.outputs.empty() ? "" : describe(f.outputs[0]),
                         a.microbatch);
          losses[a.microbatch] = f.outputs[0].detach();
          f.grads = {at::Tensor()};  // an implicit one
        }
        break;
      }
      case ActionType::SendActivation:
      case ActionType::SendGrad:
        for (const at::Tensor& t : outgoing(a, f)) isend(t, a.peer);
        break;
      case ActionType::Backward: {
        // Accumulates into the parameters' .grad and, off stage 0, into the inputs' .grad.
        std::vector<at::Tensor> outs, grads;
        for (size_t k = 0; k < f.outputs.size(); ++k) {
          if (!f.outputs[k].requires_grad()) continue;
          outs.push_back(f.outputs[k]);
          grads.push_back(k < f.grads.size() ? f.grads[k] : at::Tensor());
        }
        backward_pass(i, [&] {
          if (!outs.empty()) torch::autograd::backward(outs, grads);
        });
        break;
      }
      case ActionType::BackwardInput: {
        // Only the inputs' gradients now; the graph stays for the weight pass, which will run
        // only the parameters' own branches (Note [Cheap weight pass]).
        std::vector<at::Tensor> differentiable;
        for (const at::Tensor& in : f.inputs) {
          if (in.requires_grad()) differentiable.push_back(in);
        }
        if (!differentiable.empty()) {
          const auto grads =
              f.split.backward_input(f.outputs, f.grads, differentiable, chunk.parameters);
          for (size_t k = 0; k < differentiable.size(); ++k) {
            differentiable[k].mutable_grad() = grads[k];
          }
        }
        break;
      }
      case ActionType::BackwardWeight: {
        // Every leaf the chunk's graph reaches, declared or not (Note [Owed gradients]).
        const auto pass = [&] {
          f.split.backward_weight(f.outputs, f.grads, f.inputs, chunk.parameters);
        };
        backward_pass(i, [&] {
          if (options.weight_pass) {
            options.weight_pass(pass);
          } else {
            pass();
          }
        });
        break;
      }
    }
    if (--uses[{a.chunk, a.microbatch}] == 0) live.erase({a.chunk, a.microbatch});
    if (trace) {
      trace->actions[i] = {start_ns, steady_ns(), thread_cpu_ns() - start_cpu_ns,
                           MemoryTracker::cpu().live_bytes()};
    }
  }
  for (auto& work : sends) work->wait();
  if (optimizer) optimizer->end_pipeline();
  return losses;
}

}  // namespace shardopt
