/// \file
/// A c10d process group whose subgroups its maker creates: torch.distributed's groups from Python
/// on builds without Gloo's headers (pip's torch), where shardopt cannot make a Gloo group itself.
/// Kept out of process_group.hpp (in the umbrella header) so that few TUs see `<functional>` here.
#pragma once

#include <functional>

#include "shardopt/process_group.hpp"

namespace shardopt {

/// Makes this rank's subgroup for split(color, key): called by split() on every rank of the
/// group alike (collective), with this rank's color and key; the subgroup holds the ranks of the
/// same color ordered by (key, rank). Returns null for a negative color. The Python package's
/// from_process_group() passes one over torch.distributed.new_group.
using ProcessGroupSplitter =
    std::function<c10::intrusive_ptr<c10d::ProcessGroup>(int color, int key)>;

/// As make_process_group_communicator(group), with split() (and split_by_host()) served by
/// `splitter`; the subgroups it returns are wrapped without one (they do not split further).
CommunicatorPtr make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                ProcessGroupSplitter splitter);

}  // namespace shardopt
