// validate_schedule() and simulate_schedule(): the rules of Note [Pipeline action lists] checked
// on the lists, and a run of all ranks with integer costs (torch.distributed.pipelining's
// _validate_schedule and _simulate_comms_compute play these parts there). Torch-free.
#include <algorithm>
#include <deque>
#include <map>
#include <utility>

#include "shardopt/error.hpp"
#include "shardopt/pipeline.hpp"

namespace shardopt {
namespace {

bool is_send(ActionType t) { return t == ActionType::SendActivation || t == ActionType::SendGrad; }
bool is_recv(ActionType t) { return t == ActionType::RecvActivation || t == ActionType::RecvGrad; }

// The stage at the other end of a message.
int peer_stage(const Action& a) {
  return a.type == ActionType::SendActivation || a.type == ActionType::RecvGrad ? a.stage + 1
                                                                                 : a.stage - 1;
}

// Whether receive `recv` on its rank takes the message of `send`.
bool matches(const Action& send, const Action& recv) {
  const ActionType expected = send.type == ActionType::SendActivation ? ActionType::RecvActivation
                                                                      : ActionType::RecvGrad;
  return recv.type == expected && recv.microbatch == send.microbatch &&
         recv.stage == peer_stage(send) && send.stage == peer_stage(recv);
}

int64_t cost(const Action& a, const ActionCosts& c) {
  switch (a.type) {
    case ActionType::Forward: return c.forward;
    case ActionType::Backward: return c.backward_input + c.backward_weight;
    case ActionType::BackwardInput: return c.backward_input;
    case ActionType::BackwardWeight: return c.backward_weight;
    default: return 0;
  }
}

void check_shape(const PipelineSchedule& s) {
  const int p = s.ranks, m = s.microbatches, v = s.chunks;
  SHARDOPT_CHECK(static_cast<int>(s.actions.size()) == p, InvalidArgument,
                 "pipeline: a schedule for p = {} ranks needs {} action lists, got {}", p, p,
                 s.actions.size());
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const std::string where = fmt::format("rank {} action {} ({})", r, i, to_string(a));
      SHARDOPT_CHECK(a.microbatch >= 0 && a.microbatch < m && a.chunk >= 0 && a.chunk < v,
                     InvalidArgument,
                     "pipeline: {} names micro-batch {} of chunk {}, expected micro-batch in "
                     "[0, {}) and chunk in [0, {})",
                     where, a.microbatch, a.chunk, m, v);
      SHARDOPT_CHECK(a.stage == a.chunk * p + r, InvalidArgument,
                     "pipeline: {} names stage {}, but chunk {} of rank {} is stage {}", where,
                     a.stage, a.chunk, r, a.chunk * p + r);
      if (is_compute(a.type)) continue;
      const int other = peer_stage(a);
      SHARDOPT_CHECK(other >= 0 && other < s.stages() && a.peer == s.rank_of(other),
                     InvalidArgument,
                     "pipeline: {} must go to or come from stage {} on rank {}, got peer {}",
                     where, other, other >= 0 && other < s.stages() ? s.rank_of(other) : -1,
                     a.peer);
    }
  }
}

