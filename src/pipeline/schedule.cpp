// compile_schedule(): each schedule's order of compute actions per rank, then the sends and
// receives around them (Note [Pipeline action lists] in shardopt/pipeline.hpp). Torch-free.
#include <algorithm>

#include "shardopt/error.hpp"
#include "shardopt/pipeline.hpp"

namespace shardopt {

const char* to_string(PipelineScheduleKind kind) {
  switch (kind) {
    case PipelineScheduleKind::GPipe: return "gpipe";
    case PipelineScheduleKind::OneFOneB: return "1f1b";
    case PipelineScheduleKind::Interleaved1F1B: return "interleaved";
    case PipelineScheduleKind::ZeroBubbleH1: return "zb-h1";
  }
  return "?";
}

PipelineScheduleKind parse_schedule_kind(const std::string& name) {
  for (auto kind : {PipelineScheduleKind::GPipe, PipelineScheduleKind::OneFOneB,
                    PipelineScheduleKind::Interleaved1F1B, PipelineScheduleKind::ZeroBubbleH1}) {
    if (name == to_string(kind)) return kind;
  }
  SHARDOPT_FAIL(InvalidArgument,
                "pipeline: unknown schedule '{}', expected one of gpipe, 1f1b, interleaved, zb-h1",
                name);
}

const char* to_string(ActionType type) {
  switch (type) {
    case ActionType::Forward: return "F";
    case ActionType::Backward: return "B";
    case ActionType::BackwardInput: return "I";
    case ActionType::BackwardWeight: return "W";
    case ActionType::SendActivation: return "sendA";
    case ActionType::RecvActivation: return "recvA";
    case ActionType::SendGrad: return "sendG";
    case ActionType::RecvGrad: return "recvG";
  }
  return "?";
}

bool is_compute(ActionType type) {
  return type == ActionType::Forward || type == ActionType::Backward ||
         type == ActionType::BackwardInput || type == ActionType::BackwardWeight;
}

std::string to_string(const Action& a) {
  std::string s = fmt::format("{}{}c{}", to_string(a.type), a.microbatch, a.chunk);
  if (is_compute(a.type)) return s;
  const bool send = a.type == ActionType::SendActivation || a.type == ActionType::SendGrad;
  return fmt::format("{}{}{}", s, send ? ">" : "<", a.peer);
}

namespace {

using Order = std::vector<std::vector<Action>>;  // compute actions per rank

Action compute(ActionType type, int microbatch, int chunk, int rank, int ranks) {
  return Action{type, microbatch, chunk, chunk * ranks + rank, -1};
}

Order gpipe(int p, int m) {
  Order order(p);
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) order[r].push_back(compute(ActionType::Forward, i, 0, r, p));
    for (int i = 0; i < m; ++i) order[r].push_back(compute(ActionType::Backward, i, 0, r, p));
  }
  return order;
}

// Rank r runs p-1-r forwards ahead, then alternates one forward and one backward, so at most
// p-r micro-batches hold activations on it (PipeDream-Flush, Narayanan et al. 2021).
Order one_f_one_b(int p, int m) {
  Order order(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - 1 - r, m);
    for (int i = 0; i < warmup; ++i) order[r].push_back(compute(ActionType::Forward, i, 0, r, p));
    for (int i = 0; i < m - warmup; ++i) {
      order[r].push_back(compute(ActionType::Forward, warmup + i, 0, r, p));
      order[r].push_back(compute(ActionType::Backward, i, 0, r, p));
    }
    for (int i = m - warmup; i < m; ++i) {
      order[r].push_back(compute(ActionType::Backward, i, 0, r, p));
    }
  }
  return order;
}

