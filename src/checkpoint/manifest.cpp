// Checkpoint manifests: read and check one, load a shard file it lists (built at save time by
// manifest_build.cpp).
#include "checkpoint/manifest.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "shardopt/version.hpp"

namespace shardopt::detail {

namespace fs = std::filesystem;

namespace {

// Integers are read only from JSON integers within the target's range: nlohmann converts a JSON
// float to an integer with a cast, undefined past the range (found by the fuzzer, issue 42). The
// std::logic_error becomes read_manifest's "malformed manifest" error.
template <typename T>
T integer(const json& v) {
  if (!v.is_number_integer()) throw std::invalid_argument("expected an integer, got " + dump(v));
  const bool fits = v.is_number_unsigned()
                        ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                        : v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                              v.get<int64_t>() <= std::numeric_limits<T>::max();
  if (!fits) throw std::out_of_range("integer " + dump(v) + " out of range");
  return static_cast<T>(v.get<int64_t>());
}
// Floats are read only from finite JSON numbers (integers included: 65536 is a scale).
double finite_number(const json& v) {
  if (!v.is_number()) throw std::invalid_argument("expected a number, got " + dump(v));
  const double x = v.get<double>();
  if (!std::isfinite(x)) throw std::out_of_range("number " + dump(v) + " is not finite");
  return x;
}
std::vector<int64_t> integers(const json& v) {
  if (!v.is_array()) throw std::invalid_argument("expected an array of integers, got " + dump(v));
  std::vector<int64_t> out;
  for (const auto& x : v) out.push_back(integer<int64_t>(x));
  return out;
}

// The flat layout the manifest records (buckets, and each parameter's slot in them), checked for
// consistency, so that the piece tables can be recomputed from it.
FlatLayout recorded_layout(const Manifest& m) {
  const json& lj = m.j.at("layout");
  FlatLayout layout;
  int64_t shard_offset = 0;
  for (const auto& b : lj.at("buckets")) {
    BucketLayout bl;
    bl.group = integer<int>(b.at("group"));
    bl.flat_offset = integer<int64_t>(b.at("flat_offset"));
    bl.numel = integer<int64_t>(b.at("numel"));
    bl.padded = integer<int64_t>(b.at("padded"));
    bl.shard = integer<int64_t>(b.at("shard"));
    bl.shard_offset = integer<int64_t>(b.at("shard_offset"));
    const std::string where = fmt::format("{}: bucket #{} of the layout", m.path.string(),
                                          layout.buckets.size());
    SHARDOPT_CHECK(bl.shard >= 0 && bl.numel >= 0 &&
                       checked_mul(bl.shard, m.world, where) == bl.padded && bl.numel <= bl.padded &&
                       bl.shard_offset == shard_offset,
                   Checkpoint,
                   "checkpoint: {}: bucket #{} of the recorded layout is inconsistent (numel {}, "
                   "padded {}, shard {} at {} for {} ranks); the manifest was edited or is corrupt",
                   m.path.string(), layout.buckets.size(), bl.numel, bl.padded, bl.shard,
                   bl.shard_offset, m.world);
    shard_offset = checked_add(shard_offset, bl.shard, where);
    layout.buckets.push_back(bl);
  }
  // A parameter starts at its recorded slot and continues into the next buckets when it is split
  // (Note [Flat layout] in src/engine/flat_state.hpp): its pieces are recomputed here as make_layout cuts them.
  for (const auto& p : m.j.at("parameters")) {
    ParamSlot slot;
    slot.bucket = integer<int>(p.at("bucket"));
    slot.offset = integer<int64_t>(p.at("offset"));
    slot.numel = integer<int64_t>(p.at("numel"));
    slot.first_piece = static_cast<int>(layout.pieces.size());
    slot.piece_count = 0;
    const std::string name = p.at("name").get<std::string>();
    const int index = static_cast<int>(layout.slots.size());
    const int buckets = static_cast<int>(layout.buckets.size());
    bool inside = slot.bucket >= 0 && slot.bucket < buckets && slot.offset >= 0 && slot.numel >= 0;
    int64_t done = 0, offset = slot.offset;
    for (int b = slot.bucket; inside && (done < slot.numel || slot.piece_count == 0); ++b) {
      inside = b < buckets && layout.buckets[b].group == layout.buckets[slot.bucket].group &&
               offset <= layout.buckets[b].numel;
      if (!inside) break;
      const int64_t take = std::min(slot.numel - done, layout.buckets[b].numel - offset);
      inside = take > 0 || slot.numel == 0;
      layout.pieces.push_back(ParamPiece{index, b, offset, done, take});
      ++slot.piece_count;
      done += take;
      offset = 0;
    }
    SHARDOPT_CHECK(inside, Checkpoint,
                   "checkpoint: {}: parameter '{}' lies outside the buckets from #{} on in the "
                   "recorded layout; the manifest was edited or is corrupt",
                   m.path.string(), name, slot.bucket);
    layout.slots.push_back(slot);
  }
  return layout;
}

// Each parameter's piece table must be exactly the one its recorded slot produces.
void check_piece_tables(const Manifest& m) {
  const FlatLayout layout = recorded_layout(m);
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ManifestParam& mp = m.params[i];
    SHARDOPT_CHECK(layout.slots[i].numel == mp.numel, Checkpoint,
                   "checkpoint: {}: parameter '{}' has {} elements in its shape but {} in the "
                   "layout; the manifest was edited or is corrupt",
                   m.path.string(), mp.name, mp.numel, layout.slots[i].numel);
    const auto expected = saved_pieces(layout, static_cast<int>(i), m.world);
    bool same = expected.size() == mp.pieces.size();
    for (size_t k = 0; same && k < expected.size(); ++k) {
      const SavedPiece &e = expected[k], &g = mp.pieces[k];
      same = e.rank == g.rank && e.shard_begin == g.shard_begin &&
             e.param_begin == g.param_begin && e.numel == g.numel;
    }
    SHARDOPT_CHECK(same, Checkpoint,
                   "checkpoint: {}: the piece table of parameter '{}' does not match the layout "
                   "the manifest records (bucket {}, offset {}); the manifest was edited or is "
                   "corrupt",
                   m.path.string(), mp.name, layout.slots[i].bucket, layout.slots[i].offset);
  }
}

}  // namespace

