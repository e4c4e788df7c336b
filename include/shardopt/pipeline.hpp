/// \file
/// Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) compiled to per-rank action lists,
/// a validator of such lists and a discrete-event simulator of all ranks. Torch-free: an executor
/// runs the lists over the communicator's send/recv (Note [Pipeline action lists]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt {

// Note [Pipeline action lists]: a schedule is data, not control flow (the lesson of
// torch.distributed.pipelining). compile_schedule() turns (kind, p ranks, m micro-batches, v
// chunks per rank) into one list of Actions per rank; an executor (run_pipeline in
// pipeline_runner.hpp) runs its rank's list front to back and does nothing else.
//   - The model is cut into S = v*p stages; rank r holds chunks c = 0..v-1, chunk c being stage
//     c*p + r (Megatron's interleaved placement; v = 1: stage r on rank r).
//   - Compute actions: Forward, Backward (input and weight gradients together), or the two halves
//     of a zero-bubble backward, BackwardInput (the gradient sent upstream) and BackwardWeight
//     (the parameters' gradients, needing only local state: it can be deferred to fill bubbles).
//   - Communication actions: a SendActivation right after the Forward that produced it (towards
//     stage s+1), a RecvActivation right before the Forward that consumes it; SendGrad and
//     RecvGrad likewise around backward (towards stage s-1). There are no tags: the messages
//     from one rank to another match in the order issued (Note [Point-to-point messages]).
//   - Semantics the validator and the simulator assume and an executor must give: a Send never
//     blocks (isend; its Work is waited for before the step ends), a Recv blocks until its message
//     has arrived. Under these rules validate_schedule() proves the lists deadlock-free by running
//     them (simulate_schedule), so no timing can hang an executor that follows them.
//
// Note [Paired exchanges]: where a lone send and a lone receive queue on one stream (NCCL), two
// ranks sending to each other at once wait on each other. A Send followed directly by a Recv from
// the same peer (1F1B's steady state: send the activation on, receive its gradient back) is then
// issued as one batch, Megatron's send_forward_recv_backward (pairs_with_next); the batch ends
// when both have, so such a Send waits until the peer has posted the matching Recv.
// simulate_schedule(s, costs, /*paired=*/true) runs the lists under these semantics: GPipe, 1F1B
// and ZB-H1 finish; interleaved 1F1B with m > p deadlocks (rank r waits for r+1 to post a
// receive that comes after r+1's own pair, around the ring), so run_pipeline refuses to pair it
// (paired_deadlock) rather than hang; Megatron batches all four messages of a step there.
/// The pipeline schedules compile_schedule() knows (torch.distributed.pipelining's names).
enum class PipelineScheduleKind { GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1 };
/// "gpipe", "1f1b", "interleaved" or "zb-h1".
const char* to_string(PipelineScheduleKind kind);
/// "gpipe", "1f1b", "interleaved", "zb-h1" (the BERT example's --schedule); throws
/// Error{InvalidArgument} listing them otherwise.
PipelineScheduleKind parse_schedule_kind(const std::string& name);

/// What one entry of a rank's action list does.
enum class ActionType {
  Forward,
  Backward,        ///< input and weight gradients in one pass
  BackwardInput,   ///< zero-bubble B: the gradient with respect to the stage's input
  BackwardWeight,  ///< zero-bubble W: the gradients of the stage's parameters
  SendActivation,
  RecvActivation,
  SendGrad,
  RecvGrad,
};
/// "F", "B", "I", "W", "sendA", "recvA", "sendG", "recvG".
const char* to_string(ActionType type);
/// True for Forward, Backward, BackwardInput and BackwardWeight (not the messages).
bool is_compute(ActionType type);

/// One step of a rank's list: a compute pass or a message, for one micro-batch and chunk.
struct Action {
  ActionType type = ActionType::Forward;  ///< what to do
  int microbatch = 0;  ///< 0..m-1
  int chunk = 0;       ///< the local chunk, 0..v-1
  int stage = 0;       ///< the global stage of that chunk, chunk*p + rank
  int peer = -1;       ///< communication: the rank on the other side; compute: -1
};
/// "F3c1" (forward of micro-batch 3 on chunk 1), "sendA3c1>2" (its activation to rank 2), ...
std::string to_string(const Action& action);

