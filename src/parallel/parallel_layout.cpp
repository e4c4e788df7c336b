// ParallelLayout: the rank grid cut into tensor, data and pipeline groups.
#include "shardopt/parallel_layout.hpp"

#include <fmt/format.h>

#include "shardopt/error.hpp"

namespace shardopt {

std::string ParallelLayout::to_string() const {
  return fmt::format("tp={} x dp={} x pp={}", tp, dp, pp);
}

ParallelGroups make_parallel_groups(const CommunicatorPtr& world, ParallelLayout layout) {
  SHARDOPT_CHECK(world != nullptr, InvalidArgument, "parallel layout: the communicator is null");
  const int n = world->size();
  SHARDOPT_CHECK(layout.tp >= 1 && layout.pp >= 1 && layout.dp >= 0, InvalidArgument,
                 "parallel layout: tp and pp must be at least 1 and dp at least 0 (0: the rest), "
                 "got {}", layout.to_string());
  if (layout.dp == 0) {
    SHARDOPT_CHECK(n % (layout.tp * layout.pp) == 0, InvalidArgument,
                   "parallel layout: tp x pp = {} x {} does not divide the {} ranks", layout.tp,
                   layout.pp, n);
    layout.dp = n / (layout.tp * layout.pp);
  }
  SHARDOPT_CHECK(layout.tp * layout.dp * layout.pp == n, InvalidArgument,
                 "parallel layout: {} needs {} ranks, the communicator has {}", layout.to_string(),
                 layout.tp * layout.dp * layout.pp, n);
  ParallelGroups g;
  g.layout = layout;
  g.world = world;
  const int r = world->rank();
  g.tp_rank = r % layout.tp;
  g.dp_rank = (r / layout.tp) % layout.dp;
  g.pp_rank = r / (layout.tp * layout.dp);
  // Every rank takes part in all three splits, in the same order (each is collective).
  g.tp = world->split(r / layout.tp, g.tp_rank);
  g.dp = world->split(g.pp_rank * layout.tp + g.tp_rank, g.dp_rank);
  g.pp = world->split(r % (layout.tp * layout.dp), g.pp_rank);
  const bool ends = layout.pp > 1 && (g.first_stage() || g.last_stage());
  g.embedding = world->split(ends ? g.tp_rank : -1, (g.first_stage() ? 0 : layout.dp) + g.dp_rank);
  return g;
}

}  // namespace shardopt
