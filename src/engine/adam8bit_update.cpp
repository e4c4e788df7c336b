// 8-bit AdamW over this rank's segments: Note [Blockwise 8-bit state] (adam8bit_update.hpp).
#include "engine/adam8bit_update.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <utility>

#include "kernels/adam8bit.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

Adam8bitUpdate::Adam8bitUpdate(FlatState& flat, const AdamW8bit& rule, RuleOf rule_of)
    : flat_(flat), rule_of_(std::move(rule_of)) {
  const auto& opts = flat_.master_options();
  SHARDOPT_CHECK(opts.device().is_cpu() && opts.dtype() == at::kFloat, Unsupported,
                 "optimizer: adamw8bit runs on fp32 master weights on the CPU (its fused CPU "
                 "kernel); these are {} on {}",
                 c10::toString(opts.dtype().toScalarType()), opts.device().str());
  const int64_t n = flat_.update_numel();
  const int64_t block = AdamW8bit::kBlock;
  SHARDOPT_CHECK(n % block == 0, Internal,
                 "optimizer: adamw8bit: {} update elements are not whole blocks of {}", n, block);
  const auto& layout = flat_.layout();
  auto& segments = flat_.segments();
  int64_t compact = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    const auto& s = segments[k];
    for_each_param_piece(layout, s, [&](int param, int64_t begin, int64_t length, int64_t) {
      Piece p{static_cast<int>(k), begin, length, false, 0};
      p.small = static_cast<double>(layout.slots[param].numel) < rule.min_8bit_size();
      if (p.small) {
        p.compact = compact;
        compact += length;
      } else {
        SHARDOPT_CHECK((s.state_offset + begin) % block == 0, Internal,
                       "optimizer: adamw8bit: parameter #{} has a piece at {} of the update "
                       "coordinates, not a block boundary (Note [Blockwise 8-bit state])",
                       param, s.state_offset + begin);
      }
      pieces_.push_back(p);
    });
  }
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  auto& state = flat_.state();
  state.clear();
  state.push_back(at::zeros({n}, bytes));
  state.push_back(at::zeros({n}, bytes));
  state.push_back(at::zeros({n / block}, opts));
  state.push_back(at::zeros({n / block}, opts));
  state.push_back(at::zeros({compact}, opts));
  state.push_back(at::zeros({compact}, opts));
}

namespace {

// First element (in buffers 4 and 5) and count of the small parameters' elements in `rank`'s
// owned range of `bucket`: contiguous, because the fp32 moments are packed in piece order.
std::pair<int64_t, int64_t> compact_range(const FlatState& flat,
                                          const std::vector<Adam8bitUpdate::Piece>& pieces,
                                          int bucket, int rank) {
  const ShardRange own = flat.layout().buckets[bucket].owned(rank);
  int64_t first = -1, count = 0;
  for (const auto& p : pieces) {
    const Segment& s = flat.segments()[p.segment];
    if (!p.small || s.bucket != bucket) continue;
    const int64_t begin = s.bucket_begin + p.begin;
    const ShardRange r = intersect(own, {begin, begin + p.length});
    if (r.empty()) continue;
    if (first < 0) first = p.compact + (r.begin - begin);
    count += r.size();
  }
  return {std::max<int64_t>(first, 0), count};
}

}  // namespace

at::Tensor Adam8bitUpdate::owned_state_slice(int k, int bucket) {
  auto& state = flat_.state();
  if (k < 2) return flat_.owned_state_slice(k, bucket);
  const auto& bl = flat_.layout().buckets[bucket];
  const int rank = flat_.rank();
  if (k < 4) {
    const int64_t at = flat_.update_index(bucket, rank * bl.shard);
    return state[k].narrow(0, at / AdamW8bit::kBlock, bl.shard / AdamW8bit::kBlock);
  }
  const auto [first, count] = compact_range(flat_, pieces_, bucket, rank);
  return state[k].narrow(0, first, count);
}

void Adam8bitUpdate::replicate_owned(Communicator& comm, Duration timeout) {
  const int rank = comm.rank(), world = comm.size();
  auto& state = flat_.state();
  std::vector<WorkPtr> works;
  std::vector<std::function<void()>> unpack;  // after the waits
  const auto& buckets = flat_.layout().buckets;
  for (int b = 0; b < static_cast<int>(buckets.size()); ++b) {
    const auto& bl = buckets[b];
    for (int k = 0; k < 4; ++k) {  // codes and maxima: positional, equal slices
      const int64_t g = k < 2 ? 1 : AdamW8bit::kBlock;
      at::Tensor range = state[k].narrow(0, bl.flat_offset / g, bl.padded / g);
      works.push_back(
          comm.all_gather(range.narrow(0, rank * bl.shard / g, bl.shard / g), range, true));
    }
    // fp32 moments: each rank's owned part, padded to the longest.
    std::vector<std::pair<int64_t, int64_t>> parts;
    int64_t width = 0;
    for (int r = 0; r < world; ++r) {
      parts.push_back(compact_range(flat_, pieces_, b, r));
      width = std::max(width, parts.back().second);
    }
    if (width == 0) continue;
    for (int k = 4; k < 6; ++k) {
      at::Tensor send = at::zeros({width}, state[k].options());
      send.narrow(0, 0, parts[rank].second)
          .copy_(state[k].narrow(0, parts[rank].first, parts[rank].second));
      at::Tensor all = at::empty({width * world}, state[k].options());
      works.push_back(comm.all_gather(send, all, true));
      unpack.push_back([&state, k, all, parts, width, rank, world] {
        for (int r = 0; r < world; ++r) {
          if (r == rank) continue;
          state[k].narrow(0, parts[r].first, parts[r].second)
              .copy_(all.narrow(0, r * width, parts[r].second));
        }
      });
    }
  }
  for (auto& w : works) w->wait(timeout);
  for (auto& f : unpack) f();
}

void Adam8bitUpdate::update(int64_t step) {
  auto& segments = flat_.segments();
  auto& state = flat_.state();
  uint8_t* q1 = state[0].data_ptr<uint8_t>();
  uint8_t* q2 = state[1].data_ptr<uint8_t>();
  float* a1 = state[2].data_ptr<float>();
  float* a2 = state[3].data_ptr<float>();
  float* m32 = state[4].data_ptr<float>();
  float* v32 = state[5].data_ptr<float>();
  for (const auto& p : pieces_) {
    auto& s = segments[p.segment];
    const auto& r = std::get<AdamW8bit>(rule_of_(s.group));
    kernels::Adam8bitHyper h;
    h.lr = r.lr(), h.beta1 = r.beta1(), h.beta2 = r.beta2(), h.eps = r.eps();
    h.weight_decay = r.weight_decay(), h.step = step;
    float* param = s.param.data_ptr<float>() + p.begin;
    const float* grad = s.grad.data_ptr<float>() + p.begin;
    if (p.small) {
      kernels::adam8bit_fp32(h, param, grad, m32 + p.compact, v32 + p.compact, p.length);
      continue;
    }
    const int64_t at = s.state_offset + p.begin;
    kernels::fused_adam8bit(h, {param, grad, q1 + at, q2 + at, a1 + at / AdamW8bit::kBlock,
                                a2 + at / AdamW8bit::kBlock, p.length});
  }
}

}  // namespace shardopt::detail
