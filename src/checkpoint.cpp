// Sharded checkpoints: per-rank shard files + a JSON manifest keyed by parameter name, written
// through a temporary directory and published with one rename; loads reshard through the
// manifest's per-parameter pieces. See Notes [Atomic checkpoints] and [Agreement before state
// changes] in shardopt/checkpoint.hpp.
//
// Note [Checkpoint layout]
//   <dir>/manifest.json                rank 0: format, world size, stage, precision, step, rule and
//                                      hyper-parameters per group, layout, every parameter's name,
//                                      shape, dtype, flat offset and pieces, every file's CRC-32
//   <dir>/shard-RRRRR-of-NNNNN.bin     rank R: a 64-byte header ("SHARDOPT", version, rank, world),
//                                      then 64-byte aligned sections: "param" (fp32 master
//                                      parameters), "state/<name>" per optimizer state buffer,
//                                      each the rank's owned slices of every bucket concatenated
//                                      ("shard coordinates"); then "trainer/<key>" tensors.
// A parameter's piece [rank, shard_begin, param_begin, numel] says that its elements
// [param_begin, param_begin + numel) sit at element shard_begin of every section of that rank's
// file, so a reader needs no knowledge of the bucketing that wrote them.
#include "shardopt/checkpoint.hpp"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "checkpoint/torch_save.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/detail/shard_plan.hpp"
#include "shardopt/error.hpp"
#include "shardopt/version.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::SavedPiece;
using detail::ShardAccess;

constexpr const char* kFormat = "shardopt-checkpoint";
constexpr const char* kOptimizerFormat = "shardopt-optimizer-state";
constexpr const char* kManifest = "manifest.json";
constexpr char kMagic[8] = {'S', 'H', 'A', 'R', 'D', 'O', 'P', 'T'};
constexpr int64_t kAlign = 64;

std::string dump(const json& j, int indent = -1) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

// ---- names: dtypes, rules, state buffers ------------------------------------------------------

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kShort:
      return "int16";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      break;
  }
  SHARDOPT_FAIL(Unsupported, "checkpoint: tensors of dtype {} cannot be stored", c10::toString(t));
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"float32", at::kFloat},     {"float64", at::kDouble}, {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"int64", at::kLong},     {"int32", at::kInt},
      {"int16", at::kShort},       {"int8", at::kChar},      {"uint8", at::kByte},
      {"bool", at::kBool}};
  auto it = kTypes.find(name);
  SHARDOPT_CHECK(it != kTypes.end(), Checkpoint, "checkpoint: {}: unknown dtype '{}'", where, name);
  return it->second;
}

// The names torch::optim gives the state buffers each native rule keeps, in the engine's order.
std::vector<std::string> state_names(const Rule& rule) {
  struct {
    std::vector<std::string> adam(bool amsgrad) const {
      std::vector<std::string> n{"exp_avg", "exp_avg_sq"};
      if (amsgrad) n.push_back("max_exp_avg_sq");
      return n;
    }
    std::vector<std::string> operator()(const Adam& r) const { return adam(r.amsgrad()); }
    std::vector<std::string> operator()(const AdamW& r) const { return adam(r.amsgrad()); }
    std::vector<std::string> operator()(const SGD& r) const {
      return r.momentum() != 0.0 ? std::vector<std::string>{"momentum_buffer"}
                                 : std::vector<std::string>{};
    }
    std::vector<std::string> operator()(const Adagrad&) const { return {"sum"}; }
    std::vector<std::string> operator()(const RMSprop& r) const {
      std::vector<std::string> n{"square_avg"};
      if (r.momentum() > 0.0) n.push_back("momentum_buffer");
      if (r.centered()) n.push_back("grad_avg");
      return n;
    }
    std::vector<std::string> operator()(const Lamb&) const { return {"exp_avg", "exp_avg_sq"}; }
  } names;
  return std::visit(names, rule);
}

json rule_to_json(const Rule& rule) {
  struct {
    json operator()(const Adam& r) const {
      return adam(r.lr(), r.beta1(), r.beta2(), r.eps(), r.weight_decay(), r.amsgrad());
    }
    json operator()(const AdamW& r) const {
      return adam(r.lr(), r.beta1(), r.beta2(), r.eps(), r.weight_decay(), r.amsgrad());
    }
    json operator()(const SGD& r) const {
      return {{"lr", r.lr()},
              {"momentum", r.momentum()},
              {"dampening", r.dampening()},
              {"weight_decay", r.weight_decay()},
              {"nesterov", r.nesterov()}};
    }
    json operator()(const Adagrad& r) const {
      return {{"lr", r.lr()},
              {"lr_decay", r.lr_decay()},
              {"weight_decay", r.weight_decay()},
              {"initial_accumulator_value", r.initial_accumulator_value()},
              {"eps", r.eps()}};
    }
    json operator()(const RMSprop& r) const {
      return {{"lr", r.lr()},
              {"alpha", r.alpha()},
              {"eps", r.eps()},
              {"weight_decay", r.weight_decay()},
              {"momentum", r.momentum()},
              {"centered", r.centered()}};
    }
    json operator()(const Lamb& r) const {
      return {{"lr", r.lr()},
              {"beta1", r.beta1()},
              {"beta2", r.beta2()},
              {"eps", r.eps()},
              {"weight_decay", r.weight_decay()}};
    }
    static json adam(double lr, double b1, double b2, double eps, double wd, bool ams) {
      return {{"lr", lr},   {"beta1", b1},        {"beta2", b2},
              {"eps", eps}, {"weight_decay", wd}, {"amsgrad", ams}};
    }
  } fields;
  json j = std::visit(fields, rule);
  j["rule"] = rule_name(rule);
  return j;
}

