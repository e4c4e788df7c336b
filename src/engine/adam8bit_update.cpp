// 8-bit AdamW over this rank's segments: Note [Blockwise 8-bit state] (adam8bit_update.hpp).
#include "engine/adam8bit_update.hpp"

#include <ATen/ATen.h>

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