// Megatron's interleaved 1F1B: micro-batches go through the rank's chunks in groups of p; the
// k-th forward of a rank is micro-batch (k / pv) * p + k % p on chunk (k % pv) / p, backwards
// visit the chunks in reverse. Warmup 2(p-1-r) + (v-1)p forwards; with m == p all forwards first.
Order interleaved(int p, int m, int v) {
  Order order(p);
  const int total = m * v;
  const auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  const auto forward_chunk = [&](int k) { return (k % (p * v)) / p; };
  const auto backward_chunk = [&](int k) { return v - 1 - (k % (p * v)) / p; };
  for (int r = 0; r < p; ++r) {
    const int warmup = m == p ? total : std::min(2 * (p - 1 - r) + (v - 1) * p, total);
    auto& list = order[r];
    const auto fwd = [&](int k) {
      list.push_back(compute(ActionType::Forward, microbatch(k), forward_chunk(k), r, p));
    };
    const auto bwd = [&](int k) {
      list.push_back(compute(ActionType::Backward, microbatch(k), backward_chunk(k), r, p));
    };
    for (int k = 0; k < warmup; ++k) fwd(k);
    for (int k = 0; k < total - warmup; ++k) {
      fwd(warmup + k);
      bwd(k);
    }
    for (int k = total - warmup; k < total; ++k) bwd(k);
  }
  return order;
}

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B's order of F and
// B (B now the input-gradient pass only), with rank r deferring its weight passes W by r
// micro-batches: each W runs right after a B from the (r+1)-th B on, the rest at the end, where
// 1F1B's cooldown would idle. Every rank then holds at most p micro-batches between F and W (the
// first rank's 1F1B peak), and with equal F/B/W costs and m >= p the bubble is (p-1)/(3m).
// torch.distributed.pipelining builds ZB-H1 the same way (_get_1f1b_rank_ops, zero bubble).
Order zero_bubble_h1(int p, int m) {
  Order order(p);
  for (int r = 0; r < p; ++r) {
    auto& list = order[r];
    const int warmup = std::min(p - 1 - r, m);
    int b = 0, w = 0;
    const auto backward = [&] {
      list.push_back(compute(ActionType::BackwardInput, b, 0, r, p));
      if (b++ >= r) list.push_back(compute(ActionType::BackwardWeight, w++, 0, r, p));
    };
    for (int i = 0; i < warmup; ++i) list.push_back(compute(ActionType::Forward, i, 0, r, p));
    for (int i = warmup; i < m; ++i) {
      list.push_back(compute(ActionType::Forward, i, 0, r, p));
      backward();
    }
    while (b < m) backward();
    while (w < m) list.push_back(compute(ActionType::BackwardWeight, w++, 0, r, p));
  }
  return order;
}

// Wraps each compute action in the receive of its input and the send of its output.
std::vector<std::vector<Action>> with_messages(const Order& order, int p, int v) {
  const int stages = p * v;
  std::vector<std::vector<Action>> lists(p);
  for (int r = 0; r < p; ++r) {
    for (const Action& a : order[r]) {
      const int s = a.stage;
      const auto message = [&](ActionType type, int peer_stage) {
        lists[r].push_back(Action{type, a.microbatch, a.chunk, s, peer_stage % p});
      };
      switch (a.type) {
        case ActionType::Forward:
          if (s > 0) message(ActionType::RecvActivation, s - 1);
          lists[r].push_back(a);
          if (s < stages - 1) message(ActionType::SendActivation, s + 1);
          break;
        case ActionType::Backward:
        case ActionType::BackwardInput:
          if (s < stages - 1) message(ActionType::RecvGrad, s + 1);
          lists[r].push_back(a);
          if (s > 0) message(ActionType::SendGrad, s - 1);
          break;
        default:
          lists[r].push_back(a);
      }
    }
  }
  return lists;
}

}  // namespace

PipelineSchedule compile_schedule(PipelineScheduleKind kind, int ranks, int microbatches,
                                  int chunks) {
  const char* name = to_string(kind);
  SHARDOPT_CHECK(ranks >= 1, InvalidArgument,
                 "pipeline: the number of pipeline ranks p must be at least 1, got {}", ranks);
  SHARDOPT_CHECK(microbatches >= 1, InvalidArgument,
                 "pipeline: the number of micro-batches m must be at least 1, got {}",
                 microbatches);
  SHARDOPT_CHECK(chunks >= 1, InvalidArgument,
                 "pipeline: the number of chunks per rank v must be at least 1, got {}", chunks);
  const bool interleave = kind == PipelineScheduleKind::Interleaved1F1B;
  SHARDOPT_CHECK(interleave || chunks == 1, InvalidArgument,
                 "pipeline: schedule {} places one chunk per rank, got v = {} chunks; only "
                 "interleaved takes v > 1",
                 name, chunks);
  if (interleave) {
    SHARDOPT_CHECK(chunks >= 2 && ranks >= 2, InvalidArgument,
                   "pipeline: schedule interleaved needs v >= 2 chunks per rank and p >= 2 ranks "
                   "(use 1f1b for v = 1), got p = {}, v = {}",
                   ranks, chunks);
    SHARDOPT_CHECK(microbatches % ranks == 0, InvalidArgument,
                   "pipeline: schedule interleaved needs the number of micro-batches to be a "
                   "multiple of the pipeline ranks (micro-batches go round in groups of p), "
                   "expected m % p == 0, got m = {}, p = {}",
                   microbatches, ranks);
  }
  Order order;
  switch (kind) {
    case PipelineScheduleKind::GPipe: order = gpipe(ranks, microbatches); break;
    case PipelineScheduleKind::OneFOneB: order = one_f_one_b(ranks, microbatches); break;
    case PipelineScheduleKind::Interleaved1F1B:
      order = interleaved(ranks, microbatches, chunks);
      break;
    case PipelineScheduleKind::ZeroBubbleH1: order = zero_bubble_h1(ranks, microbatches); break;
  }
  PipelineSchedule schedule;
  schedule.kind = kind;
  schedule.ranks = ranks;
  schedule.microbatches = microbatches;
  schedule.chunks = chunks;
  schedule.actions = with_messages(order, ranks, chunks);
  return schedule;
}

}  // namespace shardopt