// Each (stage, micro-batch): one Forward, one backward (B, or I then W), each input received
// before the compute that needs it and each output sent after the compute that makes it.
void check_local_order(const PipelineSchedule& s) {
  const int S = s.stages();
  for (int r = 0; r < s.ranks; ++r) {
    // Position of each action type per (stage, micro-batch) on this rank; -1: absent.
    std::map<std::tuple<int, int, int>, int> at;
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const auto key = std::make_tuple(static_cast<int>(a.type), a.stage, a.microbatch);
      SHARDOPT_CHECK(at.count(key) == 0, InvalidArgument,
                     "pipeline: rank {} runs {} twice (positions {} and {})", r, to_string(a),
                     at[key], i);
      at[key] = static_cast<int>(i);
    }
    const auto pos = [&](ActionType t, int stage, int mb) {
      auto it = at.find(std::make_tuple(static_cast<int>(t), stage, mb));
      return it == at.end() ? -1 : it->second;
    };
    for (int c = 0; c < s.chunks; ++c) {
      const int st = c * s.ranks + r;
      for (int mb = 0; mb < s.microbatches; ++mb) {
        const auto name = [&](ActionType t) {
          Action a{t, mb, c, st, -1};
          if (!is_compute(t)) a.peer = s.rank_of((peer_stage(a) + S) % S);
          return to_string(a);
        };
        const int f = pos(ActionType::Forward, st, mb);
        const int b = pos(ActionType::Backward, st, mb);
        const int in = pos(ActionType::BackwardInput, st, mb);
        const int w = pos(ActionType::BackwardWeight, st, mb);
        SHARDOPT_CHECK(f >= 0, InvalidArgument, "pipeline: rank {} never runs {}", r,
                       name(ActionType::Forward));
        SHARDOPT_CHECK((b >= 0) != (in >= 0 && w >= 0) && (b < 0 || (in < 0 && w < 0)),
                       InvalidArgument,
                       "pipeline: rank {} must run either {} or both {} and {} for stage {}, "
                       "micro-batch {}",
                       r, name(ActionType::Backward), name(ActionType::BackwardInput),
                       name(ActionType::BackwardWeight), st, mb);
        const int grad = b >= 0 ? b : in;  // the pass that makes the input gradient
        SHARDOPT_CHECK(f < grad && (w < 0 || grad < w), InvalidArgument,
                       "pipeline: rank {} runs the passes of stage {}, micro-batch {} out of "
                       "order: expected F before B (or I before W), got positions F {}, B {}, "
                       "I {}, W {}",
                       r, st, mb, f, b, in, w);
        const auto around = [&](ActionType t, int compute_pos, bool before, bool needed) {
          const int q = pos(t, st, mb);
          SHARDOPT_CHECK(needed == (q >= 0) && (!needed || (before ? q < compute_pos
                                                                   : q > compute_pos)),
                         InvalidArgument,
                         "pipeline: rank {} must {} {} {} its compute at position {}, got "
                         "position {}",
                         r, needed ? "run" : "not run", name(t), before ? "before" : "after",
                         compute_pos, q);
        };
        around(ActionType::RecvActivation, f, true, st > 0);
        around(ActionType::SendActivation, f, false, st < S - 1);
        around(ActionType::RecvGrad, grad, true, st < S - 1);
        around(ActionType::SendGrad, grad, false, st > 0);
      }
    }
  }
}

}  // namespace

const char* to_string(Exchanges exchanges) {
  switch (exchanges) {
    case Exchanges::Separate: return "separate";
    case Exchanges::Batched: return "batched";
    case Exchanges::Paired: return "paired";
  }
  return "?";
}

bool pairs_with_next(const std::vector<Action>& list, size_t i) {
  return i + 1 < list.size() && is_send(list[i].type) && is_recv(list[i + 1].type) &&
         list[i].peer == list[i + 1].peer;
}

size_t exchange_end(const std::vector<Action>& list, size_t i) {
  while (i < list.size() && !is_compute(list[i].type)) ++i;
  return i;
}

