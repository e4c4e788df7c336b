// Staging a load: checks that what is loaded fits the optimizer, this rank's staged shard, and
// the commit into the optimizer's owned slices.
#include "checkpoint/staging.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <functional>
#include <set>

#include "checkpoint/format.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

void check_checkpointable(ShardAccess& a) {
  SHARDOPT_CHECK(!a.has_factory_optimizer(), Unsupported,
                 "checkpoint: optimizers built from a ShardOptimizerFactory cannot be "
                 "checkpointed: their state lives inside the torch optimizer; use a native rule "
                 "({})",
                 fmt::join(rule_names(), ", "));
}

std::vector<std::string> optimizer_state_names(ShardAccess& a) {
  std::vector<std::string> names = state_names(a.group_rule(0));
  SHARDOPT_INTERNAL_ASSERT(static_cast<int>(names.size()) == a.state_buffer_count(),
                           "rule {} names {} state buffers, the engine keeps {}",
                           rule_name(a.group_rule(0)), names.size(), a.state_buffer_count());
  return names;
}

void check_elementwise_state(const std::string& rule, const char* what) {
  SHARDOPT_CHECK(rule != AdamW8bit::kName, Unsupported,
                 "checkpoint: {}: adamw8bit's state is blockwise quantised (codes, per-block "
                 "maxima, packed fp32 moments of small parameters: Note [Quantised state in "
                 "checkpoints]) and has no per-element form for it; save and load it with "
                 "save_checkpoint/load_checkpoint or the grid checkpoints, which reshard it "
                 "exactly",
                 what);
}

std::pair<int64_t, int64_t> StateSections::slice(const FlatLayout& layout, int k,
                                                 int bucket) const {
  const auto& bl = layout.buckets[static_cast<size_t>(bucket)];
  const SectionMap& map = maps[static_cast<size_t>(k)];
  const int64_t first = map.before(bl.shard_offset);
  return {first, map.before(bl.shard_offset + bl.shard) - first};
}

namespace {
StateSections sections_of(ShardAccess& a, int64_t shard_numel,
                          const std::vector<HeldPiece>& pieces) {
  StateSections s;
  for (const SectionIndex& ix : section_indices(a.group_rule(0), a.state_buffer_count())) {
    s.maps.emplace_back(ix, shard_numel, pieces);
    s.dtypes.push_back(ix.bytes ? at::kByte : a.master_dtype());
  }
  return s;
}
}  // namespace

StateSections state_sections(ShardAccess& a) {
  const auto& layout = a.layout();
  return sections_of(a, layout.shard_numel,
                     held_pieces(layout, a.comm()->rank(), a.comm()->size()));
}

StateSections saved_state_sections(ShardAccess& a, const Manifest& m, int rank) {
  std::vector<HeldPiece> pieces;
  for (const ManifestParam& p : m.params) {
    for (const SavedPiece& sp : p.pieces) {
      if (sp.rank == rank) pieces.push_back({sp, p.numel});
    }
  }
  const auto it = m.files[static_cast<size_t>(rank)].sections.find("param");
  const int64_t shard_numel =
      it == m.files[static_cast<size_t>(rank)].sections.end() ? 0 : numel_of(it->second.shape);
  return sections_of(a, shard_numel, pieces);
}

void check_state_sections(const Manifest& m, const ShardFile& f,
                          const std::vector<std::string>& names, const StateSections& s) {
  for (size_t k = 0; k < names.size() && k < s.maps.size(); ++k) {
    const std::string name = "state/" + names[k];
    const auto it = f.sections.find(name);
    SHARDOPT_CHECK(it != f.sections.end(), Checkpoint,
                   "checkpoint: shard file {} of {} has no section '{}'", f.path, m.dir.string(),
                   name);
    const int64_t want = s.maps[k].size();
    SHARDOPT_CHECK(it->second.dtype == s.dtypes[k] && numel_of(it->second.shape) == want,
                   Checkpoint,
                   "checkpoint: {}/{}: section '{}' holds {} {}, expected {} [{}] for the pieces "
                   "the manifest lists (Note [Quantised state in checkpoints]); the file or the "
                   "manifest is corrupt",
                   m.dir.string(), f.path, name, dtype_name(it->second.dtype),
                   shape_text(it->second.shape), dtype_name(s.dtypes[k]), want);
  }
}

