/// \file
/// Umbrella header: everything a trainer needs, nothing heavier than <ATen/core/Tensor.h>,
/// <torch/optim/optimizer.h> and fmt. Engine-specific factories live in mpi.hpp,
/// process_group.hpp and nccl.hpp.
#pragma once

#include "shardopt/async_checkpoint.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/config.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"
#include "shardopt/job.hpp"
#include "shardopt/memory_tracker.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/pipeline.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "shardopt/options.hpp"
#include "shardopt/recompute.hpp"
#include "shardopt/rules.hpp"
#include "shardopt/snapshot.hpp"
#include "shardopt/state_dict.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "shardopt/threads.hpp"
#include "shardopt/units.hpp"
#include "shardopt/version.hpp"