uint32_t manifest_crc(json j) {
  j.erase(kManifestCrc);
  std::string text = dump(j);
  return crc_of(at::from_blob(text.data(), {static_cast<int64_t>(text.size())}, at::kByte));
}

Manifest read_manifest(const std::string& given) {
  // A grid's base of one folder (tp = pp = 1) stands for its committed folder (Note [One commit
  // for a grid] in shardopt/grid_checkpoint.hpp).
  std::string dir_text = given;
  {
    std::error_code ec;
    if (!fs::exists(fs::path(given) / kManifest, ec) &&
        fs::exists(fs::path(given) / "commit.json", ec)) {
      const GridCommit c = read_grid_commit(given);
      SHARDOPT_CHECK(c.folders.size() == 1, Checkpoint,
                     "checkpoint: {} is a grid checkpoint of tp={} x pp={} (step {}): load it "
                     "with load_grid_checkpoint, or name one of its folders (committed_folder)",
                     given, c.layout.tp, c.layout.pp, c.step);
      dir_text = committed_folder(given);
    }
  }
  Manifest m;
  m.dir = fs::path(dir_text);
  m.path = m.dir / kManifest;
  std::error_code ec;
  if (!fs::exists(m.path, ec)) {
    std::string hint;
    try {
      const Paths p = paths_of(dir_text);
      if (fs::exists(p.old / kManifest, ec)) {
        hint = fmt::format(
            "; a previous checkpoint survives at {} (a save was interrupted while "
            "replacing it): move it to {}",
            p.old.string(), p.dir.string());
      }
    } catch (const Error&) {
    }
    SHARDOPT_FAIL(Checkpoint, "checkpoint: no checkpoint at {}: {} does not exist{}", dir_text,
                  m.path.string(), hint);
  }
  const at::Tensor bytes = read_bytes(m.path, "manifest");
  return parse_manifest(std::string(static_cast<const char*>(bytes.data_ptr()),
                                    static_cast<size_t>(bytes.numel())),
                        dir_text);
}

