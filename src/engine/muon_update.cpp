// Muon over this rank's segments: Note [Muon over flat shards] (muon_update.hpp).
#include "engine/muon_update.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "shardopt/error.hpp"

namespace shardopt::detail {

at::ScalarType muon_ns_dtype(const Muon& rule) {
  if (rule.ns_dtype() == 64) return at::kDouble;
  if (rule.ns_dtype() == 32) return at::kFloat;
  return at::kBFloat16;
}

at::Tensor newton_schulz(at::Tensor x, const Muon& rule) {
  // torch/optim/_muon.py, op for op (the scalars as Python passes them: doubles).
  const bool tall = x.size(0) > x.size(1);
  if (tall) x = x.t();
  x.div_(at::linalg_vector_norm(x, 2).clamp(c10::optional<at::Scalar>(rule.eps())));
  const int steps = static_cast<int>(rule.ns_steps());
  for (int k = 0; k < steps; ++k) {
    at::Tensor gram = at::matmul(x, x.t());
    at::Tensor gram_update = at::addmm(gram, gram, gram, rule.ns_b(), rule.ns_c());
    x = at::addmm(x, gram_update, x, rule.ns_a());
  }
  if (tall) x = x.t();
  return x;
}

double muon_adjusted_lr(const Muon& rule, int64_t rows, int64_t cols) {
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  double ratio = 1.0;
  if (rule.adjust_lr_fn() == Muon::kOriginal) {
    ratio = std::sqrt(std::max(1.0, a / b));
  } else if (rule.adjust_lr_fn() == Muon::kMatchRmsAdamW) {
    ratio = 0.2 * std::sqrt(std::max(a, b));
  } else if (rule.adjust_lr_fn() == Muon::kSpectralUnclamped) {
    ratio = std::sqrt(a / b);
  }
  return rule.lr() * ratio;
}

double muon_cost(const Muon& rule, int64_t rows, int64_t cols) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  return rule.ns_steps() * (4 * m * m * n + 2 * m * m * m);
}

std::vector<int> muon_owners(const std::vector<double>& cost, int ranks) {
  std::vector<int> owner(cost.size(), -1);
  std::vector<int> order;
  for (size_t i = 0; i < cost.size(); ++i) {
    if (cost[i] >= 0) order.push_back(static_cast<int>(i));
  }
  // Longest first onto the least loaded rank (ties: the lower index, the lower rank).
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost[a] > cost[b]; });
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  for (int i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = r;
    load[r] += cost[i];
  }
  return owner;
}

std::map<std::string, at::Tensor> muon_torch_state(std::map<std::string, at::Tensor> flat,
                                                   bool muon) {
  if (flat.empty()) return flat;
  if (muon) return {{"momentum_buffer", flat.at("momentum_buffer")}};
  return {{"exp_avg", flat.at("momentum_buffer")}, {"exp_avg_sq", flat.at("exp_avg_sq")}};
}

std::map<std::string, at::Tensor> muon_flat_state(const std::map<std::string, at::Tensor>& state,
                                                  bool muon, const std::vector<int64_t>& shape,
                                                  const std::string& name,
                                                  const at::TensorOptions& options) {
  if (state.empty()) return {};
  const std::vector<std::string> want =
      muon ? std::vector<std::string>{"momentum_buffer"}
           : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  for (const auto& [key, tensor] : state) {
    SHARDOPT_CHECK(std::find(want.begin(), want.end(), key) != want.end(), Mismatch,
                   "optimizer: the state dict holds '{}' for parameter '{}', but muon keeps [{}] "
                   "for it ({})",
                   key, name, fmt::join(want, ", "),
                   muon ? "a matrix running Muon" : "a parameter running AdamW");
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& key : want) {
    auto it = state.find(key);
    SHARDOPT_CHECK(it != state.end() && it->second.defined() &&
                       it->second.sizes().vec() == shape,
                   Mismatch,
                   "optimizer: the state dict's '{}' of parameter '{}' is missing or not of the "
                   "parameter's shape [{}] (muon keeps [{}] for {})",
                   key, name, fmt::join(shape, ", "), fmt::join(want, ", "),
                   muon ? "a matrix running Muon" : "a parameter running AdamW");
  }
  if (muon) {
    out["momentum_buffer"] = state.at("momentum_buffer").to(options).clone();
    out["exp_avg_sq"] = at::zeros(shape, options);
  } else {
    out["momentum_buffer"] = state.at("exp_avg").to(options).clone();
    out["exp_avg_sq"] = state.at("exp_avg_sq").to(options).clone();
  }
  return out;
}