Staging stage_current(ShardAccess& a, int states) {
  const auto& layout = a.layout();
  Staging s;
  s.sections = state_sections(a);
  s.param = at::empty({layout.shard_numel}, at::TensorOptions().dtype(a.master_dtype()));
  for (int k = 0; k < states; ++k) {
    const auto sk = static_cast<size_t>(k);
    s.state.push_back(at::empty({s.sections.maps[sk].size()},
                                at::TensorOptions().dtype(s.sections.dtypes[sk])));
  }
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bl = layout.buckets[b];
    const int bucket = static_cast<int>(b);
    s.param.narrow(0, bl.shard_offset, bl.shard).copy_(a.owned_param_slice(bucket));
    for (int k = 0; k < states; ++k) {
      const auto [first, count] = s.sections.slice(layout, k, bucket);
      s.state[static_cast<size_t>(k)].narrow(0, first, count).copy_(a.owned_state_slice(k, bucket));
    }
  }
  return s;
}

void commit(ShardAccess& a, const Staging& s) {
  const auto& layout = a.layout();
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bl = layout.buckets[b];
    const int bucket = static_cast<int>(b);
    a.owned_param_slice(bucket).copy_(s.param.narrow(0, bl.shard_offset, bl.shard));
    for (size_t k = 0; k < s.state.size(); ++k) {
      const auto [first, count] = s.sections.slice(layout, static_cast<int>(k), bucket);
      a.owned_state_slice(static_cast<int>(k), bucket).copy_(s.state[k].narrow(0, first, count));
    }
  }
}

namespace {
std::string split_text(const std::vector<int64_t>& split) {
  if (split.empty()) return "not split";
  return fmt::format("split along dim {} (full size {}, padded size {})", split[0], split[1],
                     split[2]);
}
}  // namespace

void check_same_model(ShardAccess& a, const Manifest& m) {
  const int n = static_cast<int>(a.layout().slots.size());
  std::set<std::string> mine;
  for (int i = 0; i < n; ++i) {
    const std::string& name = a.param_name(i);
    mine.insert(name);
    auto it = m.by_name.find(name);
    SHARDOPT_CHECK(it != m.by_name.end(), Mismatch,
                   "checkpoint: {} is of another model: parameter '{}' {} is not in it (it holds "
                   "{} parameters)",
                   m.dir.string(), name, shape_text(a.param_shape(i)), m.params.size());
    const auto& saved = m.params[it->second].shape;
    SHARDOPT_CHECK(saved == a.param_shape(i), Mismatch,
                   "checkpoint: {} is of another model: parameter '{}' has shape {} in the model "
                   "but {} in the checkpoint",
                   m.dir.string(), name, shape_text(a.param_shape(i)), shape_text(saved));
    // Note [Split records]: the same local shape may be another slice (another t, dimension or
    // padding); older manifests record no splits and are not checked.
    const auto& saved_split = m.params[it->second].split;
    const auto split = split_of_param(a, i);
    SHARDOPT_CHECK(!m.params[it->second].split_recorded || saved_split == split, Checkpoint,
                   "checkpoint: {}: parameter '{}' is {} in the model but {} in the checkpoint",
                   m.dir.string(), name, split_text(split), split_text(saved_split));
  }
  for (const auto& p : m.params) {
    SHARDOPT_CHECK(mine.count(p.name) > 0, Mismatch,
                   "checkpoint: {} is of another model: it holds parameter '{}' {} that the "
                   "optimizer does not have (renamed, removed or frozen?)",
                   m.dir.string(), p.name, shape_text(p.shape));
  }
}