Manifest parse_manifest(const std::string& text, const std::string& dir_text) {
  Manifest m;
  m.dir = fs::path(dir_text);
  m.path = m.dir / kManifest;
  try {
    m.j = json::parse(text);
  } catch (const json::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "checkpoint: manifest {} is not valid JSON: {}", m.path.string(),
                  e.what());
  }
  try {
    SHARDOPT_CHECK(m.j.is_object() && m.j.value("format", "") == kFormat, Checkpoint,
                   "checkpoint: {} is not a shardopt checkpoint manifest (\"format\" should be "
                   "\"{}\")",
                   m.path.string(), kFormat);
    const int format_version = integer<int>(m.j.at("format_version"));
    SHARDOPT_CHECK(format_version >= kCrc32FormatVersion &&
                       format_version <= kCheckpointFormatVersion,
                   Checkpoint,
                   "checkpoint: {} has unknown format version {}; this build (shardopt {}) reads "
                   "versions {} to {}",
                   m.path.string(), format_version, version(), kCrc32FormatVersion,
                   kCheckpointFormatVersion);
    // Note [Block tables]: the block checksums in the shard files rather than in the manifest.
    const bool block_tables = format_version >= kBlockTableFormatVersion;
    m.element_hash = format_version >= kMultiplyHashFormatVersion ? ElementHash::Multiply
                                                                   : ElementHash::Mix64;
    const ShardChecksum checksum = format_version == kCrc32FormatVersion ? ShardChecksum::Crc32
                                                                         : ShardChecksum::Crc32c;
    if (m.j.contains(kManifestCrc)) {  // Note [Manifest checksum]
      const uint32_t crc = manifest_crc(m.j);
      const std::string saved = m.j.at(kManifestCrc).get<std::string>();
      SHARDOPT_CHECK(saved == crc_text(crc), Checkpoint,
                     "checkpoint: checksum mismatch in manifest {}: CRC-32 is {}, the manifest "
                     "says {}; it was edited or is corrupt",
                     m.path.string(), crc_text(crc), saved);
    }
    m.world = integer<int>(m.j.at("world_size"));
    m.stage = integer<int>(m.j.at("stage"));
    m.dtype = dtype_from_name(m.j.at("dtype").get<std::string>(), m.path.string());
    m.step = checked_step_count(integer<int64_t>(m.j.at("step")), m.path.string() + ": \"step\"");
    const json& opt = m.j.at("optimizer");
    m.rule = opt.at("rule").get<std::string>();
    m.state_names = opt.at("state").get<std::vector<std::string>>();
    for (const auto& g : opt.at("param_groups")) m.group_rules.push_back(g);
    // Read here, before any rank changes its state (Note [Agreement before state changes]).
    if (const auto it = m.j.find("loss_scaler"); it != m.j.end() && !it->is_null()) {
      const json& s = *it;
      SHARDOPT_CHECK(s.is_object(), Checkpoint,
                     "checkpoint: {}: \"loss_scaler\" should be an object or null, got {}",
                     m.path.string(), dump(s));
      LossScaler::State st;
      st.scale = finite_number(s.at("scale"));
      st.good_steps = integer<int64_t>(s.at("good_steps"));
      st.hysteresis_left = integer<int>(s.at("hysteresis_left"));
      st.overflows = integer<int64_t>(s.at("overflows"));
      SHARDOPT_CHECK(st.scale > 0 && st.good_steps >= 0 && st.hysteresis_left >= 0 &&
                         st.overflows >= 0,
                     Checkpoint,
                     "checkpoint: {}: invalid loss scaler state (scale {}, good_steps {}, "
                     "hysteresis_left {}, overflows {}): the scale must be positive and the "
                     "counts non-negative",
                     m.path.string(), st.scale, st.good_steps, st.hysteresis_left, st.overflows);
      m.loss_scaler = st;
    }
    SHARDOPT_CHECK(m.world >= 1, Checkpoint, "checkpoint: {}: world_size {} is not positive",
                   m.path.string(), m.world);
    const auto& files = m.j.at("files");
    SHARDOPT_CHECK(files.is_array() && static_cast<int>(files.size()) == m.world, Checkpoint,
                   "checkpoint: {} lists {} shard files for world size {}", m.path.string(),
                   files.size(), m.world);
    for (int r = 0; r < m.world; ++r) {
      const json& f = files[r];
      ShardFile sf;
      sf.rank = integer<int>(f.at("rank"));
      SHARDOPT_CHECK(sf.rank == r, Checkpoint, "checkpoint: {}: file #{} is for rank {}",
                     m.path.string(), r, sf.rank);
      sf.path = f.at("path").get<std::string>();
      // "." and ".." are their own filename() but name the directory and its parent.
      SHARDOPT_CHECK(!sf.path.empty() && sf.path != "." && sf.path != ".." &&
                         fs::path(sf.path).filename().string() == sf.path,
                     Checkpoint,
                     "checkpoint: {}: shard path '{}' must be a plain file name", m.path.string(),
                     sf.path);
      sf.bytes = integer<int64_t>(f.at("bytes"));
      SHARDOPT_CHECK(sf.bytes >= kAlign, Checkpoint,
                     "checkpoint: {}: {} is {} bytes, shorter "
                     "than its header",
                     m.path.string(), sf.path, sf.bytes);
      sf.checksum = checksum;
      sf.crc = static_cast<uint32_t>(
          std::stoul(f.at(checksum_key(checksum)).get<std::string>(), nullptr, 16));
      for (const auto& s : f.at("sections")) {
        Section sec;
        sec.offset = integer<int64_t>(s.at("offset"));
        sec.dtype = dtype_from_name(s.at("dtype").get<std::string>(), m.path.string());
        sec.shape = integers(s.at("shape"));
        const std::string where = fmt::format("{}: section '{}' of {}", m.path.string(),
                                              s.at("name").get<std::string>(), sf.path);
        SHARDOPT_CHECK(sec.offset >= kAlign && sec.offset % kAlign == 0, Checkpoint,
                       "checkpoint: {}: offset {} is not a multiple of {} past the header", where,
                       sec.offset, kAlign);
        const int64_t end = checked_add(
            sec.offset,
            checked_mul(checked_numel(sec.shape, where),
                        static_cast<int64_t>(c10::elementSize(sec.dtype)), where),
            where);
        SHARDOPT_CHECK(end <= sf.bytes, Checkpoint,
                       "checkpoint: {} lies outside the file: it ends at byte {}, the file has {}",
                       where, end, sf.bytes);
        const std::string name = s.at("name").get<std::string>();
        SHARDOPT_CHECK((name != "param" && name.rfind("state/", 0) != 0) || sec.shape.size() == 1,
                       Checkpoint, "checkpoint: {} has shape {}, expected one dimension", where,
                       shape_text(sec.shape));
        sf.sections[name] = sec;
      }
      // Pieces are checked against "param"; every state section holds the same elements
      // (Note [Checkpoint layout]), so it must be as long (a shorter one: issue 42's fuzzer).
      // adamw8bit's are not element-indexed: the loader checks them against the piece table
      // (Note [Quantised state in checkpoints]).
      if (const auto param = sf.sections.find("param");
          param != sf.sections.end() && m.rule != AdamW8bit::kName) {
        for (const auto& n : m.state_names) {
          const auto state = sf.sections.find("state/" + n);
          SHARDOPT_CHECK(state == sf.sections.end() || state->second.shape == param->second.shape,
                         Checkpoint,
                         "checkpoint: {}: section 'state/{}' of {} has shape {}, its 'param' "
                         "section {}; the sections of a shard file hold the same elements",
                         m.path.string(), n, sf.path, shape_text(state->second.shape),
                         shape_text(param->second.shape));
        }
      }
      const auto blocks = f.find("blocks");  // Note [Block checksums]
      if (blocks != f.end() && block_tables) {  // Note [Block tables]
        sf.block_bytes = integer<int64_t>(blocks->at("bytes"));
        sf.block_count = integer<int64_t>(blocks->at("count"));
        sf.block_table_offset = integer<int64_t>(blocks->at("table_offset"));
        const std::string crc = blocks->at(kBlockTableCrc).get<std::string>();
        size_t used = 0;
        sf.block_table_crc = static_cast<uint32_t>(std::stoul(crc, &used, 16));
        const std::string where = fmt::format("{}: the block table of {}", m.path.string(),
                                              sf.path);
        SHARDOPT_CHECK(
            sf.block_bytes > 0 && sf.block_count >= 0 && sf.block_table_offset >= kAlign &&
                sf.block_table_offset % sf.block_bytes == 0 &&
                sf.block_count == sf.block_table_offset / sf.block_bytes &&
                checked_add(sf.block_table_offset, checked_mul(sf.block_count, 4, where), where) <=
                    sf.bytes &&
                used == crc.size() && crc.size() == 8,
            Checkpoint,
            "checkpoint: {} is malformed: {} checksums of {}-byte blocks at byte {} (checksum "
            "'{}') do not fit a {}-byte file after the blocks they cover",
            where, sf.block_count, sf.block_bytes, sf.block_table_offset, crc, sf.bytes);
      } else if (blocks != f.end()) {
        sf.block_bytes = integer<int64_t>(blocks->at("bytes"));
        const std::string text = blocks->at(checksum_key(checksum)).get<std::string>();
        // Their count against the file's size is checked where they are used (read_ranges), after
        // the size against the file on disk.
        SHARDOPT_CHECK(sf.block_bytes > 0 && text.size() % 8 == 0, Checkpoint,
                       "checkpoint: {}: the block checksums of {} are malformed ({} characters "
                       "for {}-byte blocks)",
                       m.path.string(), sf.path, text.size(), sf.block_bytes);
        sf.block_crcs.reserve(text.size() / 8);
        for (size_t k = 0; k < text.size(); k += 8) {  // by hand: 160,000 of them per GB
          uint32_t value = 0;
          bool hex = true;
          for (size_t d = k; d < k + 8; ++d) {
            const char c = text[d];
            const int x = c >= '0' && c <= '9'   ? c - '0'
                          : c >= 'a' && c <= 'f' ? c - 'a' + 10
                          : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                 : -1;
            hex = hex && x >= 0;
            value = value << 4 | static_cast<uint32_t>(x & 15);
          }
          SHARDOPT_CHECK(hex, Checkpoint, "checkpoint: {}: block checksum '{}' of {} is not "
                         "hexadecimal", m.path.string(), text.substr(k, 8), sf.path);
          sf.block_crcs.push_back(value);
        }
      }
      m.files.push_back(std::move(sf));
    }
    for (const auto& p : m.j.at("parameters")) {
      ManifestParam mp;
      mp.name = p.at("name").get<std::string>();
      mp.shape = integers(p.at("shape"));
      mp.numel = checked_numel(
          mp.shape, fmt::format("{}: parameter '{}'", m.path.string(), mp.name));
      mp.group = integer<int>(p.at("group"));
      // Absent in manifests written before splits were recorded; null: not split.
      if (p.contains("split")) {
        mp.split_recorded = true;
        const json& split = p.at("split");
        if (!split.is_null()) {
          mp.split = {integer<int64_t>(split.at("dim")), integer<int64_t>(split.at("full_size")),
                      integer<int64_t>(split.at("padded_size"))};
          SHARDOPT_CHECK(mp.split[0] >= 0 && mp.split[0] < static_cast<int64_t>(mp.shape.size()) &&
                             mp.split[1] > 0 && mp.split[1] <= mp.split[2] &&
                             mp.split[2] % mp.shape[mp.split[0]] == 0,
                         Checkpoint,
                         "checkpoint: {}: parameter '{}' of shape {} records the split (dim {}, "
                         "full size {}, padded size {}), which does not fit it",
                         m.path.string(), mp.name, shape_text(mp.shape), mp.split[0],
                         mp.split[1], mp.split[2]);
          if (split.contains("tp_size")) {  // Note [Placement in the manifest]
            mp.split_rank = integer<int>(split.at("tp_rank"));
            mp.split_ranks = integer<int>(split.at("tp_size"));
            SHARDOPT_CHECK(mp.split_ranks >= 1 && mp.split_rank >= 0 &&
                               mp.split_rank < mp.split_ranks &&
                               mp.shape[mp.split[0]] * mp.split_ranks == mp.split[2],
                           Checkpoint,
                           "checkpoint: {}: parameter '{}' of shape {} records tensor rank {} of "
                           "{} with padded size {} along dim {}, which does not fit it",
                           m.path.string(), mp.name, shape_text(mp.shape), mp.split_rank,
                           mp.split_ranks, mp.split[2], mp.split[0]);
          }
        }
      }
      if (const auto sums = p.find("sums"); sums != p.end()) {  // Note [Element checksums]
        for (const auto& h : *sums) {
          size_t used = 0;
          const std::string hex = h.get<std::string>();
          mp.sums.push_back(std::stoull(hex, &used, 16));
          SHARDOPT_CHECK(used == hex.size() && !hex.empty(), Checkpoint,
                         "checkpoint: {}: element checksum '{}' of '{}' is not hexadecimal",
                         m.path.string(), hex, mp.name);
        }
        SHARDOPT_CHECK(mp.sums.size() == m.state_names.size() + 1, Checkpoint,
                       "checkpoint: {}: parameter '{}' has {} element checksums for {} sections",
                       m.path.string(), mp.name, mp.sums.size(), m.state_names.size() + 1);
      }
      for (const auto& piece : p.at("pieces")) {
        SavedPiece sp{integer<int>(piece.at(0)), integer<int64_t>(piece.at(1)),
                      integer<int64_t>(piece.at(2)), integer<int64_t>(piece.at(3))};
        SHARDOPT_CHECK(sp.rank >= 0 && sp.rank < m.world, Checkpoint,
                       "checkpoint: {}: a piece of '{}' names rank {} of {}", m.path.string(),
                       mp.name, sp.rank, m.world);
        const auto& sections = m.files[sp.rank].sections;
        auto it = sections.find("param");
        SHARDOPT_CHECK(it != sections.end() && sp.shard_begin >= 0 && sp.numel >= 0 &&
                           sp.param_begin >= 0 &&
                           checked_add(sp.shard_begin, sp.numel,
                                       fmt::format("{}: a piece of '{}'", m.path.string(),
                                                   mp.name)) <= numel_of(it->second.shape),
                       Checkpoint, "checkpoint: {}: a piece of '{}' lies outside rank {}'s shard",
                       m.path.string(), mp.name, sp.rank);
        mp.pieces.push_back(sp);
      }
      SHARDOPT_CHECK(detail::covers(mp.pieces, mp.numel), Checkpoint,
                     "checkpoint: {}: the pieces of parameter '{}' do not cover its {} elements "
                     "exactly once",
                     m.path.string(), mp.name, mp.numel);
      SHARDOPT_CHECK(m.by_name.emplace(mp.name, static_cast<int>(m.params.size())).second,
                     Checkpoint, "checkpoint: {}: parameter '{}' is listed twice", m.path.string(),
                     mp.name);
      m.params.push_back(std::move(mp));
    }
    check_piece_tables(m);
    // What read_checkpoint_info, read_full_state and load_checkpoint read besides the layout:
    // of the types they take, or a named error here rather than a json exception there (found by
    // issue 42's fuzzer: a manifest without "trainer").
    SHARDOPT_CHECK(m.j.contains("trainer"), Checkpoint, "checkpoint: {} has no \"trainer\"",
                   m.path.string());
    (void)m.j.value("precision", std::string());
    if (const auto it = m.j.find("module"); it != m.j.end()) {
      (void)it->at("tensors").get<std::vector<std::string>>();
      (void)it->at("aliases").get<std::map<std::string, std::string>>();
    }
  } catch (const json::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed manifest {}: {}", m.path.string(), e.what());
  } catch (const std::logic_error& e) {  // std::stoul of a bad checksum
    SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed manifest {}: {}", m.path.string(), e.what());
  }
  return m;
}

