// compile_schedule(): each schedule's order of compute actions per rank, then the sends and
// receives around them (Note [Pipeline action lists] in shardopt/pipeline.hpp). Torch-free.
#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

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

// Megatron-core's interleaved 1F1B (forward_backward_pipelining_with_interleaving), in its
// iterations. Its table: micro-batches go through the chunks in groups of N (Note [Micro-batch
// groups]), the k-th forward of every rank being table[k]; backwards follow the same table with
// the chunks reversed. Rank r runs W = 2(p-1-r) + (v-1)N warm-up iterations of one F, then
// iterations of F then B, then of B alone: F k in iteration k, B k in iteration W + k (some
// iterations are empty when W exceeds v*m; Megatron caps the warm-up there, which runs the same
// computes in the same order). Returns, per rank, the computes of each iteration.
using Iterations = std::vector<std::vector<std::vector<Action>>>;  // [rank][iteration]

Iterations interleaved(int p, int m, int v, int n) {
  std::vector<std::pair<int, int>> table;  // (micro-batch, chunk) of the k-th forward
  for (int lo = 0; lo < m; lo += n) {
    const int hi = lo + n >= m ? m : lo + n;  // Megatron's get_schedule_table
    for (int c = 0; c < v; ++c) {
      for (int mb = lo; mb < hi; ++mb) table.emplace_back(mb, c);
    }
  }
  const int total = m * v;
  Iterations out(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = 2 * (p - 1 - r) + (v - 1) * n;
    auto& its = out[r];
    its.resize(warmup + total);
    for (int k = 0; k < total; ++k) {
      its[k].push_back(compute(ActionType::Forward, table[k].first, table[k].second, r, p));
    }
    for (int k = 0; k < total; ++k) {
      its[warmup + k].push_back(
          compute(ActionType::Backward, table[k].first, v - 1 - table[k].second, r, p));
    }
  }
  return out;
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

// Note [Batched exchanges]'s placement for interleaved: after iteration t of rank q, one run of
// messages: the sends of t's computes, then the receives of what the peers send at the same time
// (iteration t + q - r of receiver r), activations before gradients as the sends, so that the
// messages between two ranks match in order (one sender iteration per pair and run). That each
// receive comes before its compute is checked here; the validator checks the rest.
std::vector<std::vector<Action>> aligned_messages(const Iterations& its, int p, int v) {
  const int stages = p * v;
  struct Slot {
    std::vector<Action> sends;
    std::vector<std::pair<int, Action>> recvs;  // (sender's iteration, receive)
  };
  std::vector<std::vector<Slot>> slots(p);  // [rank][t + 1]: the run after iteration t
  std::map<std::tuple<int, int, int, int>, int> when;  // (rank, type, mb, chunk) -> iteration
  for (int r = 0; r < p; ++r) {
    slots[r].resize(its[r].size() + 1);
    for (size_t t = 0; t < its[r].size(); ++t) {
      for (const Action& a : its[r][t]) {
        when[{r, static_cast<int>(a.type), a.microbatch, a.chunk}] = static_cast<int>(t);
      }
    }
  }
  const auto activation_first = [](ActionType t) {
    return t == ActionType::SendActivation || t == ActionType::RecvActivation ? 0 : 1;
  };
  for (int q = 0; q < p; ++q) {
    for (size_t t = 0; t < its[q].size(); ++t) {
      for (const Action& a : its[q][t]) {
        const bool forward = a.type == ActionType::Forward;
        const int to = forward ? a.stage + 1 : a.stage - 1;
        if (to < 0 || to >= stages) continue;
        const int r = to % p, chunk = to / p;
        slots[q][t + 1].sends.push_back(Action{
            forward ? ActionType::SendActivation : ActionType::SendGrad, a.microbatch, a.chunk,
            a.stage, r});
        const int at = static_cast<int>(t) + q - r;
        const int needed = when.at({r, static_cast<int>(a.type), a.microbatch, chunk});
        SHARDOPT_INTERNAL_ASSERT(at >= -1 && at < needed,
                                 "pipeline: a receive at iteration {} for a compute at {}", at,
                                 needed);
        slots[r][at + 1].recvs.emplace_back(
            static_cast<int>(t), Action{forward ? ActionType::RecvActivation : ActionType::RecvGrad,
                                        a.microbatch, chunk, to, q});
      }
    }
  }
  std::vector<std::vector<Action>> lists(p);
  for (int r = 0; r < p; ++r) {
    for (size_t t = 0; t <= its[r].size(); ++t) {
      if (t > 0) lists[r].insert(lists[r].end(), its[r][t - 1].begin(), its[r][t - 1].end());
      Slot& slot = slots[r][t];
      std::stable_sort(slot.sends.begin(), slot.sends.end(), [&](const Action& x, const Action& y) {
        return activation_first(x.type) < activation_first(y.type);
      });
      std::stable_sort(slot.recvs.begin(), slot.recvs.end(), [&](const auto& x, const auto& y) {
        return std::make_pair(activation_first(x.second.type), x.first) <
               std::make_pair(activation_first(y.second.type), y.first);
      });
      lists[r].insert(lists[r].end(), slot.sends.begin(), slot.sends.end());
      for (const auto& [sent_at, recv] : slot.recvs) lists[r].push_back(recv);
    }
  }
  return lists;
}

}  // namespace