Rule rule_from_json(const json& j) {
  const std::string name = j.at("rule").get<std::string>();
  auto d = [&](const char* key) { return j.at(key).get<double>(); };
  auto b = [&](const char* key) { return j.at(key).get<bool>(); };
  if (name == Adam::kName) {
    return Adam(d("lr"))
        .beta1(d("beta1"))
        .beta2(d("beta2"))
        .eps(d("eps"))
        .weight_decay(d("weight_decay"))
        .amsgrad(b("amsgrad"));
  }
  if (name == AdamW::kName) {
    return AdamW(d("lr"))
        .beta1(d("beta1"))
        .beta2(d("beta2"))
        .eps(d("eps"))
        .weight_decay(d("weight_decay"))
        .amsgrad(b("amsgrad"));
  }
  if (name == SGD::kName) {
    return SGD(d("lr"))
        .momentum(d("momentum"))
        .dampening(d("dampening"))
        .weight_decay(d("weight_decay"))
        .nesterov(b("nesterov"));
  }
  if (name == Adagrad::kName) {
    return Adagrad(d("lr"))
        .lr_decay(d("lr_decay"))
        .weight_decay(d("weight_decay"))
        .initial_accumulator_value(d("initial_accumulator_value"))
        .eps(d("eps"));
  }
  if (name == RMSprop::kName) {
    return RMSprop(d("lr"))
        .alpha(d("alpha"))
        .eps(d("eps"))
        .weight_decay(d("weight_decay"))
        .momentum(d("momentum"))
        .centered(b("centered"));
  }
  if (name == Lamb::kName) {
    return Lamb(d("lr"))
        .beta1(d("beta1"))
        .beta2(d("beta2"))
        .eps(d("eps"))
        .weight_decay(d("weight_decay"));
  }
  SHARDOPT_FAIL(Checkpoint, "checkpoint: unknown optimizer rule '{}'", name);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// ---- paths and files ------------------------------------------------------------------------

struct Paths {
  fs::path dir;  // where the checkpoint is visible
  fs::path parent;
  fs::path tmp;  // .<name>.tmp: the save in progress (or a crashed one's leftovers)
  fs::path old;  // .<name>.old: only on filesystems without RENAME_EXCHANGE
};

Paths paths_of(const std::string& dir) {
  SHARDOPT_CHECK(!dir.empty(), InvalidArgument, "checkpoint: the directory name is empty");
  fs::path d = fs::path(dir).lexically_normal();
  if (d.filename().empty()) d = d.parent_path();  // "out/ckpt/"
  const std::string name = d.filename().string();
  SHARDOPT_CHECK(!name.empty() && name != "." && name != "..", InvalidArgument,
                 "checkpoint: '{}' does not name a directory that can be replaced; give a path "
                 "such as out/checkpoint",
                 dir);
  Paths p;
  p.dir = d;
  p.parent = d.has_parent_path() ? d.parent_path() : fs::path(".");
  p.tmp = p.parent / ("." + name + ".tmp");
  p.old = p.parent / ("." + name + ".old");
  return p;
}

std::string shard_file_name(int rank, int world) {
  return fmt::format("shard-{:05d}-of-{:05d}.bin", rank, world);
}

std::string errno_text() { return std::strerror(errno); }

// Writes a file sequentially, computing its CRC-32 on the way; sync() makes it durable.
class FileWriter {
 public:
  explicit FileWriter(fs::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    SHARDOPT_CHECK(fd_ >= 0, Checkpoint, "checkpoint: cannot create {}: {}", path_.string(),
                   errno_text());
  }
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    crc_ = crc32_z(crc_, p, bytes);
    size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::write(fd_, p + done, bytes - done);
      if (n < 0 && errno == EINTR) continue;
      SHARDOPT_CHECK(n > 0, Checkpoint, "checkpoint: writing {} failed after {} bytes: {}",
                     path_.string(), bytes_ + done, errno_text());
      done += static_cast<size_t>(n);
    }
    bytes_ += static_cast<int64_t>(bytes);
  }
  void pad_to(int64_t alignment) {
    static const char zeros[kAlign] = {};
    const int64_t pad = (alignment - bytes_ % alignment) % alignment;
    if (pad > 0) write(zeros, static_cast<size_t>(pad));
  }
  void write_tensor(const at::Tensor& t) {
    const at::Tensor c = t.to(at::kCPU).contiguous();
    write(c.data_ptr(), c.nbytes());
  }
  void sync_and_close() {
    SHARDOPT_CHECK(::fsync(fd_) == 0, Checkpoint, "checkpoint: fsync of {} failed: {}",
                   path_.string(), errno_text());
    const int fd = fd_;
    fd_ = -1;
    SHARDOPT_CHECK(::close(fd) == 0, Checkpoint, "checkpoint: closing {} failed: {}",
                   path_.string(), errno_text());
  }
  int64_t bytes() const { return bytes_; }
  uint32_t crc() const { return static_cast<uint32_t>(crc_); }

 private:
  fs::path path_;
  int fd_ = -1;
  int64_t bytes_ = 0;
  uLong crc_ = crc32_z(0L, Z_NULL, 0);
};

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  SHARDOPT_CHECK(fd >= 0, Checkpoint, "checkpoint: cannot open directory {}: {}", dir.string(),
                 errno_text());
  const int rc = ::fsync(fd);
  const std::string err = rc == 0 ? "" : errno_text();
  ::close(fd);
  SHARDOPT_CHECK(rc == 0, Checkpoint, "checkpoint: fsync of directory {} failed: {}", dir.string(),
                 err);
}

// The whole file as bytes (64-byte aligned storage, so sections can be viewed in place).
at::Tensor read_bytes(const fs::path& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SHARDOPT_CHECK(fd >= 0, Checkpoint, "checkpoint: {} {} cannot be read: {}", what, path.string(),
                 errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    SHARDOPT_FAIL(Checkpoint, "checkpoint: cannot stat {} {}: {}", what, path.string(), err);
  }
  at::Tensor bytes = at::empty({static_cast<int64_t>(st.st_size)}, at::kByte);
  auto* p = static_cast<char*>(bytes.data_ptr());
  size_t done = 0;
  while (done < static_cast<size_t>(st.st_size)) {
    const ssize_t n = ::read(fd, p + done, static_cast<size_t>(st.st_size) - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = n == 0 ? "unexpected end of file" : errno_text();
      ::close(fd);
      SHARDOPT_FAIL(Checkpoint, "checkpoint: reading {} {} failed: {}", what, path.string(), err);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return bytes;
}

std::string crc_text(uint32_t crc) { return fmt::format("{:08x}", crc); }

uint32_t crc_of(const at::Tensor& bytes) {
  return static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0),
                                       static_cast<const unsigned char*>(bytes.data_ptr()),
                                       static_cast<size_t>(bytes.numel())));
}