at::Tensor LoadedShard::section(const std::string& name) const {
  auto it = file->sections.find(name);
  SHARDOPT_CHECK(it != file->sections.end(), Checkpoint,
                 "checkpoint: shard file {} has no section '{}'", file->path, name);
  const Section& s = it->second;
  const int64_t n = numel_of(s.shape);
  return bytes.narrow(0, s.offset, n * static_cast<int64_t>(c10::elementSize(s.dtype)))
      .view(s.dtype)
      .view(s.shape);
}

void check_shard_size(const Manifest& m, int rank) {
  const ShardFile& f = m.files[rank];
  const fs::path path = m.dir / f.path;
  std::error_code ec;
  SHARDOPT_CHECK(fs::exists(path, ec), Checkpoint,
                 "checkpoint: shard file {} of rank {} is missing (the manifest {} lists it)",
                 path.string(), rank, m.path.string());
  const auto size = fs::file_size(path, ec);
  SHARDOPT_CHECK(!ec && static_cast<int64_t>(size) == f.bytes, Checkpoint,
                 "checkpoint: shard file {} is {} bytes, but the manifest says {} (truncated or "
                 "replaced)",
                 path.string(), ec ? std::string("unreadable: ") + ec.message() : std::to_string(size),
                 f.bytes);
}