SimulatedRun simulate_schedule(const PipelineSchedule& s, const ActionCosts& costs,
                               Exchanges exchanges) {
  check_shape(s);
  const int p = s.ranks;
  const bool paired = exchanges == Exchanges::Paired;
  const bool batched = exchanges == Exchanges::Batched;
  SimulatedRun run;
  run.compute.assign(p, 0);
  run.finish.assign(p, 0);
  run.peak_in_flight.assign(p, 0);
  run.start.resize(p);
  std::vector<size_t> next(p, 0);
  std::vector<int64_t> clock(p, 0);
  std::vector<int> in_flight(p, 0);
  // Messages sent and not yet received, per (from, to), oldest first, with their send time.
  std::map<std::pair<int, int>, std::deque<std::pair<Action, int64_t>>> wire;
  size_t left = 0;
  for (const auto& list : s.actions) left += list.size();
  // Note [Batched exchanges]: each Send's place among the messages to its peer, the positions of
  // each rank's Recvs per sender, and whether a rank has put its batch's (or pair's) sends on the
  // wire yet, and when.
  std::vector<std::vector<size_t>> send_index(p);
  std::vector<std::map<int, std::vector<size_t>>> recv_at(p);
  for (int r = 0; r < p; ++r) {
    std::map<int, size_t> sent_to;
    send_index[r].assign(s.actions[r].size(), 0);
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      if (is_send(a.type)) send_index[r][i] = sent_to[a.peer]++;
      if (is_recv(a.type)) recv_at[r][a.peer].push_back(i);
    }
  }
  std::vector<bool> issued(p, false);
  std::vector<int64_t> issued_at(p, 0);
  // Rank q has posted its Recv at position j: it is done with it, blocked at it, or waiting in
  // the batch (or pair) whose Recv it is.
  const auto posted = [&](int q, size_t j) {
    const auto& list = s.actions[q];
    size_t end = next[q];
    if (batched && issued[q]) end = exchange_end(list, next[q]);
    if (paired && next[q] < list.size() && pairs_with_next(list, next[q])) end = next[q] + 1;
    return j <= end && (j < end || !batched);
  };
  // When rank q posted its Recv at j (for the sender's clock): now, or its batch's issue time.
  const auto posted_time = [&](int q, size_t j) {
    return j >= next[q] && issued[q] ? issued_at[q] : int64_t{0};
  };
  // Takes Recv `a` of rank r off the wire; false while its message has not been sent.
  const auto receive = [&](int r, size_t i, int64_t* start) {
    const Action& a = s.actions[r][i];
    auto& queue = wire[{a.peer, r}];
    if (queue.empty()) return false;
    const auto& [send, sent_at] = queue.front();
    SHARDOPT_CHECK(matches(send, a), InvalidArgument,
                   "pipeline: rank {} action {} ({}) would receive rank {}'s {}: the sends and "
                   "receives between the two ranks are not in the same order",
                   r, i, to_string(a), a.peer, to_string(send));
    *start = std::max(*start, sent_at);
    queue.pop_front();
    return true;
  };
  // Whether rank r's Send at i has its Recv posted on the peer.
  const auto peer_posted = [&](int r, size_t i, int64_t* start) {
    const Action& a = s.actions[r][i];
    const auto& peer_recvs = recv_at[a.peer][r];
    const size_t k = send_index[r][i];
    if (k >= peer_recvs.size() || !posted(a.peer, peer_recvs[k])) return false;
    *start = std::max(*start, posted_time(a.peer, peer_recvs[k]));
    return true;
  };
  while (left > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      const auto& list = s.actions[r];
      while (next[r] < list.size()) {
        const Action& a = list[next[r]];
        int64_t start = clock[r];
        if (batched && !is_compute(a.type)) {
          // One batch: post every send and receive, end when all have met their peers.
          const size_t end = exchange_end(list, next[r]);
          if (!issued[r]) {
            for (size_t i = next[r]; i < end; ++i) {
              if (is_send(list[i].type)) wire[{r, list[i].peer}].emplace_back(list[i], start);
            }
            issued[r] = true;
            issued_at[r] = start;
            progressed = true;
          }
          int64_t done = start;
          bool ready = true;
          std::map<int, size_t> wanted;  // receives per sender
          for (size_t i = next[r]; i < end && ready; ++i) {
            if (is_send(list[i].type)) ready = peer_posted(r, i, &done);
            if (is_recv(list[i].type)) {
              ready = wire[{list[i].peer, r}].size() > wanted[list[i].peer]++;
            }
          }
          if (!ready) break;
          for (size_t i = next[r]; i < end; ++i) {
            if (is_recv(list[i].type)) receive(r, i, &done);
          }
          for (size_t i = next[r]; i < end; ++i) run.start[r].push_back(done);
          issued[r] = false;
          clock[r] = done;
          left -= end - next[r];
          next[r] = end;
          progressed = true;
          continue;
        }
        if (paired && pairs_with_next(list, next[r])) {
          if (!issued[r]) {
            wire[{r, a.peer}].emplace_back(a, start);
            issued[r] = true;
            issued_at[r] = start;
          }
          if (!peer_posted(r, next[r], &start)) break;
          int64_t received = start;
          if (!receive(r, next[r] + 1, &received)) break;
          issued[r] = false;
          run.start[r].push_back(start);
          run.start[r].push_back(received);
          clock[r] = received;
          next[r] += 2;
          left -= 2;
          progressed = true;
          continue;
        }
        if (is_recv(a.type)) {
          if (!receive(r, next[r], &start)) break;  // blocked until the peer sends
        } else if (is_send(a.type)) {
          wire[{r, a.peer}].emplace_back(a, start);
        }
        run.start[r].push_back(start);
        clock[r] = start + cost(a, costs);
        run.compute[r] += cost(a, costs);
        if (a.type == ActionType::Forward) {
          run.peak_in_flight[r] = std::max(run.peak_in_flight[r], ++in_flight[r]);
        } else if (a.type == ActionType::Backward || a.type == ActionType::BackwardWeight) {
          --in_flight[r];
        }
        ++next[r];
        --left;
        progressed = true;
      }
    }
    if (!progressed) {
      std::string blocked;
      for (int r = 0; r < p; ++r) {
        if (next[r] < s.actions[r].size()) {
          blocked += fmt::format("{}rank {} at action {} ({})", blocked.empty() ? "" : ", ", r,
                                 next[r], to_string(s.actions[r][next[r]]));
        }
      }
      const bool waits = exchanges != Exchanges::Separate;
      SHARDOPT_FAIL(InvalidArgument,
                    "pipeline: the {} schedule (p = {}, m = {}, v = {}) deadlocks{}: every rank "
                    "left waits for a message never sent{}: {}",
                    to_string(s.kind), s.ranks, s.microbatches, s.chunks,
                    waits ? fmt::format(" with {} exchanges", to_string(exchanges)) : "",
                    waits ? " or a receive never posted" : "", blocked);
    }
  }
  for (const auto& [pair, queue] : wire) {
    SHARDOPT_CHECK(queue.empty(), InvalidArgument,
                   "pipeline: rank {} sends {} to rank {}, which never receives it", pair.first,
                   to_string(queue.front().first), pair.second);
  }
  for (int r = 0; r < p; ++r) {
    run.finish[r] = clock[r];
    run.makespan = std::max(run.makespan, clock[r]);
  }
  const int64_t useful = *std::max_element(run.compute.begin(), run.compute.end());
  run.bubble = useful > 0 ? static_cast<double>(run.makespan - useful) / useful : 0.0;
  return run;
}

