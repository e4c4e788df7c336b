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
//   - Communication actions: SendActivation after the Forward that produced it (towards stage
//     s+1), RecvActivation before the Forward that consumes it; SendGrad and RecvGrad likewise
//     around backward (towards stage s-1). GPipe, 1F1B and ZB-H1 put each message right next to
//     its compute; interleaved 1F1B places them as Megatron does (Note [Batched exchanges]).
//     There are no tags: the messages from one rank to another match in the order issued (Note
//     [Point-to-point messages]).
//   - Semantics the validator and the simulator assume and an executor must give: a Send never
//     blocks (isend; its Work is waited for before the step ends), a Recv blocks until its message
//     has arrived. Under these rules validate_schedule() proves the lists deadlock-free by running
//     them (simulate_schedule), so no timing can hang an executor that follows them.
//
// Note [Batched exchanges]: where a lone send and a lone receive queue on one stream (NCCL), two
// ranks sending to each other at once wait on each other; Megatron issues the messages between two
// compute passes as one batch_isend_irecv. Exchanges::Batched is that: each run of communication
// actions between two compute actions of a rank's list goes as one batch, which completes when
// every send in it has its receive posted on the peer and every receive in it has arrived
// (exchange_end() finds the run). Interleaved 1F1B needs Megatron's placement for it (the former
// pairing, a Send with the Recv right after it, deadlocks there with m > p: rank r waits for r+1
// to post a receive that comes after r+1's own pair, around the ring): compile_schedule lays it
// out in Megatron's iterations (forward_backward_pipelining_with_interleaving: warm-up iterations
// of one F, steady ones of F then B, cool-down ones of B), each iteration's sends (the F's
// activation and the B's gradient) in the batch after it; a receive goes in the receiver's batch
// of the same time, rank r's iteration t running at time t + r: the next F's and next B's inputs
// from the neighbours, and, across the ring (p-1 -> 0 forward, 0 -> p-1 backward), a tensor that
// waits a few iterations for its chunk (Megatron's recv_tensor_from_previous_stage). Every rank's
// batch then meets the peers' batches of the same time. simulate_schedule(s, costs, Batched)
// proves every compiled schedule deadlock-free so (GPipe, 1F1B and ZB-H1 as laid out before;
// interleaved for p 2-4, v 2-3, m p..4p in pipeline_tests); with unit costs GPipe, 1F1B and
// interleaved keep their Note [Bubble], ZB-H1 loses a little (p = 2, m = 4: makespan 14 against
// 13: a batch of one send waits for the peer's receive, listed after its weight pass). Batching
// only groups the messages: the computes, hence the results, are the same bitwise. The one owner
// of the choice is run_pipeline (PipelineRunOptions::batch_exchanges): Auto batches on NCCL, every
// schedule (one rule; the pairing it replaces could not run interleaved); Always batches on any
// engine (MPI, Gloo, threads: tests), Never issues each message alone.
/// How an executor issues a rank's messages (Note [Batched exchanges]).
enum class Exchanges {
  Separate,  ///< each Send an isend that never blocks, each Recv blocking alone (MPI, Gloo)
  Batched,   ///< each run of messages between two computes as one batch (NCCL: Megatron's way)
  Paired,    ///< a Send and the Recv right after it from the same peer as one batch: the former
             ///< NCCL mode, kept to show what Batched fixes (interleaved m > p deadlocks)
};
/// "separate", "batched" or "paired".
const char* to_string(Exchanges exchanges);

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
  int group = 1;          ///< interleaved: N micro-batches per group (Note [Micro-batch groups])
  std::vector<std::vector<Action>> actions;  ///< per rank, in execution order
  int stages() const { return ranks * chunks; }  ///< S = p * v, the model's stages
  /// The rank holding global stage `stage` (stage mod p).
  int rank_of(int stage) const { return stage % ranks; }
};

/// Compiles `kind` for p ranks, m micro-batches and v chunks per rank. Throws
/// Error{InvalidArgument} naming the rule on a bad combination: p, m, v >= 1; v > 1 only for
/// Interleaved1F1B (v >= 2 and p >= 2 there); ZB-H1 and the others take any m. Interleaved runs
/// the micro-batches through the chunks in groups of `group` (Megatron-core's
/// microbatch_group_size_per_vp_stage, Note [Micro-batch groups]); 0 picks
/// interleaved_group_size(p, m).
PipelineSchedule compile_schedule(PipelineScheduleKind kind, int ranks, int microbatches,
                                  int chunks = 1, int group = 0);

// Note [Micro-batch groups]: interleaved 1F1B runs micro-batches through a rank's chunks in groups
// of N consecutive ones (all chunk-0 forwards of a group, then its chunk-1 forwards, ...), the last
// group taking what remains. Megatron-core's rule (megatron/core/pipeline_parallel/schedules.py,
// forward_backward_pipelining_with_interleaving; N is microbatch_group_size_per_vp_stage, p by
// default): p <= N <= m, and the last group m % N is 0 or at least p (fewer would idle the
// pipeline waiting on itself). So m >= p is needed, and any such m has an N: N = p when p divides
// m (Megatron's default), else the smallest valid N above p (N = m always is).
/// Megatron-core's microbatch_group_size_per_vp_stage that compile_schedule picks for interleaved
/// at p ranks and m micro-batches (Note [Micro-batch groups]); throws Error{InvalidArgument}
/// naming the rule when m < p.
int interleaved_group_size(int ranks, int microbatches);

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
  /// Per rank: most micro-batch-chunks whose Forward ran and whose backward (Backward or
  /// BackwardWeight) had not.
  std::vector<int> peak_in_flight;
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

/// Whether action i of a rank's list is a Send that Exchanges::Paired issues together with action
/// i + 1, a Recv from the same peer.
bool pairs_with_next(const std::vector<Action>& list, size_t i);

/// The end of the run of communication actions that starts at `i` (the next compute action's
/// index, or the list's size): what Exchanges::Batched issues as one batch.
size_t exchange_end(const std::vector<Action>& list, size_t i);

/// Runs every rank's list with `costs`: a compute action starts when its rank is free, a Recv when
/// its message was sent, a Send takes no time. `exchanges` says what else a message waits for
/// (Note [Batched exchanges]): Batched, a batch ends when every send in it has its receive posted
/// on the peer and every receive in it has arrived; Paired, a Send that pairs_with_next waits
/// until the peer has posted its matching Recv. Throws Error{InvalidArgument} naming each rank's
/// blocked action when no rank can progress (a deadlock, or a Recv that no Send matches).
SimulatedRun simulate_schedule(const PipelineSchedule& schedule, const ActionCosts& costs = {},
                               Exchanges exchanges = Exchanges::Separate);

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

/// Empty when the lists run without deadlock under `exchanges` (Note [Batched exchanges]), else
/// the simulator's message naming each rank's blocked action.
std::string exchange_deadlock(const PipelineSchedule& schedule, Exchanges exchanges);

}  // namespace shardopt