// Writes `bytes` to `path` atomically: a temporary sibling, fsync, rename, fsync of the directory.
void write_file_atomically(const fs::path& path, const void* data, size_t bytes) {
  const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(parent, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot create directory {}: {}", parent.string(),
                 ec.message());
  const fs::path tmp = parent / ("." + path.filename().string() + ".tmp");
  {
    FileWriter w(tmp);
    w.write(data, bytes);
    w.sync_and_close();
  }
  SHARDOPT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, Checkpoint,
                 "checkpoint: cannot rename {} to {}: {}", tmp.string(), path.string(),
                 errno_text());
  fsync_dir(parent);
}

// ---- agreement across ranks (Note [Agreement before state changes]) ------------------------

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            Duration timeout) {
  const int world = comm.size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({world}, at::kLong);
  comm.all_gather(len, lens, true)->wait(timeout);
  const int64_t width = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor buf = at::zeros({width}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world * width}, at::kByte);
  comm.all_gather(buf, all, true)->wait(timeout);
  std::vector<std::string> out;
  const auto* p = static_cast<const char*>(all.data_ptr());
  const auto* n = lens.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) out.emplace_back(p + r * width, static_cast<size_t>(n[r]));
  return out;
}

// Runs `body` on every rank and exchanges the outcomes. When any rank failed, `on_failure` runs
// and every rank throws an Error of the first failing rank's kind; otherwise returns each rank's
// payload. Collective.
std::vector<json> agree(Communicator& comm, Duration timeout, const std::string& what,
                        const std::string& consequence, const std::function<json()>& body,
                        const std::function<void()>& on_failure = nullptr) {
  json mine;
  try {
    mine = {{"ok", true}, {"payload", body()}};
  } catch (const Error& e) {
    mine = {{"ok", false}, {"kind", static_cast<int>(e.kind())}, {"message", e.what()}};
  } catch (const std::exception& e) {
    mine = {{"ok", false},
            {"kind", static_cast<int>(ErrorKind::Checkpoint)},
            {"message", fmt::format("shardopt[rank {}/{}] checkpoint: {}: {}", comm.rank(),
                                    comm.size(), what, e.what())}};
  }
  std::vector<json> all;
  for (const auto& s : all_gather_strings(comm, dump(mine), timeout)) all.push_back(json::parse(s));
  std::vector<int> failed;
  for (int r = 0; r < comm.size(); ++r) {
    if (!all[r].at("ok").get<bool>()) failed.push_back(r);
  }
  if (failed.empty()) {
    std::vector<json> payloads;
    for (auto& j : all) payloads.push_back(std::move(j["payload"]));
    return payloads;
  }
  if (on_failure) {
    try {
      on_failure();
    } catch (...) {
    }
  }
  const json& first = all[failed.front()];
  const auto kind = static_cast<ErrorKind>(first.at("kind").get<int>());
  std::string message = first.at("message").get<std::string>();
  if (comm.rank() != failed.front()) {
    message = fmt::format(
        "shardopt[rank {}/{}] checkpoint: {} failed on rank{} {}; {}. The error "
        "on rank {}: {}",
        comm.rank(), comm.size(), what, failed.size() > 1 ? "s" : "", fmt::join(failed, ", "),
        consequence, failed.front(), message);
  }
  throw Error(kind, comm.rank(), message);
}

// ---- the manifest ---------------------------------------------------------------------------

struct Section {
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;  // 1-D for parameters and state
};

struct ShardFile {
  int rank = 0;
  std::string path;
  int64_t bytes = 0;
  uint32_t crc = 0;
  std::map<std::string, Section> sections;
};

struct ManifestParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int group = 0;
  std::vector<SavedPiece> pieces;
};

struct Manifest {
  fs::path dir;
  fs::path path;
  json j;
  int world = 0;
  int stage = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t step = 0;
  std::string rule;
  std::vector<std::string> state_names;
  std::vector<json> group_rules;
  std::vector<ManifestParam> params;
  std::unordered_map<std::string, int> by_name;
  std::vector<ShardFile> files;  // by rank
};