/// Every rank's action list, as compile_schedule() makes it.
struct PipelineSchedule {
  PipelineScheduleKind kind = PipelineScheduleKind::OneFOneB;  ///< the schedule compiled
  int ranks = 1;          ///< p
  int microbatches = 1;   ///< m
  int chunks = 1;         ///< v (model chunks per rank; 1 except for interleaved)
  std::vector<std::vector<Action>> actions;  ///< per rank, in execution order
  int stages() const { return ranks * chunks; }  ///< S = p * v, the model's stages
  /// The rank holding global stage `stage` (stage mod p).
  int rank_of(int stage) const { return stage % ranks; }
};

/// Compiles `kind` for p ranks, m micro-batches and v chunks per rank. Throws
/// Error{InvalidArgument} naming the rule on a bad combination: p, m, v >= 1; v > 1 only for
/// Interleaved1F1B (v >= 2 there) and, as Megatron requires, m a multiple of p for it; ZB-H1 and
/// the others take any m.
PipelineSchedule compile_schedule(PipelineScheduleKind kind, int ranks, int microbatches,
                                  int chunks = 1);

/// Compute costs of one action on one chunk, in arbitrary integer units; Backward costs
/// backward_input + backward_weight. Communication costs nothing.
struct ActionCosts {
  int64_t forward = 1;  ///< cost of a Forward
  int64_t backward_input = 1;  ///< cost of a BackwardInput (B)
  int64_t backward_weight = 1;  ///< cost of a BackwardWeight (W)
};

/// What simulate_schedule() finds: times per rank and action, in the costs' units.
struct SimulatedRun {
  int64_t makespan = 0;                  ///< when the last rank finishes its last action
  std::vector<int64_t> compute;          ///< per rank: the sum of its compute costs
  std::vector<int64_t> finish;           ///< per rank: when its last action ended
  /// Per rank: most micro-batch-chunks whose Forward ran and.
  std::vector<int> peak_in_flight;
                                         ///< whose backward (Backward or BackwardWeight) had not
  std::vector<std::vector<int64_t>> start;  ///< per rank and action: its start time
  // Note [Bubble]: idle over useful time, (makespan - C) / C, C being the largest per-rank
  // compute (every rank computes the same in these schedules): Megatron's t_bubble / t_ideal,
  // which is (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved, ~(p-1)/(3m) for ZB-H1 with
  // equal F, B and W costs.
  double bubble = 0;  ///< (makespan - C) / C, Note [Bubble]
};

// Note [Bubble]'s formula for a schedule at equal F, B and W costs: (p-1)/m for GPipe and 1F1B,
// (p-1)/(v*m) interleaved, (p-1)/(3m) for ZB-H1 (its steady state: with m < p the ramps keep
// more, see the simulator).
/// Note [Bubble]'s formula for a schedule at equal F, B and W costs: (p-1)/m for GPipe and 1F1B,
/// (p-1)/(v*m) interleaved, (p-1)/(3m) for ZB-H1.
double bubble_formula(PipelineScheduleKind kind, int ranks, int microbatches, int chunks = 1);

/// Whether action i of a rank's list is a Send that Note [Paired exchanges] issues together with
/// action i + 1, a Recv from the same peer.
bool pairs_with_next(const std::vector<Action>& list, size_t i);

/// Runs every rank's list with `costs`: a compute action starts when its rank is free, a Recv when
/// its message was sent, a Send takes no time. `paired`: a Send that pairs_with_next also waits
/// until the peer has posted its matching Recv (Note [Paired exchanges]). Throws
/// Error{InvalidArgument} naming each rank's blocked action when no rank can progress (a deadlock,
/// or a Recv that no Send matches).
SimulatedRun simulate_schedule(const PipelineSchedule& schedule, const ActionCosts& costs = {},
                               bool paired = false);

/// Checks the lists against the rules of Note [Pipeline action lists]: each (stage, micro-batch)
/// has one Forward and one backward (Backward, or BackwardInput then BackwardWeight) on the rank
/// that owns the stage, after its Forward; each compute action's input was received before it and
/// its output sent right after it; every Send matches a Recv on the peer in the same order per
/// ordered pair of ranks; and the simulation finishes (no deadlock). Throws Error{InvalidArgument}
/// naming the first violation (rank, position, action).
void validate_schedule(const PipelineSchedule& schedule);

/// A 64-bit hash (FNV-1a) of the whole schedule: kind, p, m, v and every rank's list. run_pipeline
/// all-gathers it so that ranks handed different schedules stop with Error{Mismatch} rather than
/// exchange messages the others never expect.
uint64_t fingerprint(const PipelineSchedule& schedule);

/// Empty when the lists run without deadlock with paired exchanges (Note [Paired exchanges]), else
/// the simulator's message naming each rank's blocked action.
std::string paired_deadlock(const PipelineSchedule& schedule);

}  // namespace shardopt
