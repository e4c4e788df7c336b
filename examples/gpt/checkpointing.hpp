// gpt_train's checkpoints: one folder per (pipeline, tensor) rank, each the library's sharded,
// atomic checkpoint of that rank's optimizer over its data-parallel group, with the trainer's step,
// layout and RNG state.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace gpt {

// What a run's checkpoint must agree on to continue it: the grid and the rows a step reads.
struct SavedRun {
  int tp = 1, pp = 1, virtual_stages = 1;
  int64_t rows_per_step = 0;  // batch x data-parallel ranks x micro-batches (Note [Rows by number])
  uint64_t seed = 0;
  std::string describe() const;  // "--tp 2 --pp 2 --virtual-stages 1"
};

// A resume the trainer refuses: the message names the flag and what differs.
struct ResumeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// BASE at (1, 1); BASE/pp<j>-of-<P>/tp<k>-of-<T> otherwise (each rank's coordinates).
std::string checkpoint_folder(const std::string& base, const shardopt::ParallelGroups& groups);

// Saves `opt` with `run`, `step` and both dropout streams (the default generator's and `rng`'s,
// this rank's heads) into this rank's folder of `base`. Collective over opt's ranks.
void save(shardopt::DistributedOptimizer& opt, const std::string& base,
          const shardopt::ParallelGroups& groups, const SavedRun& run, int64_t step,
          const shardopt::tp::RngTracker& rng);

// Restores this rank's folder of `base` into `opt` (parameters, optimizer state, both dropout
// streams) and returns the step it was saved at. Throws ResumeError when the checkpoint
// was written at another (t, p, V) (not supported yet: the library's loading across layouts is
// still to come) or with another number of rows per step or seed. Collective over opt's ranks.
int64_t restore(shardopt::DistributedOptimizer& opt, const std::string& base,
                const shardopt::ParallelGroups& groups, const SavedRun& now,
                shardopt::tp::RngTracker& rng);

}  // namespace gpt