Manifest read_manifest(const std::string& dir_text) {
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
  const std::string text(static_cast<const char*>(bytes.data_ptr()),
                         static_cast<size_t>(bytes.numel()));
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
    const int format_version = m.j.at("format_version").get<int>();
    SHARDOPT_CHECK(format_version == kCheckpointFormatVersion, Checkpoint,
                   "checkpoint: {} has unknown format version {}; this build (shardopt {}) reads "
                   "version {}",
                   m.path.string(), format_version, version(), kCheckpointFormatVersion);
    m.world = m.j.at("world_size").get<int>();
    m.stage = m.j.at("stage").get<int>();
    m.dtype = dtype_from_name(m.j.at("dtype").get<std::string>(), m.path.string());
    m.step = m.j.at("step").get<int64_t>();
    const json& opt = m.j.at("optimizer");
    m.rule = opt.at("rule").get<std::string>();
    m.state_names = opt.at("state").get<std::vector<std::string>>();
    for (const auto& g : opt.at("param_groups")) m.group_rules.push_back(g);
    SHARDOPT_CHECK(m.world >= 1, Checkpoint, "checkpoint: {}: world_size {} is not positive",
                   m.path.string(), m.world);
    const auto& files = m.j.at("files");
    SHARDOPT_CHECK(files.is_array() && static_cast<int>(files.size()) == m.world, Checkpoint,
                   "checkpoint: {} lists {} shard files for world size {}", m.path.string(),
                   files.size(), m.world);
    for (int r = 0; r < m.world; ++r) {
      const json& f = files[r];
      ShardFile sf;
      sf.rank = f.at("rank").get<int>();
      SHARDOPT_CHECK(sf.rank == r, Checkpoint, "checkpoint: {}: file #{} is for rank {}",
                     m.path.string(), r, sf.rank);
      sf.path = f.at("path").get<std::string>();
      SHARDOPT_CHECK(fs::path(sf.path).filename().string() == sf.path, Checkpoint,
                     "checkpoint: {}: shard path '{}' must be a plain file name", m.path.string(),
                     sf.path);
      sf.bytes = f.at("bytes").get<int64_t>();
      SHARDOPT_CHECK(sf.bytes >= kAlign, Checkpoint,
                     "checkpoint: {}: {} is {} bytes, shorter "
                     "than its header",
                     m.path.string(), sf.path, sf.bytes);
      sf.crc = static_cast<uint32_t>(std::stoul(f.at("crc32").get<std::string>(), nullptr, 16));
      for (const auto& s : f.at("sections")) {
        Section sec;
        sec.offset = s.at("offset").get<int64_t>();
        sec.dtype = dtype_from_name(s.at("dtype").get<std::string>(), m.path.string());
        sec.shape = s.at("shape").get<std::vector<int64_t>>();
        const int64_t end =
            sec.offset + numel_of(sec.shape) * static_cast<int64_t>(c10::elementSize(sec.dtype));
        SHARDOPT_CHECK(sec.offset >= kAlign && sec.offset % kAlign == 0 && end <= sf.bytes,
                       Checkpoint, "checkpoint: {}: section '{}' of {} lies outside the file",
                       m.path.string(), s.at("name").get<std::string>(), sf.path);
        sf.sections[s.at("name").get<std::string>()] = sec;
      }
      m.files.push_back(std::move(sf));
    }
    for (const auto& p : m.j.at("parameters")) {
      ManifestParam mp;
      mp.name = p.at("name").get<std::string>();
      mp.shape = p.at("shape").get<std::vector<int64_t>>();
      mp.numel = numel_of(mp.shape);
      mp.group = p.at("group").get<int>();
      for (const auto& piece : p.at("pieces")) {
        SavedPiece sp{piece.at(0).get<int>(), piece.at(1).get<int64_t>(),
                      piece.at(2).get<int64_t>(), piece.at(3).get<int64_t>()};
        SHARDOPT_CHECK(sp.rank >= 0 && sp.rank < m.world, Checkpoint,
                       "checkpoint: {}: a piece of '{}' names rank {} of {}", m.path.string(),
                       mp.name, sp.rank, m.world);
        const auto& sections = m.files[sp.rank].sections;
        auto it = sections.find("param");
        SHARDOPT_CHECK(it != sections.end() && sp.shard_begin >= 0 &&
                           sp.shard_begin + sp.numel <= numel_of(it->second.shape),
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
  } catch (const json::exception& e) {
    SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed manifest {}: {}", m.path.string(), e.what());
  } catch (const std::logic_error& e) {  // std::stoul of a bad checksum
    SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed manifest {}: {}", m.path.string(), e.what());
  }
  return m;
}

// A verified shard file: its bytes and typed views of its sections.
struct LoadedShard {
  at::Tensor bytes;
  const ShardFile* file = nullptr;
  at::Tensor section(const std::string& name) const {
    auto it = file->sections.find(name);
    SHARDOPT_CHECK(it != file->sections.end(), Checkpoint,
                   "checkpoint: shard file {} has no section '{}'", file->path, name);
    const Section& s = it->second;
    const int64_t n = numel_of(s.shape);
    return bytes.narrow(0, s.offset, n * static_cast<int64_t>(c10::elementSize(s.dtype)))
        .view(s.dtype)
        .view(s.shape);
  }
};

LoadedShard load_shard(const Manifest& m, int rank) {
  const ShardFile& f = m.files[rank];
  const fs::path path = m.dir / f.path;
  std::error_code ec;
  SHARDOPT_CHECK(fs::exists(path, ec), Checkpoint,
                 "checkpoint: shard file {} of rank {} is missing (the manifest {} lists it)",
                 path.string(), rank, m.path.string());
  LoadedShard s;
  s.file = &f;
  s.bytes = read_bytes(path, fmt::format("shard file of rank {}", rank));
  SHARDOPT_CHECK(s.bytes.numel() == f.bytes, Checkpoint,
                 "checkpoint: shard file {} is {} bytes, but the manifest says {} (truncated or "
                 "replaced)",
                 path.string(), s.bytes.numel(), f.bytes);
  const uint32_t crc = crc_of(s.bytes);
  SHARDOPT_CHECK(crc == f.crc, Checkpoint,
                 "checkpoint: checksum mismatch in shard file {}: CRC-32 is {}, the manifest says "
                 "{}; the file is corrupt",
                 path.string(), crc_text(crc), crc_text(f.crc));
  const auto* h = static_cast<const char*>(s.bytes.data_ptr());
  uint32_t header[3];
  std::memcpy(header, h + 8, sizeof(header));
  SHARDOPT_CHECK(std::memcmp(h, kMagic, 8) == 0 && header[1] == static_cast<uint32_t>(rank) &&
                     header[2] == static_cast<uint32_t>(m.world),
                 Checkpoint, "checkpoint: {} is not rank {}'s shard of a {}-rank checkpoint",
                 path.string(), rank, m.world);
  return s;
}

// ---- what the optimizer holds ---------------------------------------------------------------

void check_checkpointable(ShardAccess& a) {
  SHARDOPT_CHECK(!a.has_factory_optimizer(), Unsupported,
                 "checkpoint: optimizers built from a ShardOptimizerFactory cannot be "
                 "checkpointed: their state lives inside the torch optimizer; use a native rule "
                 "(AdamW, Adam, SGD, Adagrad, RMSprop, Lamb)");
}

std::vector<std::string> optimizer_state_names(ShardAccess& a) {
  std::vector<std::string> names = state_names(a.group_rule(0));
  SHARDOPT_INTERNAL_ASSERT(static_cast<int>(names.size()) == a.state_buffer_count(),
                           "rule {} names {} state buffers, the engine keeps {}",
                           rule_name(a.group_rule(0)), names.size(), a.state_buffer_count());
  return names;
}

json build_manifest(ShardAccess& a, const std::vector<std::string>& names, const json& trainer,
                    const std::vector<json>& files) {
  const auto& layout = a.layout();
  const int world = a.comm()->size();
  json m;
  m["format"] = kFormat;
  m["format_version"] = kCheckpointFormatVersion;
  m["shardopt_version"] = version();
  m["world_size"] = world;
  m["stage"] = a.zero_options().stage;
  m["precision"] = to_string(a.zero_options().precision);
  m["dtype"] = dtype_name(a.master_dtype());
  m["step"] = a.step_count();
  json groups = json::array();
  for (int g = 0; g < a.group_count(); ++g) groups.push_back(rule_to_json(a.group_rule(g)));
  m["optimizer"] = {
      {"rule", rule_name(a.group_rule(0))}, {"state", names}, {"param_groups", groups}};
  m["loss_scaler"] = nullptr;  // fp16 stores its dynamic loss scaler here
  if (const auto scaler = a.loss_scaler_state()) {
    m["loss_scaler"] = {{"scale", scaler->scale},
                        {"good_steps", scaler->good_steps},
                        {"hysteresis_left", scaler->hysteresis_left},
                        {"overflows", scaler->overflows}};
  }
  json buckets = json::array();
  for (const auto& b : layout.buckets) {
    buckets.push_back({{"group", b.group},
                       {"flat_offset", b.flat_offset},
                       {"numel", b.numel},
                       {"padded", b.padded},
                       {"shard", b.shard},
                       {"shard_offset", b.shard_offset}});
  }
  m["layout"] = {{"numel", layout.numel},
                 {"padded_numel", layout.padded_numel},
                 {"shard_numel", layout.shard_numel},
                 {"buckets", buckets}};
  // Listed in the model's named_parameters() order, so a consolidated state dict reads like
  // model.state_dict(); pieces do not depend on the order.
  std::vector<int> order(layout.slots.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return a.param_order(x) < a.param_order(y); });
  json params = json::array();
  for (const int i : order) {
    const auto& slot = layout.slots[i];
    json pieces = json::array();
    for (const auto& p : detail::saved_pieces(layout, i, world)) {
      pieces.push_back({p.rank, p.shard_begin, p.param_begin, p.numel});
    }
    params.push_back({{"name", a.param_name(i)},
                      {"shape", a.param_shape(i)},
                      {"dtype", dtype_name(a.master_dtype())},
                      {"numel", slot.numel},
                      {"group", layout.buckets[slot.bucket].group},
                      {"bucket", slot.bucket},
                      {"offset", slot.offset},
                      {"flat_offset", layout.buckets[slot.bucket].flat_offset + slot.offset},
                      {"pieces", pieces}});
  }
  m["parameters"] = params;
  m["files"] = files;
  m["trainer"] = trainer;
  return m;
}

// Writes this rank's shard file into `tmp`; returns its manifest entry.
json write_shard(ShardAccess& a, const fs::path& tmp, const std::vector<std::string>& names,
                 const std::map<std::string, at::Tensor>& tensors) {
  const auto& layout = a.layout();
  const int rank = a.comm()->rank(), world = a.comm()->size();
  const std::string file = shard_file_name(rank, world);
  FileWriter w(tmp / file);
  char header[kAlign] = {};
  std::memcpy(header, kMagic, sizeof(kMagic));
  const uint32_t fields[3] = {static_cast<uint32_t>(kCheckpointFormatVersion),
                              static_cast<uint32_t>(rank), static_cast<uint32_t>(world)};
  std::memcpy(header + 8, fields, sizeof(fields));
  w.write(header, sizeof(header));
  json sections = json::array();
  auto shard_section = [&](const std::string& name, const std::function<at::Tensor(int)>& slice) {
    w.pad_to(kAlign);
    const int64_t offset = w.bytes();
    for (size_t b = 0; b < layout.buckets.size(); ++b) w.write_tensor(slice(static_cast<int>(b)));
    sections.push_back({{"name", name},
                        {"offset", offset},
                        {"dtype", dtype_name(a.master_dtype())},
                        {"shape", json::array({layout.shard_numel})}});
  };
  shard_section("param", [&](int b) { return a.owned_param_slice(b); });
  for (size_t k = 0; k < names.size(); ++k) {
    shard_section("state/" + names[k],
                  [&](int b) { return a.owned_state_slice(static_cast<int>(k), b); });
  }
  for (const auto& [key, t] : tensors) {
    w.pad_to(kAlign);
    const int64_t offset = w.bytes();
    w.write_tensor(t);
    sections.push_back({{"name", "trainer/" + key},
                        {"offset", offset},
                        {"dtype", dtype_name(t.scalar_type())},
                        {"shape", t.sizes().vec()}});
  }
  w.sync_and_close();
  return {{"rank", rank},
          {"path", file},
          {"bytes", w.bytes()},
          {"crc32", crc_text(w.crc())},
          {"sections", sections}};
}

// Makes `p.tmp` visible as `p.dir` with one rename (exchanging with the previous checkpoint).
void publish(const Paths& p) {
  std::error_code ec;
  if (!fs::exists(p.dir, ec)) {
    SHARDOPT_CHECK(::rename(p.tmp.c_str(), p.dir.c_str()) == 0, Checkpoint,
                   "checkpoint: cannot rename {} to {}: {}", p.tmp.string(), p.dir.string(),
                   errno_text());
    fsync_dir(p.parent);
    return;
  }
  if (::renameat2(AT_FDCWD, p.tmp.c_str(), AT_FDCWD, p.dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_dir(p.parent);
    fs::remove_all(p.tmp, ec);  // now the previous checkpoint
    return;
  }
  SHARDOPT_CHECK(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP, Checkpoint,
                 "checkpoint: cannot exchange {} with {}: {}", p.tmp.string(), p.dir.string(),
                 errno_text());
  // No RENAME_EXCHANGE on this filesystem: a crash between these renames leaves the previous
  // checkpoint at .<name>.old, which load_checkpoint points to.
  fs::remove_all(p.old, ec);
  SHARDOPT_CHECK(::rename(p.dir.c_str(), p.old.c_str()) == 0, Checkpoint,
                 "checkpoint: cannot rename {} to {}: {}", p.dir.string(), p.old.string(),
                 errno_text());
  SHARDOPT_CHECK(::rename(p.tmp.c_str(), p.dir.c_str()) == 0, Checkpoint,
                 "checkpoint: cannot rename {} to {}: {}", p.tmp.string(), p.dir.string(),
                 errno_text());
  fsync_dir(p.parent);
  fs::remove_all(p.old, ec);
}

// Rank 0, before a save: the parent exists, leftovers of a crashed save are gone, and an existing
// `dir` is a checkpoint (never replace a directory that is something else).
void prepare_tmp(const Paths& p) {
  std::error_code ec;
  fs::create_directories(p.parent, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot create directory {}: {}", p.parent.string(),
                 ec.message());
  if (fs::exists(p.dir, ec)) {
    SHARDOPT_CHECK(fs::is_directory(p.dir, ec), Checkpoint,
                   "checkpoint: {} exists and is not a directory; refusing to replace it",
                   p.dir.string());
    SHARDOPT_CHECK(fs::exists(p.dir / kManifest, ec) || fs::is_empty(p.dir, ec), Checkpoint,
                   "checkpoint: {} exists and is not a shardopt checkpoint (no {}); refusing to "
                   "replace it",
                   p.dir.string(), kManifest);
  }
  fs::remove_all(p.tmp, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot remove the leftover {}: {}", p.tmp.string(),
                 ec.message());
  fs::create_directory(p.tmp, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "checkpoint: cannot write to directory {} (creating {}): {}",
                 p.parent.string(), p.tmp.string(), ec.message());
}

// This rank's shard of parameters and state, staged before it replaces the optimizer's.
struct Staging {
  at::Tensor param;
  std::vector<at::Tensor> state;
};

// Starts from the current owned slices, so padding and anything not loaded keep their values.
Staging stage_current(ShardAccess& a, int states) {
  const auto& layout = a.layout();
  Staging s;
  auto gather = [&](const std::function<at::Tensor(int)>& slice) {
    at::Tensor out = at::empty({layout.shard_numel}, at::TensorOptions().dtype(a.master_dtype()));
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const auto& bl = layout.buckets[b];
      out.narrow(0, bl.shard_offset, bl.shard).copy_(slice(static_cast<int>(b)));
    }
    return out;
  };
  s.param = gather([&](int b) { return a.owned_param_slice(b); });
  for (int k = 0; k < states; ++k) {
    s.state.push_back(gather([&](int b) { return a.owned_state_slice(k, b); }));
  }
  return s;
}

// Replaces the optimizer's owned slices with the staged ones. Cannot fail on user input.
void commit(ShardAccess& a, const Staging& s) {
  const auto& layout = a.layout();
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bl = layout.buckets[b];
    a.owned_param_slice(static_cast<int>(b)).copy_(s.param.narrow(0, bl.shard_offset, bl.shard));
    for (size_t k = 0; k < s.state.size(); ++k) {
      a.owned_state_slice(static_cast<int>(k), static_cast<int>(b))
          .copy_(s.state[k].narrow(0, bl.shard_offset, bl.shard));
    }
  }
}

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
}