void check_same_optimizer(ShardAccess& a, const Manifest& m,
                          const std::vector<std::string>& names) {
  const std::string rule = rule_name(a.group_rule(0));
  SHARDOPT_CHECK(m.rule == rule && m.state_names == names, Mismatch,
                 "checkpoint: {} holds the state of {} ({}), but this optimizer runs {} ({})",
                 m.dir.string(), m.rule, fmt::join(m.state_names, ", "), rule,
                 fmt::join(names, ", "));
  SHARDOPT_CHECK(static_cast<int>(m.group_rules.size()) == a.group_count(), Mismatch,
                 "checkpoint: {} has {} parameter groups, this optimizer {}", m.dir.string(),
                 m.group_rules.size(), a.group_count());
  const Rule current = a.group_rule(0);
  if (const auto* mine = std::get_if<AdamW8bit>(&current)) {
    // Note [Quantised state in checkpoints]: the same small parameters, blocks on boundaries.
    double saved = -1;
    try {
      saved = std::get<AdamW8bit>(rule_from_json(m.group_rules.at(0))).min_8bit_size();
    } catch (const std::exception& e) {
      SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed param group in {}: {}", m.path.string(),
                    e.what());
    }
    SHARDOPT_CHECK(saved == mine->min_8bit_size(), Mismatch,
                   "checkpoint: {} holds adamw8bit state saved with min_8bit_size {}, this "
                   "optimizer has {}: other parameters keep fp32 moments, so the state does not "
                   "carry over",
                   m.dir.string(), saved, mine->min_8bit_size());
    for (const ManifestParam& p : m.params) {
      for (const SavedPiece& sp : p.pieces) {
        SHARDOPT_CHECK(block_aligned(sp, AdamW8bit::kBlock), Checkpoint,
                       "checkpoint: {}: a piece of parameter '{}' (elements [{}, {}) at {} of "
                       "rank {}'s shard) is not on a {}-element block boundary, which adamw8bit's "
                       "state needs (Note [Quantised state in checkpoints]); the manifest was "
                       "edited or is corrupt",
                       m.path.string(), p.name, sp.param_begin, sp.param_begin + sp.numel,
                       sp.shard_begin, sp.rank, AdamW8bit::kBlock);
      }
    }
  }
}

void check_tensor_from_file(const at::Tensor& t, const std::string& what) {
  SHARDOPT_CHECK(t.defined(), Checkpoint, "{} is an undefined tensor", what);
  SHARDOPT_CHECK(t.layout() == at::kStrided && !t.is_quantized(), Checkpoint,
                 "{} is a {}{} tensor, expected a dense one", what,
                 t.is_quantized() ? "quantized " : "", c10::toString(t.layout()));
  // Elements [offset, offset + extent] of the storage, each of itemsize bytes.
  int64_t last = t.storage_offset();
  bool fits = last >= 0;
  for (int64_t d = 0; d < t.dim(); ++d) fits = fits && t.size(d) >= 0 && t.stride(d) >= 0;
  for (int64_t d = 0; fits && d < t.dim(); ++d) {
    if (t.size(d) == 0) return;  // no element is read
    int64_t step = 0;
    fits = !__builtin_mul_overflow(t.size(d) - 1, t.stride(d), &step) &&
           !__builtin_add_overflow(last, step, &last);
  }
  int64_t end = 0;
  fits = fits && !__builtin_add_overflow(last, int64_t{1}, &end) &&
         !__builtin_mul_overflow(end, static_cast<int64_t>(t.element_size()), &end) &&
         end <= static_cast<int64_t>(t.storage().nbytes());
  SHARDOPT_CHECK(fits, Checkpoint,
                 "{} (shape {}, strides {}, storage offset {}) lies outside its "
                 "storage of {} bytes; the file is corrupt",
                 what, shape_text(t.sizes().vec()), shape_text(t.strides().vec()),
                 t.storage_offset(), t.storage().nbytes());
}

std::vector<at::Tensor> match_full_params(ShardAccess& a,
                                          const torch::OrderedDict<std::string, at::Tensor>& params,
                                          const std::string& what) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < static_cast<int>(a.layout().slots.size()); ++i) {
    const std::string& name = a.param_name(i);
    const at::Tensor* t = params.find(name);
    SHARDOPT_CHECK(t != nullptr && t->defined(), Mismatch,
                   "checkpoint: parameter '{}' {} is missing from {}", name,
                   shape_text(a.param_shape(i)), what);
    SHARDOPT_CHECK(t->sizes().vec() == a.param_shape(i), Mismatch,
                   "checkpoint: parameter '{}' has shape {} in the model but {} in {}", name,
                   shape_text(a.param_shape(i)), shape_text(t->sizes().vec()), what);
    out.push_back(*t);
  }
  return out;
}

void stage_from_full(ShardAccess& a, at::Tensor& staging, const std::vector<at::Tensor>& full) {
  const int rank = a.comm()->rank();
  for (int i = 0; i < static_cast<int>(full.size()); ++i) {
    const at::Tensor flat = full[i].reshape({-1});
    const std::vector<SavedPiece> whole{{0, 0, 0, flat.numel()}};
    for (const auto& op : detail::plan_copies(a.layout(), rank, i, whole)) {
      staging.narrow(0, op.dst, op.numel).copy_(flat.narrow(0, op.src, op.numel));
    }
  }
}

}  // namespace shardopt::detail
