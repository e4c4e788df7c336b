// The dynamic loss scaler (see Note [Mixed precision] in shardopt/precision.hpp).
#include "shardopt/precision.hpp"

#include <algorithm>

#include "shardopt/error.hpp"

namespace shardopt {

void LossScaleOptions::validate() const {
  SHARDOPT_CHECK(initial_scale > 0, InvalidArgument,
                 "options: loss_scale.initial_scale must be > 0, got {}", initial_scale);
  SHARDOPT_CHECK(growth_factor >= 1, InvalidArgument,
                 "options: loss_scale.growth_factor must be >= 1, got {}", growth_factor);
  SHARDOPT_CHECK(backoff_factor > 0 && backoff_factor < 1, InvalidArgument,
                 "options: loss_scale.backoff_factor must be in (0, 1), got {}", backoff_factor);
  SHARDOPT_CHECK(growth_interval >= 1, InvalidArgument,
                 "options: loss_scale.growth_interval must be >= 1, got {}", growth_interval);
  SHARDOPT_CHECK(hysteresis >= 1, InvalidArgument,
                 "options: loss_scale.hysteresis must be >= 1, got {}", hysteresis);
  SHARDOPT_CHECK(min_scale > 0 && min_scale <= initial_scale, InvalidArgument,
                 "options: loss_scale.min_scale must be in (0, initial_scale = {}], got {}",
                 initial_scale, min_scale);
}

LossScaler::LossScaler(LossScaleOptions options)
    : options_(options), scale_(options.initial_scale), hysteresis_left_(options.hysteresis) {
  options_.validate();
}

bool LossScaler::update(bool overflow) {
  if (overflow) {
    ++overflows_;
    good_steps_ = 0;
    if (options_.dynamic && --hysteresis_left_ <= 0) {
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
      hysteresis_left_ = options_.hysteresis;
    }
    return true;
  }
  if (options_.dynamic && ++good_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    good_steps_ = 0;
    hysteresis_left_ = options_.hysteresis;
  }
  return false;
}

void LossScaler::set_state(const State& state) {
  SHARDOPT_CHECK(state.scale > 0 && state.hysteresis_left >= 0 && state.good_steps >= 0,
                 Checkpoint, "loss scaler: invalid saved state (scale {}, good steps {}, "
                 "hysteresis left {})", state.scale, state.good_steps, state.hysteresis_left);
  scale_ = state.scale;
  good_steps_ = state.good_steps;
  hysteresis_left_ = state.hysteresis_left;
  overflows_ = state.overflows;
}

}  // namespace shardopt