// The model's parameters in a full state: index in the layout -> tensor (checked).
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

// Copies this rank's owned elements of each parameter from full tensors into staging.
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

}  // namespace

// ---- save -----------------------------------------------------------------------------------

void save_checkpoint(DistributedOptimizer& optimizer, const std::string& dir,
                     const TrainerState& trainer, const SaveOptions& options) {
  ShardAccess& a = detail::shard_access(optimizer);
  Communicator& comm = *a.comm();
  const Duration timeout = a.zero_options().timeout;
  const int rank = comm.rank();
  at::NoGradGuard no_grad;
  Paths paths;
  std::vector<std::string> names;
  json trainer_json;
  const std::string what = fmt::format("saving checkpoint {}", dir);
  const std::string nothing = "the previous checkpoint is unchanged";

  // 1. Checks everywhere; rank 0 prepares the temporary directory.
  agree(comm, timeout, what, nothing, [&] {
    check_checkpointable(a);
    paths = paths_of(dir);
    names = optimizer_state_names(a);
    try {
      trainer_json = json::parse(trainer.json);
    } catch (const json::exception& e) {
      SHARDOPT_FAIL(InvalidArgument, "checkpoint: TrainerState::json is not valid JSON: {}",
                    e.what());
    }
    SHARDOPT_CHECK(trainer_json.is_object(), InvalidArgument,
                   "checkpoint: TrainerState::json must be a JSON object, got {}",
                   trainer_json.type_name());
    for (const auto& [key, t] : trainer.tensors) {
      SHARDOPT_CHECK(t.defined() && !key.empty(), InvalidArgument,
                     "checkpoint: TrainerState::tensors['{}'] is undefined or unnamed", key);
      dtype_name(t.scalar_type());
    }
    if (rank == 0) prepare_tmp(paths);
    return json();
  });

  // 2. Every rank writes and syncs its shard.
  const bool simulated = options.simulate_crash_after_shard_on_rank >= 0;
  const std::vector<json> files = agree(
      comm, timeout, what, nothing,
      [&] {
        json entry = write_shard(a, paths.tmp, names, trainer.tensors);
        SHARDOPT_CHECK(options.simulate_crash_after_shard_on_rank != rank, Checkpoint,
                       "checkpoint: simulated crash on rank {} after writing {} "
                       "(SaveOptions::simulate_crash_after_shard_on_rank)",
                       rank, (paths.tmp / entry.at("path").get<std::string>()).string());
        return entry;
      },
      [&] {
        std::error_code ec;
        if (rank == 0 && !simulated) fs::remove_all(paths.tmp, ec);  // a crash would leave it
      });

  // 3. Rank 0 writes the manifest and publishes the directory.
  agree(
      comm, timeout, what, nothing,
      [&] {
        if (rank != 0) return json();
        const json manifest = build_manifest(a, names, trainer_json, files);
        const std::string text = dump(manifest, 1);
        {
          FileWriter w(paths.tmp / kManifest);
          w.write(text.data(), text.size());
          w.sync_and_close();
        }
        fsync_dir(paths.tmp);
        publish(paths);
        return json();
      },
      [&] {
        std::error_code ec;
        if (rank == 0) fs::remove_all(paths.tmp, ec);
      });
}

