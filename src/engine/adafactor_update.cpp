// Adafactor over this rank's segments: Note [Factored state in flat shards] (adafactor_update.hpp).
#include "engine/adafactor_update.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "shardopt/error.hpp"

namespace shardopt::detail {

FactoredLayout factored_layout(const std::vector<int64_t>& shape) {
  FactoredLayout f;
  const size_t dims = shape.size();
  if (dims < 2) return f;
  f.factored = true;
  for (size_t k = 0; k + 2 < dims; ++k) f.batches *= shape[k];
  f.rows = shape[dims - 2];
  f.cols = shape[dims - 1];
  // Both factors fit when m, n >= 2; otherwise the one with a single value per batch is derived.
  f.row_stored = f.cols == 1 || f.rows >= 2;
  f.col_stored = f.cols >= 2;
  return f;
}

namespace {

std::vector<int64_t> with_dim(std::vector<int64_t> shape, size_t from_end, int64_t size) {
  shape[shape.size() - from_end] = size;
  return shape;
}

// torch's Tensor.lerp_ with a scalar weight.
double lerp(double self, double end, double weight) {
  return weight < 0.5 ? self + weight * (end - self) : end - (end - self) * (1 - weight);
}

// Calls fn(k, row, col, count, batch) for each run of `length` consecutive elements of a factored
// parameter, starting at element `first`, that stays within one row: k is the run's first
// element relative to `first`, row and col its row and column factor indices (the columns of a
// run are consecutive), batch its batch. Inner loops over a run are contiguous.
template <typename Fn>
void for_each_row_run(const FactoredLayout& f, int64_t first, int64_t length, Fn&& fn) {
  int64_t k = 0;
  while (k < length) {
    const int64_t o = first + k;
    const int64_t b = o / (f.rows * f.cols), i = (o / f.cols) % f.rows, j = o % f.cols;
    const int64_t count = std::min(f.cols - j, length - k);
    fn(k, b * f.rows + i, b * f.cols + j, count, b);
    k += count;
  }
}

// The full factors of one parameter this step, in the master dtype (as torch keeps them).
template <typename T>
struct Factors {
  std::vector<T> row, col, row_mean;  // row_mean: per batch, clamped at eps1
};

// Calls fn(o, k) for the elements o of [begin, end) (parameter offsets) that fall within the
// parameter piece starting at `first` of length `len` (k: its index within the piece).
template <typename Fn>
void overlap(int64_t begin, int64_t end, int64_t first, int64_t len, Fn&& fn) {
  const int64_t lo = std::max(begin, first), hi = std::min(end, first + len);
  for (int64_t o = lo; o < hi; ++o) fn(o, o - first);
}

}  // namespace

std::map<std::string, at::Tensor> adafactor_torch_state(const at::Tensor& packed) {
  const std::vector<int64_t> shape = packed.sizes().vec();
  const FactoredLayout f = factored_layout(shape);
  if (!f.factored) return {{"variance", packed.clone()}};
  if (packed.numel() == 0) {  // torch's factors of an empty matrix: zeros, possibly not empty
    return {{"row_var", at::zeros(with_dim(shape, 1, 1), packed.options())},
            {"col_var", at::zeros(with_dim(shape, 2, 1), packed.options())}};
  }
  const at::Tensor flat = packed.reshape({-1});
  at::Tensor row = f.row_stored ? flat.narrow(0, 0, f.row_numel()).clone() : at::Tensor();
  at::Tensor col = f.col_stored ? flat.narrow(0, f.col_at(), f.col_numel()).clone() : at::Tensor();
  // A factor of one value per batch is the mean of the other (Note [Factored state in flat shards]).
  if (!row.defined()) row = col.view({f.batches, f.cols}).mean(1);
  if (!col.defined()) col = row.view({f.batches, f.rows}).mean(1);
  return {{"row_var", row.reshape(with_dim(shape, 1, 1))},
          {"col_var", col.reshape(with_dim(shape, 2, 1))}};
}

at::Tensor adafactor_packed_state(const std::map<std::string, at::Tensor>& state,
                                  const std::vector<int64_t>& shape, const std::string& name,
                                  const at::TensorOptions& options) {
  const FactoredLayout f = factored_layout(shape);
  auto get = [&](const char* key, const std::vector<int64_t>& want) {
    auto it = state.find(key);
    SHARDOPT_CHECK(it != state.end(), Mismatch,
                   "optimizer: the state dict has no '{}' for parameter '{}' (adafactor keeps {} "
                   "for a tensor of {} dimensions)",
                   key, name, f.factored ? "row_var and col_var" : "variance", shape.size());
    SHARDOPT_CHECK(it->second.defined() && it->second.sizes().vec() == want, Mismatch,
                   "optimizer: the state dict's '{}' of parameter '{}' has shape [{}], expected "
                   "[{}]",
                   key, name,
                   it->second.defined() ? fmt::format("{}", fmt::join(it->second.sizes(), ", "))
                                        : std::string("undefined"),
                   fmt::join(want, ", "));
    return it->second;
  };
  for (const auto& [key, tensor] : state) {
    const bool known = f.factored ? (key == "row_var" || key == "col_var") : key == "variance";
    SHARDOPT_CHECK(known, Mismatch,
                   "optimizer: the state dict holds '{}' for parameter '{}', but adafactor keeps "
                   "[{}] for a tensor of {} dimensions",
                   key, name, f.factored ? "row_var, col_var" : "variance", shape.size());
  }
  if (!f.factored) return get("variance", shape).to(options).clone();
  const at::Tensor row = get("row_var", with_dim(shape, 1, 1));
  const at::Tensor col = get("col_var", with_dim(shape, 2, 1));
  at::Tensor packed = at::zeros(shape, options);
  if (packed.numel() == 0) return packed;
  at::Tensor flat = packed.view({-1});
  if (f.row_stored) flat.narrow(0, 0, f.row_numel()).copy_(row.reshape({-1}));
  if (f.col_stored) flat.narrow(0, f.col_at(), f.col_numel()).copy_(col.reshape({-1}));
  return packed;
}

AdafactorUpdate::AdafactorUpdate(FlatState& flat, CommunicatorPtr comm, Duration timeout,
                                 RuleOf rule_of, const std::vector<std::vector<int64_t>>& shapes)
    : flat_(flat), comm_(std::move(comm)), timeout_(timeout), rule_of_(std::move(rule_of)) {
  const auto dtype = flat_.master_options().dtype().toScalarType();
  SHARDOPT_CHECK(flat_.master_options().device().is_cpu(), Unsupported,
                 "optimizer: adafactor steps parameters in CPU memory only for now, got the "
                 "master weights on {}; use adamw or lamb on this device",
                 flat_.master_options().device().str());
  SHARDOPT_CHECK(dtype == at::kFloat || dtype == at::kDouble, Unsupported,
                 "optimizer: adafactor steps float32 or float64 weights, got {} (mixed precision "
                 "keeps float32 master weights)",
                 c10::toString(dtype));
  SHARDOPT_INTERNAL_ASSERT(shapes.size() == flat_.layout().slots.size(),
                           "adafactor: {} shapes for {} parameters", shapes.size(),
                           flat_.layout().slots.size());
  for (const auto& shape : shapes) {
    const FactoredLayout f = factored_layout(shape);
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    layouts_.push_back(f);
    numel_.push_back(numel);
    stats_at_.push_back(stats_numel_);
    // The weights' sum of squares, then (matrices) row and column sums of g², stored factors.
    stats_numel_ += 1 + (f.factored ? 2 * (f.row_numel() + f.col_numel()) : 0);
  }
  pieces_.resize(shapes.size());
  const auto& segments = flat_.segments();
  for (size_t k = 0; k < segments.size(); ++k) {
    for_each_param_piece(flat_.layout(), segments[k],
                         [&](int idx, int64_t begin, int64_t len, int64_t first) {
                           pieces_[idx].push_back({static_cast<int>(k), begin, len, first});
                         });
  }
  for (size_t idx = 0; idx < pieces_.size(); ++idx) {
    if (!pieces_[idx].empty()) touched_.push_back(static_cast<int>(idx));
  }
}

void AdafactorUpdate::update(int64_t step) {
  if (flat_.master_options().dtype() == at::kDouble) {
    update_typed<double>(step);
  } else {
    update_typed<float>(step);
  }
}

template <typename T>
void AdafactorUpdate::update_typed(int64_t step) {
  const size_t params = layouts_.size();
  auto& segments = flat_.segments();
  at::Tensor& state = flat_.state()[0];
  at::Tensor stats = at::zeros({stats_numel_}, at::kDouble);
  at::Tensor update_sq = at::zeros({static_cast<int64_t>(params)}, at::kDouble);
  double* acc = stats.data_ptr<double>();
  double* usq = update_sq.data_ptr<double>();
  const bool sharded = flat_.plan().sharded();
  const double steps = static_cast<double>(step);
  // Runs fn(idx) for every parameter this rank holds a piece of, parameters in parallel.
  auto each_param = [&](auto&& fn) {
    at::parallel_for(0, static_cast<int64_t>(touched_.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) fn(touched_[t]);
    });
  };
  auto rule_of = [&](int idx) -> const Adafactor& {
    return std::get<Adafactor>(rule_of_(segments[pieces_[idx].front().segment].group));
  };