MuonUpdate::MuonUpdate(FlatState& flat, CommunicatorPtr comm, Duration timeout, RuleOf rule_of,
                       const std::vector<std::vector<int64_t>>& shapes)
    : flat_(flat), comm_(std::move(comm)), timeout_(timeout), rule_of_(std::move(rule_of)),
      shapes_(shapes) {
  const auto dtype = flat_.master_options().dtype().toScalarType();
  SHARDOPT_CHECK(flat_.master_options().device().is_cpu(), Unsupported,
                 "optimizer: muon steps parameters in CPU memory only for now, got the master "
                 "weights on {}; use adamw or lamb on this device",
                 flat_.master_options().device().str());
  SHARDOPT_CHECK(dtype == at::kFloat || dtype == at::kDouble, Unsupported,
                 "optimizer: muon steps float32 or float64 weights, got {} (mixed precision keeps "
                 "float32 master weights)",
                 c10::toString(dtype));
  const FlatLayout& layout = flat_.layout();
  SHARDOPT_INTERNAL_ASSERT(shapes_.size() == layout.slots.size(), "muon: {} shapes for {} parameters",
                           shapes_.size(), layout.slots.size());
  const int ranks = comm_->size();
  pieces_.resize(shapes_.size());
  held_.assign(shapes_.size(), std::vector<std::vector<Range>>(static_cast<size_t>(ranks)));
  for (size_t i = 0; i < layout.slots.size(); ++i) {
    group_.push_back(layout.buckets[layout.slots[i].bucket].group);
    for (const ParamPiece* p = layout.pieces_begin(static_cast<int>(i));
         p != layout.pieces_end(static_cast<int>(i)); ++p) {
      const BucketLayout& bl = layout.buckets[p->bucket];
      for (int r = 0; r < ranks; ++r) {
        const ShardRange whole{p->offset, p->offset + p->numel};
        const ShardRange x = flat_.plan().sharded() ? intersect(bl.owned(r), whole) : whole;
        if (!x.empty()) held_[i][r].push_back({p->param_offset + (x.begin - p->offset), x.size()});
      }
    }
  }
  const auto& segments = flat_.segments();
  for (size_t k = 0; k < segments.size(); ++k) {
    for_each_param_piece(layout, segments[k],
                         [&](int idx, int64_t begin, int64_t len, int64_t first) {
                           pieces_[idx].push_back({static_cast<int>(k), begin, len, first});
                         });
  }
  for (size_t i = 0; i < pieces_.size(); ++i) {
    auto& p = pieces_[i];
    std::sort(p.begin(), p.end(), [](const Piece& a, const Piece& b) { return a.first < b.first; });
    // The pieces every rank derives for this rank are the ones its segments hold.
    const auto& mine = held_[i][comm_->rank()];
    bool same = mine.size() == p.size();
    for (size_t k = 0; same && k < p.size(); ++k) {
      same = mine[k].first == p[k].first && mine[k].length == p[k].length;
    }
    SHARDOPT_INTERNAL_ASSERT(same, "muon: parameter {}: {} pieces in the segments, {} derived", i,
                             p.size(), mine.size());
  }
}

const Muon& MuonUpdate::rule_of(int slot) const { return std::get<Muon>(rule_of_(group_[slot])); }

void MuonUpdate::plan(const std::vector<char>& muon) {
  std::vector<double> cost(shapes_.size(), -1.0);
  for (size_t i = 0; i < shapes_.size(); ++i) {
    if (muon[i]) cost[i] = muon_cost(rule_of(static_cast<int>(i)), shapes_[i][0], shapes_[i][1]);
  }
  owner_ = muon_owners(cost, comm_->size());
  muon_ = muon;
  planned_ = true;
}