// ---- load -----------------------------------------------------------------------------------

TrainerState load_checkpoint(DistributedOptimizer& optimizer, const std::string& dir,
                             const LoadOptions& options) {
  ShardAccess& a = detail::shard_access(optimizer);
  Communicator& comm = *a.comm();
  const int rank = comm.rank();
  at::NoGradGuard no_grad;
  Manifest m;
  Staging staging;
  TrainerState trainer;
  std::vector<Rule> rules;

  // 1. Everything that can fail, without touching the optimizer.
  agree(comm, a.zero_options().timeout, fmt::format("loading checkpoint {}", dir),
        "no rank changed its optimizer", [&] {
          check_checkpointable(a);
          m = read_manifest(dir);
          const std::vector<std::string> names = optimizer_state_names(a);
          check_same_model(a, m);
          check_same_optimizer(a, m, names);
          for (const auto& g : m.group_rules) {
            try {
              rules.push_back(rule_from_json(g));
            } catch (const json::exception& e) {
              SHARDOPT_FAIL(Checkpoint, "checkpoint: malformed param group in {}: {}",
                            m.path.string(), e.what());
            }
          }
          staging = stage_current(a, static_cast<int>(names.size()));
          // Which saved rank's file feeds which of my elements.
          std::map<int, std::vector<detail::CopyOp>> by_file;
          for (int i = 0; i < static_cast<int>(a.layout().slots.size()); ++i) {
            const auto& saved = m.params[m.by_name.at(a.param_name(i))].pieces;
            for (const auto& op : detail::plan_copies(a.layout(), rank, i, saved)) {
              by_file[op.src_rank].push_back(op);
            }
          }
          if (rank < m.world) by_file[rank];  // my trainer tensors
          for (const auto& [file_rank, ops] : by_file) {
            const LoadedShard shard = load_shard(m, file_rank);
            const at::Tensor param = shard.section("param");
            std::vector<at::Tensor> state;
            for (const auto& n : names) state.push_back(shard.section("state/" + n));
            for (const auto& op : ops) {
              staging.param.narrow(0, op.dst, op.numel).copy_(param.narrow(0, op.src, op.numel));
              for (size_t k = 0; k < state.size(); ++k) {
                staging.state[k]
                    .narrow(0, op.dst, op.numel)
                    .copy_(state[k].narrow(0, op.src, op.numel));
              }
            }
            if (file_rank == rank) {
              for (const auto& [name, section] : shard.file->sections) {
                if (name.rfind("trainer/", 0) == 0) {
                  trainer.tensors[name.substr(8)] = shard.section(name).clone();
                }
              }
            }
          }
          trainer.json = dump(m.j.at("trainer"));
          if (options.restore_hyperparameters) {
            for (size_t g = 0; g < rules.size(); ++g) {
              SHARDOPT_CHECK(
                  rule_name(rules[g]) == rule_name(a.group_rule(static_cast<int>(g))), Mismatch,
                  "checkpoint: {}: param group {} runs {}, this optimizer's {}", m.path.string(), g,
                  rule_name(rules[g]), rule_name(a.group_rule(static_cast<int>(g))));
            }
          }
          return json();
        });

  // 2. Every rank succeeded: replace the state.
  commit(a, staging);
  a.set_step_count(m.step);
  if (const auto it = m.j.find("loss_scaler"); it != m.j.end() && it->is_object()) {
    LossScaler::State scaler;
    scaler.scale = it->value("scale", 1.0);
    scaler.good_steps = it->value("good_steps", int64_t{0});
    scaler.hysteresis_left = it->value("hysteresis_left", 0);
    scaler.overflows = it->value("overflows", int64_t{0});
    a.set_loss_scaler_state(scaler);  // an fp16 optimizer continues with it; others ignore it
  }
  if (options.restore_hyperparameters) {
    for (size_t g = 0; g < rules.size(); ++g) a.set_group_rule(static_cast<int>(g), rules[g]);
  }
  a.after_load();
  return trainer;
}