  // 1. Partial sums: the weights' squares, g² by row and by column, the stored factors.
  each_param([&](int idx) {
    double* a = acc + stats_at_[idx];
    const FactoredLayout& f = layouts_[idx];
    for (const Piece& pc : pieces_[idx]) {
      Segment& s = segments[pc.segment];
      const T* p = s.param.template data_ptr<T>() + pc.begin;
      const T* g = s.grad.template data_ptr<T>() + pc.begin;
      const T* st = state.template data_ptr<T>() + s.state_offset + pc.begin;
      double sq = 0;
      for (int64_t k = 0; k < pc.length; ++k) sq += static_cast<double>(p[k]) * p[k];
      a[0] += sq;
      if (!f.factored) continue;
      double* row_sum = a + 1;
      double* col_sum = row_sum + f.row_numel();
      double* row_old = col_sum + f.col_numel();
      double* col_old = row_old + f.row_numel();
      for_each_row_run(f, pc.first, pc.length,
                       [&](int64_t k0, int64_t row, int64_t col, int64_t count, int64_t) {
                         double in_row = 0;
                         double* cols = col_sum + col;
                         for (int64_t t = 0; t < count; ++t) {
                           const double gv = g[k0 + t];
                           in_row += gv * gv;
                           cols[t] += gv * gv;
                         }
                         row_sum[row] += in_row;
                       });
      if (f.row_stored) {
        overlap(0, f.row_numel(), pc.first, pc.length,
                [&](int64_t o, int64_t k) { row_old[o] = st[k]; });
      }
      if (f.col_stored) {
        overlap(f.col_at(), f.col_at() + f.col_numel(), pc.first, pc.length,
                [&](int64_t o, int64_t k) { col_old[o - f.col_at()] = st[k]; });
      }
    }
  });
  if (sharded) comm_->all_reduce(stats, ReduceOp::Sum, true)->wait(timeout_);