// torch.optim.AdamW's single-tensor step (torch/optim/adam.py, decoupled weight decay) on a piece.
void MuonUpdate::adamw(int slot, const Piece& pc, int64_t step) {
  const Muon& r = rule_of(slot);
  Segment& s = flat_.segments()[pc.segment];
  at::Tensor p = s.param.narrow(0, pc.begin, pc.length);
  at::Tensor g = s.grad.narrow(0, pc.begin, pc.length);
  at::Tensor m = flat_.state()[0].narrow(0, s.state_offset + pc.begin, pc.length);
  at::Tensor v = flat_.state()[1].narrow(0, s.state_offset + pc.begin, pc.length);
  const double beta1 = r.adamw_beta1(), beta2 = r.adamw_beta2();
  if (r.weight_decay() != 0) p.mul_(1 - r.lr() * r.weight_decay());
  m.lerp_(g, 1 - beta1);
  v.mul_(beta2).addcmul_(g, g, 1 - beta2);
  const double steps = static_cast<double>(step);
  const double bias_correction1 = 1 - std::pow(beta1, steps);
  const double bias_correction2 = 1 - std::pow(beta2, steps);
  const double step_size = r.lr() / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  at::Tensor denom = (v.sqrt() / bias_correction2_sqrt).add_(r.adamw_eps());
  p.addcdiv_(m, denom, -step_size);
}