// ---- inspection and consolidation (one process) -------------------------------------------

CheckpointInfo read_checkpoint_info(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  CheckpointInfo info;
  info.dir = dir;
  info.format_version = m.j.at("format_version").get<int>();
  info.world_size = m.world;
  info.stage = m.stage;
  info.precision = m.j.value("precision", "");
  info.step = m.step;
  info.rule = m.rule;
  info.state_names = m.state_names;
  for (const auto& p : m.params)
    info.params.push_back({p.name, p.shape, dtype_name(m.dtype), p.group});
  info.trainer_json = dump(m.j.at("trainer"));
  info.manifest_json = dump(m.j, 1);
  return info;
}

FullState read_full_state(const std::string& dir, bool with_optimizer_state) {
  const Manifest m = read_manifest(dir);
  const auto opts = at::TensorOptions().dtype(m.dtype);
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> states(with_optimizer_state ? m.state_names.size() : 0);
  for (const auto& p : m.params) {
    params.push_back(at::empty(p.shape, opts));
    for (auto& s : states) s.push_back(at::empty(p.shape, opts));
  }
  for (int r = 0; r < m.world; ++r) {
    const LoadedShard shard = load_shard(m, r);
    const at::Tensor param = shard.section("param");
    std::vector<at::Tensor> state;
    for (size_t k = 0; k < states.size(); ++k) {
      state.push_back(shard.section("state/" + m.state_names[k]));
    }
    for (size_t i = 0; i < m.params.size(); ++i) {
      for (const auto& piece : m.params[i].pieces) {
        if (piece.rank != r) continue;
        params[i]
            .view({-1})
            .narrow(0, piece.param_begin, piece.numel)
            .copy_(param.narrow(0, piece.shard_begin, piece.numel));
        for (size_t k = 0; k < states.size(); ++k) {
          states[k][i]
              .view({-1})
              .narrow(0, piece.param_begin, piece.numel)
              .copy_(state[k].narrow(0, piece.shard_begin, piece.numel));
        }
      }
    }
  }
  FullState out;
  for (size_t i = 0; i < m.params.size(); ++i) out.params.insert(m.params[i].name, params[i]);
  for (size_t k = 0; k < states.size(); ++k) {
    auto& dict = out.optimizer_state[m.state_names[k]];
    for (size_t i = 0; i < m.params.size(); ++i) dict.insert(m.params[i].name, states[k][i]);
  }
  out.step = m.step;
  out.rule = m.rule;
  out.hyperparameters_json = dump(m.j.at("optimizer").at("param_groups"));
  return out;
}

