// Muon over flat shards (rules.hpp: Muon; torch.optim.Muon, torch >= 2.9): the momentum sharded
// like every rule's state, one owner rank per matrix for Newton-Schulz, the update exchanged with
// the owners, AdamW for the other parameters.
//
// Note [Muon over flat shards]
// torch.optim.Muon per 2-D parameter: buf.lerp_(g, 1 - momentum); u = g.lerp(buf, momentum)
// (nesterov) or buf; O = NS(u) (a copy of u in bfloat16, transposed when tall, divided by its
// norm, ns_steps quintic iterations); w *= 1 - lr·wd; w -= adjusted_lr · O. The momentum and u
// are elementwise, so the momentum stays in the flat state buffer like AdamW's moments, sharded
// at stages 1-3 (4 bytes per element in fp32); Newton-Schulz needs the whole matrix, so each
// Muon matrix has ONE owner rank, balanced by Newton-Schulz FLOPs (longest first onto the least
// loaded rank, ns_steps·(4m²n + 2m³) for m <= n: the same plan on every rank, recomputed only
// when the set of Muon matrices changes). A step:
//   1. every rank lerps the momentum of its pieces and casts its pieces of u to the Newton-Schulz
//      dtype (torch casts before Newton-Schulz, so this is the value torch orthogonalises);
//   2. sharded stages: each rank sends its pieces to the owners, one message per owner
//      (batch_isend_irecv); stage 0 holds whole matrices everywhere and sends nothing here;
//   3. each owner assembles its matrices and orthogonalises each once (StepStats::orthogonalized
//      counts them: their sum over the ranks is the number of Muon matrices);
//   4. each owner sends every rank the pieces of O that rank updates (stage 0: whole matrices),
//      in the Newton-Schulz dtype: the bytes are O's own, so the update is bitwise the owner's;
//   5. every rank applies decoupled weight decay and -adjusted_lr·O to its pieces (stage 3: into
//      its shard of the master weights).
// The other parameters run torch.optim.AdamW's single-tensor ops on their pieces (exp_avg in the
// first buffer, exp_avg_sq in the second; a Muon matrix leaves its second-buffer elements unused:
// 8 bytes per fp32 parameter, AdamW's, for one layout with checkpoints and resharding for free;
// state dicts convert to torch's per-optimizer names, muon_torch_state below).
// Traffic: a matrix of S elements split over N ranks moves (N-1)/N·S elements to its owner and as
// many back; in bfloat16 that is 4·S·(N-1)/N bytes over the world against AdamW's 8·S·(N-1)
// (reduce-scatter + all-gather of fp32, every rank), so 1 + 1/(2N) of AdamW's bytes at stages
// 1-2 (1.25x at N = 2), less at stage 3 (gathers in forward and backward), and 1.25x at stage 0
// (the owner broadcasts 2·S bytes to N-1 ranks against an all-reduce's 8·S·(N-1)/N per rank).
// Messages need point-to-point sends: hybrid sharding (whose communicator has none) is refused.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/flat_state.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/optimizer_types.hpp"
#include "shardopt/rules.hpp"

namespace shardopt::detail {

// The Newton-Schulz dtype of `rule` (ns_dtype 16, 32, 64).
at::ScalarType muon_ns_dtype(const Muon& rule);
// torch.optim.Muon's _zeropower_via_newtonschulz on `x`, a contiguous rows x cols matrix already
// in the Newton-Schulz dtype (torch's copy: it is normalised in place); the same op sequence, so
// the same values as torch's on the same ATen. The result has x's shape and dtype.
at::Tensor newton_schulz(at::Tensor x, const Muon& rule);
// torch.optim.Muon's _adjust_lr for a rows x cols matrix.
double muon_adjusted_lr(const Muon& rule, int64_t rows, int64_t cols);
// The owner of each matrix, balanced by Newton-Schulz FLOPs over `ranks` (`cost[i]` < 0: not a
// Muon matrix, owner -1). Deterministic: every rank computes the same plan.
std::vector<int> muon_owners(const std::vector<double>& cost, int ranks);
// ns_steps·(4m²n + 2m³), m <= n: the FLOPs (/2) of Newton-Schulz on a rows x cols matrix.
double muon_cost(const Muon& rule, int64_t rows, int64_t cols);

// State dicts: torch.optim.Muon keeps {"momentum_buffer"} per matrix, torch.optim.AdamW
// {"exp_avg", "exp_avg_sq"} per other parameter; the flat buffers hold them as
// {"momentum_buffer", "exp_avg_sq"} for every parameter (Note [Muon over flat shards]).
// `muon`: the parameter runs Muon (2-D, its group's use_muon).
std::map<std::string, at::Tensor> muon_torch_state(std::map<std::string, at::Tensor> flat,
                                                   bool muon);
// The inverse (checked: names and shapes; a matrix's unused exp_avg_sq elements become zero).
std::map<std::string, at::Tensor> muon_flat_state(const std::map<std::string, at::Tensor>& state,
                                                  bool muon, const std::vector<int64_t>& shape,
                                                  const std::string& name,
                                                  const at::TensorOptions& options);

class MuonUpdate {
 public:
  using RuleOf = std::function<const Rule&(int group)>;
  // `shapes`: each layout slot's parameter shape. CPU master weights of float32 or float64.
  MuonUpdate(FlatState& flat, CommunicatorPtr comm, Duration timeout, RuleOf rule_of,
             const std::vector<std::vector<int64_t>>& shapes);
  // Optimizer step number `step` (1-based) over this rank's segments; counters into `stats`.
  void update(int64_t step, StepStats* stats);

 private:
  // One parameter's intersection with one of this rank's segments.
  struct Piece {
    int segment;
    int64_t begin, length, first;  // in the segment; `first`: the parameter's element offset
  };
  struct Range {
    int64_t first, length;  // parameter elements
  };
  const Muon& rule_of(int slot) const;
  void plan(const std::vector<char>& muon);
  void adamw(int slot, const Piece& pc, int64_t step);

  FlatState& flat_;
  CommunicatorPtr comm_;
  Duration timeout_;
  RuleOf rule_of_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int> group_;                               // per slot
  std::vector<std::vector<Piece>> pieces_;               // per slot: this rank's, in order
  std::vector<std::vector<std::vector<Range>>> held_;    // per slot, per rank: what it updates
  std::vector<char> muon_;                               // per slot, of the current plan
  std::vector<int> owner_;                               // per slot (-1: AdamW)
  bool planned_ = false;
};

}  // namespace shardopt::detail
