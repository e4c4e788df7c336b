// gpt_train's checkpoints: the library's grid checkpoints (shardopt/grid_checkpoint.hpp), one
// folder per (pipeline, tensor) rank committed together, with the trainer's step, layout and both
// dropout streams; any layout resumes any other through the library alone.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace gpt {

// What a run's checkpoint records: the grid, and what must agree to continue its data.
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

// Saves this rank's part of the grid's checkpoint under `base` with `run`, `step` and both dropout
// streams (the default generator's and `rng`'s, this rank's heads), committed with one record for
// the whole grid. Collective over groups.world.
void save(shardopt::DistributedOptimizer& opt, const std::string& base,
          const shardopt::ParallelGroups& groups, const SavedRun& run, int64_t step,
          const shardopt::tp::RngTracker& rng);

// The layout and step of the committed checkpoint under `base`; ResumeError when there is none.
// One process.
std::pair<SavedRun, int64_t> saved_run(const std::string& base);

// Restores the committed checkpoint under `base` into `opt`, whatever (t, p, V), data-parallel
// size and ZeRO stage wrote it (each rank reads only what it holds), and both dropout streams
// when the grid is the save's; returns the step it was saved at. Throws ResumeError when the
// checkpoint cannot be read or is of another model, or read another number of rows per step or
// seed. Collective over groups.world.
int64_t restore(shardopt::DistributedOptimizer& opt, const std::string& base,
                const shardopt::ParallelGroups& groups, const SavedRun& now,
                shardopt::tp::RngTracker& rng);

}  // namespace gpt