  // 2. The full factors of every parameter this rank holds a piece of, then its pieces' update.
  std::vector<Factors<T>> factors(params);
  auto eps1_of = [](const Adafactor& r) {
    return r.eps1() < 0 ? std::numeric_limits<T>::epsilon() : static_cast<T>(r.eps1());
  };
  auto make_factors = [&](int idx, const Adafactor& r) {
    Factors<T>& out = factors[idx];
    const FactoredLayout& f = layouts_[idx];
    const double w = std::pow(steps, r.beta2_decay());
    const double* a = acc + stats_at_[idx];
    const double* row_sum = a + 1;
    const double* col_sum = row_sum + f.row_numel();
    const double* row_old = col_sum + f.col_numel();
    const double* col_old = row_old + f.row_numel();
    out.row.assign(f.row_numel(), 0.0);
    out.col.assign(f.col_numel(), 0.0);
    if (f.row_stored) {
      for (int64_t x = 0; x < f.row_numel(); ++x) {
        out.row[x] = static_cast<T>(lerp(row_old[x], static_cast<T>(row_sum[x] / f.cols), w));
      }
    }
    if (f.col_stored) {
      for (int64_t x = 0; x < f.col_numel(); ++x) {
        out.col[x] = static_cast<T>(lerp(col_old[x], static_cast<T>(col_sum[x] / f.rows), w));
      }
    }
    auto batch_mean = [](const std::vector<T>& v, int64_t b, int64_t n) {
      double sum = 0;
      for (int64_t x = 0; x < n; ++x) sum += v[b * n + x];
      return static_cast<T>(sum / static_cast<double>(n));
    };
    out.row_mean.resize(f.batches);
    for (int64_t b = 0; b < f.batches; ++b) {
      if (!f.row_stored) out.row[b] = batch_mean(out.col, b, f.cols);  // rows == 1
      if (!f.col_stored) out.col[b] = batch_mean(out.row, b, f.rows);  // cols == 1
    }
    for (int64_t b = 0; b < f.batches; ++b) {
      out.row_mean[b] = std::max<T>(batch_mean(out.row, b, f.rows), eps1_of(r));
    }
  };
  // Calls emit(k, u) with the update u of each element k of the piece; `first_pass` advances the
  // vectors' variance and writes the stored factors (the second pass reads them again).
  auto piece_updates = [&](const Piece& pc, const Adafactor& r, int idx, bool first_pass,
                           auto&& emit) {
    Segment& s = segments[pc.segment];
    const T* g = s.grad.template data_ptr<T>() + pc.begin;
    T* st = state.template data_ptr<T>() + s.state_offset + pc.begin;
    const T eps1 = eps1_of(r);
    const T floor = static_cast<T>(static_cast<double>(eps1) * static_cast<double>(eps1));
    const T sign = r.maximize() ? T(-1) : T(1);
    const FactoredLayout& f = layouts_[idx];
    if (!f.factored) {
      const double w = std::pow(steps, r.beta2_decay());
      for (int64_t k = 0; k < pc.length; ++k) {
        const T gv = sign * g[k];
        if (first_pass) st[k] = static_cast<T>(lerp(st[k], static_cast<T>(gv * gv), w));
        emit(k, static_cast<T>(T(1) / std::sqrt(std::max(st[k], floor))) * gv);
      }
      return;
    }
    const Factors<T>& fa = factors[idx];
    for_each_row_run(f, pc.first, pc.length,
                     [&](int64_t k0, int64_t row, int64_t col, int64_t count, int64_t b) {
                       const T rv = fa.row[row], mean = fa.row_mean[b];
                       const T* cols = fa.col.data() + col;
                       for (int64_t t = 0; t < count; ++t) {
                         const T gv = sign * g[k0 + t];
                         const T v = std::max(static_cast<T>(rv * cols[t] / mean), floor);
                         emit(k0 + t, static_cast<T>(T(1) / std::sqrt(v)) * gv);
                       }
                     });
    if (!first_pass) return;
    if (f.row_stored) {
      overlap(0, f.row_numel(), pc.first, pc.length,
              [&](int64_t o, int64_t k) { st[k] = static_cast<T>(fa.row[o]); });
    }
    if (f.col_stored) {
      overlap(f.col_at(), f.col_at() + f.col_numel(), pc.first, pc.length,
              [&](int64_t o, int64_t k) { st[k] = static_cast<T>(fa.col[o - f.col_at()]); });
    }
  };
  each_param([&](int idx) {
    const Adafactor& r = rule_of(idx);
    if (layouts_[idx].factored) make_factors(idx, r);
    double sq = 0;
    for (const Piece& pc : pieces_[idx]) {
      piece_updates(pc, r, idx, true, [&](int64_t, T u) { sq += static_cast<double>(u) * u; });
    }
    usq[idx] = sq;
  });
  if (sharded) comm_->all_reduce(update_sq, ReduceOp::Sum, true)->wait(timeout_);

  // 3. The weights: decoupled decay, then the update scaled by alpha and clipped by its RMS.
  each_param([&](int idx) {
    const Adafactor& r = rule_of(idx);
    const T decay = static_cast<T>(1 - r.lr() * r.weight_decay());
    const double root_numel = std::sqrt(static_cast<double>(numel_[idx]));
    const double rho = std::min(r.lr(), 1 / std::sqrt(steps));
    const double alpha = std::max(r.eps2(), std::sqrt(acc[stats_at_[idx]]) / root_numel) * rho;
    const double denom = std::max(1.0, std::sqrt(usq[idx]) / (root_numel * r.d()));
    const T coef = static_cast<T>(-alpha / denom);
    for (const Piece& pc : pieces_[idx]) {
      T* w = segments[pc.segment].param.template data_ptr<T>() + pc.begin;
      piece_updates(pc, r, idx, false, [&](int64_t k, T u) {
        if (r.weight_decay() != 0) w[k] = w[k] * decay;
        w[k] = w[k] + coef * u;
      });
    }
  });
}

template void AdafactorUpdate::update_typed<float>(int64_t);
template void AdafactorUpdate::update_typed<double>(int64_t);

}  // namespace shardopt::detail