void MuonUpdate::update(int64_t step, StepStats* stats) {
  using Clock = std::chrono::steady_clock;
  const size_t params = shapes_.size();
  const int me = comm_->rank(), ranks = comm_->size();
  const bool sharded = flat_.plan().sharded() && ranks > 1;
  auto& segments = flat_.segments();
  at::Tensor& momentum = flat_.state()[0];

  // Which parameters run Muon this step, by their groups' rules (which LR schedulers and
  // set_group_rule may change); every rank sees the same rules.
  std::vector<char> muon(params, 0);
  at::ScalarType ns = at::kBFloat16;
  bool first = true;
  int checked = -1;  // the last group checked (slots are grouped by group)
  for (size_t i = 0; i < params; ++i) {
    const Muon& r = rule_of(static_cast<int>(i));
    if (group_[i] != checked) {
      const std::string problem = r.problem();
      SHARDOPT_CHECK(problem.empty(), InvalidArgument, "optimizer: muon (parameter group {}): {}",
                     group_[i], problem);
      checked = group_[i];
    }
    muon[i] = shapes_[i].size() == 2 && r.use_muon();
    if (!muon[i]) continue;
    SHARDOPT_CHECK(first || muon_ns_dtype(r) == ns, InvalidArgument,
                   "optimizer: muon's parameter groups must share one ns_dtype (the update "
                   "exchange carries one dtype); group {} has {}",
                   group_[i], r.ns_dtype());
    ns = muon_ns_dtype(r);
    first = false;
  }
  if (!planned_ || muon != muon_) plan(muon);

  // 1. Momentum and the (Nesterov) update of this rank's pieces, in the Newton-Schulz dtype;
  //    the other parameters' AdamW step.
  std::vector<at::Tensor> whole(params);  // the matrices this rank owns, assembled
  std::vector<std::vector<at::Tensor>> to_owner(static_cast<size_t>(ranks));
  for (size_t i = 0; i < params; ++i) {
    const int idx = static_cast<int>(i);
    if (!muon[i]) {
      for (const Piece& pc : pieces_[i]) adamw(idx, pc, step);
      continue;
    }
    const Muon& r = rule_of(idx);
    const bool owned = owner_[i] == me;
    if (owned) whole[i] = at::empty({shapes_[i][0], shapes_[i][1]}, at::TensorOptions(ns));
    for (const Piece& pc : pieces_[i]) {
      Segment& s = segments[pc.segment];
      at::Tensor g = s.grad.narrow(0, pc.begin, pc.length);
      at::Tensor buf = momentum.narrow(0, s.state_offset + pc.begin, pc.length);
      buf.lerp_(g, 1 - r.momentum());
      if (!owned && !sharded) continue;  // stage 0: the owner holds the whole matrix already
      at::Tensor u = r.nesterov() ? g.lerp(buf, r.momentum()) : buf;
      if (owned) {
        whole[i].view({-1}).narrow(0, pc.first, pc.length).copy_(u);
      } else {
        to_owner[owner_[i]].push_back(u.to(ns));
      }
    }
  }

  // Calls fn(slot, range) over the ranges rank `holder` updates of the matrices rank `owner`
  // owns, in the order both sides pack and unpack messages.
  auto each_range = [&](int owner, int holder, auto&& fn) {
    for (size_t i = 0; i < params; ++i) {
      if (!muon[i] || owner_[i] != owner) continue;
      for (const Range& range : held_[i][holder]) fn(static_cast<int>(i), range);
    }
  };
  auto message_numel = [&](int owner, int holder) {
    int64_t n = 0;
    each_range(owner, holder, [&](int, const Range& range) { n += range.length; });
    return n;
  };
  int64_t sent_bytes = 0;
  auto exchange = [&](std::vector<P2pOp>& ops) {
    for (const auto& op : ops) {
      if (op.kind == P2pOp::Kind::Send) sent_bytes += op.tensor.numel() * op.tensor.element_size();
    }
    if (!ops.empty()) comm_->batch_isend_irecv(ops)->wait(timeout_);
  };

  // 2. Sharded: the pieces travel to their owners.
  if (sharded) {
    std::vector<P2pOp> ops;
    std::vector<at::Tensor> inbox(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      if (r == me) continue;
      if (!to_owner[r].empty()) ops.push_back(P2pOp::send(at::cat(to_owner[r]), r));
      const int64_t n = message_numel(me, r);
      if (n > 0) {
        inbox[r] = at::empty({n}, at::TensorOptions(ns));
        ops.push_back(P2pOp::recv(inbox[r], r));
      }
    }
    exchange(ops);
    for (int r = 0; r < ranks; ++r) {
      if (!inbox[r].defined()) continue;
      int64_t at = 0;
      each_range(me, r, [&](int i, const Range& range) {
        whole[i].view({-1}).narrow(0, range.first, range.length)
            .copy_(inbox[r].narrow(0, at, range.length));
        at += range.length;
      });
    }
  }

  // 3. Newton-Schulz, once per matrix, on its owner.
  const auto t = Clock::now();
  int64_t orthogonalized = 0;
  for (size_t i = 0; i < params; ++i) {
    if (!whole[i].defined()) continue;
    whole[i] = newton_schulz(whole[i], rule_of(static_cast<int>(i))).contiguous();
    ++orthogonalized;
  }
  const double ns_s = std::chrono::duration<double>(Clock::now() - t).count();

  // 4. Each rank's pieces of the result from the owners.
  std::vector<at::Tensor> from_owner(static_cast<size_t>(ranks));
  if (ranks > 1) {
    std::vector<P2pOp> ops;
    for (int r = 0; r < ranks; ++r) {
      if (r == me) continue;
      std::vector<at::Tensor> parts;
      each_range(me, r, [&](int i, const Range& range) {
        parts.push_back(whole[i].view({-1}).narrow(0, range.first, range.length));
      });
      if (!parts.empty()) ops.push_back(P2pOp::send(at::cat(parts), r));
      const int64_t n = message_numel(r, me);
      if (n > 0) {
        from_owner[r] = at::empty({n}, at::TensorOptions(ns));
        ops.push_back(P2pOp::recv(from_owner[r], r));
      }
    }
    exchange(ops);
  }

  // 5. Weight decay and the orthogonalised update into this rank's pieces.
  std::vector<int64_t> read(static_cast<size_t>(ranks), 0);  // per owner: consumed elements
  for (size_t i = 0; i < params; ++i) {
    if (!muon[i]) continue;
    const Muon& r = rule_of(static_cast<int>(i));
    const double adjusted_lr = muon_adjusted_lr(r, shapes_[i][0], shapes_[i][1]);
    const int o = owner_[i];
    for (const Piece& pc : pieces_[i]) {
      at::Tensor update;
      if (o == me) {
        update = whole[i].view({-1}).narrow(0, pc.first, pc.length);
      } else {
        update = from_owner[o].narrow(0, read[o], pc.length);
        read[o] += pc.length;
      }
      at::Tensor p = segments[pc.segment].param.narrow(0, pc.begin, pc.length);
      p.mul_(1 - r.lr() * r.weight_decay());
      p.add_(update, -adjusted_lr);
    }
  }
  if (stats) {
    stats->orthogonalized = orthogonalized;
    stats->exchange_bytes = sent_bytes;
    stats->orthogonalize_s = ns_s;
  }
}

}  // namespace shardopt::detail