double bubble_formula(PipelineScheduleKind kind, int p, int m, int v) {
  switch (kind) {
    case PipelineScheduleKind::GPipe:
    case PipelineScheduleKind::OneFOneB: return double(p - 1) / m;
    case PipelineScheduleKind::Interleaved1F1B: return double(p - 1) / (v * m);
    case PipelineScheduleKind::ZeroBubbleH1: return double(p - 1) / (3 * m);
  }
  return -1;
}

std::string exchange_deadlock(const PipelineSchedule& schedule, Exchanges exchanges) {
  try {
    simulate_schedule(schedule, {}, exchanges);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

uint64_t fingerprint(const PipelineSchedule& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a offset basis
  const auto mix = [&h](int64_t x) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= static_cast<uint64_t>(x >> (8 * byte)) & 0xff;
      h *= 1099511628211ull;  // FNV prime
    }
  };
  mix(static_cast<int64_t>(s.kind));
  mix(s.ranks);
  mix(s.microbatches);
  mix(s.chunks);
  mix(s.group);
  for (const auto& list : s.actions) {
    mix(static_cast<int64_t>(list.size()));  // so that no action moves between two lists unseen
    for (const Action& a : list) {
      mix(static_cast<int64_t>(a.type));
      mix(a.microbatch);
      mix(a.chunk);
      mix(a.stage);
      mix(a.peer);
    }
  }
  return h;
}

void validate_schedule(const PipelineSchedule& schedule) {
  check_shape(schedule);
  check_local_order(schedule);
  simulate_schedule(schedule);  // message order and deadlock freedom
}

}  // namespace shardopt