void consolidate_checkpoint(const std::string& dir, const std::string& out,
                            const ConsolidateOptions& options) {
  const FullState full = read_full_state(dir, !options.optimizer_state_out.empty());
  c10::Dict<std::string, at::Tensor> model;
  for (const auto& item : full.params) model.insert(item.key(), item.value());
  const std::vector<char> bytes = detail::torch_save_bytes(c10::IValue(model));
  write_file_atomically(out, bytes.data(), bytes.size());
  if (options.optimizer_state_out.empty()) return;
  c10::Dict<std::string, c10::Dict<std::string, at::Tensor>> state;
  for (const auto& item : full.params) {
    c10::Dict<std::string, at::Tensor> buffers;
    for (const auto& [name, dict] : full.optimizer_state) buffers.insert(name, dict[item.key()]);
    state.insert(item.key(), buffers);
  }
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert(std::string("format"), std::string(kOptimizerFormat));
  top.insert(std::string("format_version"), static_cast<int64_t>(kCheckpointFormatVersion));
  top.insert(std::string("step"), full.step);
  top.insert(std::string("rule"), full.rule);
  top.insert(std::string("param_groups"), full.hyperparameters_json);
  top.insert(std::string("state"), c10::IValue(state));
  const std::vector<char> obytes = detail::torch_save_bytes(c10::IValue(top));
  write_file_atomically(options.optimizer_state_out, obytes.data(), obytes.size());
}

// ---- full state -> sharded run ---------------------------------------------------------------

std::vector<std::string> load_full_state(DistributedOptimizer& optimizer, const FullState& state) {
  ShardAccess& a = detail::shard_access(optimizer);
  Communicator& comm = *a.comm();
  at::NoGradGuard no_grad;
  Staging staging;
  std::vector<std::string> unused;
  const bool with_state = !state.optimizer_state.empty();
  agree(comm, a.zero_options().timeout, "loading a full state dict",
        "no rank changed its optimizer", [&] {
          std::vector<std::string> names;
          if (with_state) {
            check_checkpointable(a);
            names = optimizer_state_names(a);
            SHARDOPT_CHECK(state.rule == rule_name(a.group_rule(0)), Mismatch,
                           "checkpoint: the optimizer state is of {}, this optimizer runs {}",
                           state.rule, rule_name(a.group_rule(0)));
          }
          const std::vector<at::Tensor> full = match_full_params(a, state.params, "the state dict");
          staging = stage_current(a, static_cast<int>(names.size()));
          stage_from_full(a, staging.param, full);
          for (size_t k = 0; k < names.size(); ++k) {
            auto it = state.optimizer_state.find(names[k]);
            SHARDOPT_CHECK(it != state.optimizer_state.end(), Mismatch,
                           "checkpoint: the optimizer state has no '{}' buffers ({} keeps {})",
                           names[k], rule_name(a.group_rule(0)), fmt::join(names, ", "));
            stage_from_full(
                a, staging.state[k],
                match_full_params(a, it->second, fmt::format("optimizer state '{}'", names[k])));
          }
          std::set<std::string> mine;
          for (int i = 0; i < static_cast<int>(a.layout().slots.size()); ++i)
            mine.insert(a.param_name(i));
          for (const auto& item : state.params) {
            if (!mine.count(item.key())) unused.push_back(item.key());
          }
          return json();
        });
  commit(a, staging);
  if (with_state) a.set_step_count(state.step);
  a.after_load();
  return unused;
}

std::vector<std::string> load_full_state_dict(
    DistributedOptimizer& optimizer, const torch::OrderedDict<std::string, at::Tensor>& params) {
  FullState state;
  state.params = params;
  return load_full_state(optimizer, state);
}

namespace {
c10::IValue pickle_load_file(const std::string& path, const std::string& what) {
  const at::Tensor bytes = read_bytes(path, what);
  const auto* p = static_cast<const char*>(bytes.data_ptr());
  try {
    return torch::jit::pickle_load(std::vector<char>(p, p + bytes.numel()));
  } catch (const std::exception& e) {
    const std::string why = e.what();
    SHARDOPT_FAIL(Checkpoint,
                  "checkpoint: {} {} could not be read as a torch.save/pickle_save "
                  "file of a dict: {}. From Python, save a plain dict: torch.save(dict("
                  "model.state_dict()), path) (libtorch does not unpickle collections.OrderedDict)",
                  what, path, why.substr(0, why.find('\n')));
  }
}

torch::OrderedDict<std::string, at::Tensor> tensor_dict(const c10::IValue& v,
                                                        const std::string& what) {
  SHARDOPT_CHECK(v.isGenericDict(), Checkpoint,
                 "checkpoint: {} does not hold a dict, but {}. From Python, save a plain dict: "
                 "torch.save(dict(model.state_dict()), path) (libtorch reads "
                 "collections.OrderedDict as None)",
                 what, v.tagKind());
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& entry : v.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor()) continue;
    out.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}
}  // namespace

std::vector<std::string> load_full_state_dict(DistributedOptimizer& optimizer,
                                              const std::string& model_file,
                                              const std::string& optimizer_file) {
  ShardAccess& a = detail::shard_access(optimizer);
  FullState state;
  // Reading is local: agree on it before anyone goes on to the collective load.
  agree(*a.comm(), a.zero_options().timeout, "reading a full state dict",
        "no rank changed its optimizer", [&] {
          state.params = tensor_dict(pickle_load_file(model_file, "model state file"), model_file);
          if (!optimizer_file.empty()) {
            const c10::IValue v = pickle_load_file(optimizer_file, "optimizer state file");
            SHARDOPT_CHECK(v.isGenericDict(), Checkpoint, "checkpoint: {} does not hold a dict",
                           optimizer_file);
            const auto top = v.toGenericDict();
            SHARDOPT_CHECK(top.contains("format") && top.at("format").isString() &&
                               top.at("format").toStringRef() == kOptimizerFormat,
                           Checkpoint, "checkpoint: {} is not a shardopt optimizer state file",
                           optimizer_file);
            state.step = top.at("step").toInt();
            state.rule = top.at("rule").toStringRef();
            for (const auto& entry : top.at("state").toGenericDict()) {
              const std::string param = entry.key().toStringRef();
              for (const auto& buffer : entry.value().toGenericDict()) {
                state.optimizer_state[buffer.key().toStringRef()].insert(param,
                                                                         buffer.value().toTensor());
              }
            }
          }
          return json();
        });
  return load_full_state(optimizer, state);
}

// ---- DistributedOptimizer shorthands ----------------------------------------------------------

void DistributedOptimizer::save_checkpoint(const std::string& dir) {
  shardopt::save_checkpoint(*this, dir);
}
void DistributedOptimizer::load_checkpoint(const std::string& dir) {
  shardopt::load_checkpoint(*this, dir);
}

}  // namespace shardopt