int interleaved_group_size(int ranks, int microbatches) {
  SHARDOPT_CHECK(microbatches >= ranks, InvalidArgument,
                 "pipeline: schedule interleaved needs at least as many micro-batches as pipeline "
                 "ranks (Megatron-core: p <= microbatch_group_size_per_vp_stage <= m), got m = {}, "
                 "p = {}",
                 microbatches, ranks);
  if (microbatches % ranks == 0) return ranks;
  int n = ranks + 1;
  while (microbatches % n != 0 && microbatches % n < ranks) ++n;  // ends at n = m at the latest
  return n;
}

PipelineSchedule compile_schedule(PipelineScheduleKind kind, int ranks, int microbatches,
                                  int chunks, int group) {
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
    if (group == 0) group = interleaved_group_size(ranks, microbatches);
    SHARDOPT_CHECK(group >= ranks && group <= microbatches &&
                       (microbatches % group == 0 || microbatches % group >= ranks),
                   InvalidArgument,
                   "pipeline: schedule interleaved runs micro-batches in groups of N = {} (Note "
                   "[Micro-batch groups]), expected p <= N <= m and m % N == 0 or m % N >= p "
                   "(Megatron-core's rule for microbatch_group_size_per_vp_stage), got p = {}, "
                   "m = {}",
                   group, ranks, microbatches);
  }
  SHARDOPT_CHECK(interleave || group == 0 || group == 1, InvalidArgument,
                 "pipeline: schedule {} has no micro-batch groups, got group = {}; only "
                 "interleaved takes one",
                 name, group);
  PipelineSchedule schedule;
  schedule.kind = kind;
  schedule.ranks = ranks;
  schedule.microbatches = microbatches;
  schedule.chunks = chunks;
  schedule.group = interleave ? group : 1;
  switch (kind) {
    case PipelineScheduleKind::GPipe:
      schedule.actions = with_messages(gpipe(ranks, microbatches), ranks, chunks);
      break;
    case PipelineScheduleKind::OneFOneB:
      schedule.actions = with_messages(one_f_one_b(ranks, microbatches), ranks, chunks);
      break;
    case PipelineScheduleKind::Interleaved1F1B:
      schedule.actions =
          aligned_messages(interleaved(ranks, microbatches, chunks, group), ranks, chunks);
      break;
    case PipelineScheduleKind::ZeroBubbleH1:
      schedule.actions = with_messages(zero_bubble_h1(ranks, microbatches), ranks, chunks);
      break;
  }
  return schedule;
}

}  // namespace shardopt