LoadedShard load_shard(const Manifest& m, int rank) {
  const ShardFile& f = m.files[rank];
  const fs::path path = m.dir / f.path;
  check_shard_size(m, rank);  // before reading: never more bytes than the manifest promised
  LoadedShard s;
  s.file = &f;
  s.bytes = read_bytes(path, fmt::format("shard file of rank {}", rank));
  SHARDOPT_CHECK(s.bytes.numel() == f.bytes, Checkpoint,
                 "checkpoint: shard file {} is {} bytes, but the manifest says {} (truncated or "
                 "replaced)",
                 path.string(), s.bytes.numel(), f.bytes);
  const uint32_t crc = checksum_of(f.checksum, s.bytes.data_ptr(), s.bytes.numel());
  SHARDOPT_CHECK(crc == f.crc, Checkpoint,
                 "checkpoint: checksum mismatch in shard file {}: {} is {}, the manifest says "
                 "{}; the file is corrupt",
                 path.string(), checksum_name(f.checksum), crc_text(crc), crc_text(f.crc));
  const auto* h = static_cast<const char*>(s.bytes.data_ptr());
  uint32_t header[3];
  std::memcpy(header, h + 8, sizeof(header));
  SHARDOPT_CHECK(std::memcmp(h, kMagic, 8) == 0 && header[1] == static_cast<uint32_t>(rank) &&
                     header[2] == static_cast<uint32_t>(m.world),
                 Checkpoint, "checkpoint: {} is not rank {}'s shard of a {}-rank checkpoint",
                 path.string(), rank, m.world);
  return s;
}

}  // namespace shardopt::detail
