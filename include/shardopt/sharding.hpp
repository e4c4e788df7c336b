/// \file
/// What a rank shards (ZeRO's stages) and where the optimizer's state lives (offload). Torch-free.
/// What each choice means for the engine is decided in one place, shardopt/detail/plan.hpp.
#pragma once

namespace shardopt {

/// ZeRO's stages, each sharding one more kind of model state across the ranks.
enum class Stage : int {
  Replicated = 0,      ///< DDP-equivalent: gradients all-reduced, full optimizer on every rank
  OptimizerState = 1,  ///< optimizer state (and the update) sharded
  Gradients = 2,       ///< + gradients sharded during backward
  Parameters = 3,      ///< + parameters sharded, gathered per unit (shardopt/units.hpp)
};

/// 0..3 -> Stage, for integers from a CLI, a config file or Python; throws Error{InvalidArgument}
/// naming the valid range otherwise.
Stage stage_from_int(int stage);
/// The ZeRO stage number, 0..3.
constexpr int to_int(Stage stage) { return static_cast<int>(stage); }

/// Where the optimizer's state lives: on the parameters' device, or in host memory.
enum class Offload { None, CPU };

}  // namespace shardopt
