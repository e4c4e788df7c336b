// In-memory snapshots with a buddy copy: Note [Snapshots in memory] (shardopt/snapshot.hpp).
#include "shardopt/snapshot.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstring>
#include <chrono>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/snapshot_record.hpp"
#include "checkpoint/snapshot_slot.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/job.hpp"

namespace shardopt {

namespace {

namespace fs = std::filesystem;
using detail::json;
using detail::kSnapshotFormat;
using detail::ShardAccess;
using detail::SlotFile;
using detail::SlotPrefix;
using Clock = std::chrono::steady_clock;

constexpr int64_t kChunkBytes = int64_t{1} << 30;  // MPI counts are ints

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the calling thread (seconds).
double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

int64_t payload_bytes(ShardAccess& a) { return detail::snapshot_payload_bytes(a); }

// The payload as [sections, shard_numel]: the parameters, then each state buffer.
at::Tensor payload_view(ShardAccess& a, uint8_t* payload) {
  return at::from_blob(payload, {1 + a.state_buffer_count(), a.layout().shard_numel},
                       at::TensorOptions().dtype(a.master_dtype()));
}

at::Tensor bytes_of(const void* p, int64_t n) {
  return at::from_blob(const_cast<void*>(p), {n}, at::kByte);  // NOLINT: sent, never written
}

struct Marker {
  int64_t number = -1, world = 0;
};

Marker read_marker(const fs::path& path) {
  Marker m;
  std::ifstream in(path);
  if (!(in >> m.number >> m.world)) return {};
  return m;
}

// The newest commit marker in `dir`, whichever rank wrote it: after a change of world size the
// ranks of this host may be others than those that committed (Note [Snapshots at another world
// size]).
Marker newest_marker(const fs::path& dir) {
  Marker newest;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("rank", 0) != 0 || name.size() < 11 ||
        name.compare(name.size() - 7, 7, ".commit") != 0) {
      continue;
    }
    const Marker m = read_marker(it->path());
    if (m.number > newest.number) newest = m;
  }
  return newest;
}

// After this world's first commit, the files of ranks an older world had and this one has not
// (rank<q>.*, copy-of-rank<q>.* for q >= world; every copy when there are no buddies) hold
// nothing a restore will read (the newest commit is this world's): tmpfs gives their memory back.
// Other names are left alone. Ranks sharing the directory may race here: a missing file is fine.
void sweep_stale(const fs::path& dir, int world, bool buddies) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool copy = name.rfind("copy-of-rank", 0) == 0;
    const size_t digits = copy ? 12 : name.rfind("rank", 0) == 0 ? 4 : std::string::npos;
    if (digits == std::string::npos) continue;
    size_t end_digits = digits;
    while (end_digits < name.size() && std::isdigit(static_cast<unsigned char>(name[end_digits]))) {
      ++end_digits;
    }
    const std::string rest = name.substr(end_digits);
    const bool ours = rest == ".slot0" || rest == ".slot1" || (!copy && rest == ".commit");
    if (end_digits == digits || end_digits - digits > 9 || !ours) continue;
    const int q = std::stoi(name.substr(digits, end_digits - digits));
    if (q >= world || (copy && !buddies)) stale.push_back(it->path());
  }
  for (const fs::path& p : stale) fs::remove(p, ec);
}

void write_marker(const fs::path& path, int64_t number, int world, int64_t steps) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << number << ' ' << world << ' ' << steps << '\n';
    SHARDOPT_CHECK(out.flush().good(), Checkpoint, "snapshot: cannot write {}", tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  SHARDOPT_CHECK(!ec, Checkpoint, "snapshot: cannot rename {}: {}", tmp.string(), ec.message());
}

}  // namespace

struct MemorySnapshots::State {
  ShardAccess& a;
  CommunicatorPtr world;  // private: the background's collectives never meet the training's
  int rank = 0, size = 1, per_host = 1;
  int buddy = -1;   // holds this rank's copies
  int holder = -1;  // the rank whose copies this one holds
  fs::path dir;
  std::unique_ptr<SlotFile> own[2], copy[2];
  int64_t next_number = 0;
  std::thread thread;
  std::exception_ptr failure;
  bool swept = false;  // the files of ranks of an older, larger world removed (background)
  mutable std::mutex mutex;  // guards timing
  SnapshotTiming timing;
  json layout;  // the saving layout every record carries (detail::snapshot_layout)

  explicit State(ShardAccess& access) : a(access) {}
  fs::path marker() const { return dir / fmt::format("rank{}.commit", rank); }
  void join() {
    if (thread.joinable()) thread.join();
  }
  // The slots' host memory: this rank's two and the two copies it holds.
  int64_t host_bytes() const {
    int64_t n = 0;
    for (const auto& slot : {own[0].get(), own[1].get(), copy[0].get(), copy[1].get()}) {
      if (slot != nullptr && slot->mapped_payload() > 0) n += slot->mapped_payload() + detail::kSlotPrefixBytes;
    }
    return n;
  }
  // Tells the optimizer, whose memory() reports it, after every mapping.
  void report_host_bytes() { a.set_snapshot_host_bytes(host_bytes()); }
  void background(int64_t number, std::string tail, int64_t json_bytes, int64_t steps,
                  const std::array<uint32_t, 4>& payload_crc);
  void exchange(SlotFile* from, const std::string& from_tail, int to, SlotFile* into, int src,
                const std::string& what);
};

// Sends slot `from` (prefix, payload, tail) to `to` while receiving into `into` from `src` (-1:
// none), every rank at once. The receiving slot is invalid from the start and gets its prefix
// last. Collective over `world`; failures are agreed.
void MemorySnapshots::State::exchange(SlotFile* from, const std::string& from_tail, int to,
                                      SlotFile* into, int src, const std::string& what) {
  at::Tensor mine = at::zeros({2}, at::kLong), theirs = at::zeros({2}, at::kLong);
  std::vector<P2pOp> ops;
  if (from != nullptr) {
    mine[0] = from->mapped_payload();
    mine[1] = static_cast<int64_t>(from_tail.size());
    ops.push_back(P2pOp::send(mine, to));
  }
  if (into != nullptr) ops.push_back(P2pOp::recv(theirs, src));
  if (!ops.empty()) world->batch_isend_irecv(ops)->wait(world->timeout());
  const int64_t their_payload = theirs[0].item<int64_t>(), their_tail = theirs[1].item<int64_t>();
  agree_on_errors(*world, what + ": making room for the copy", [&] {
    if (into == nullptr) return;
    into->map(their_payload);
    into->invalidate();
    report_host_bytes();
  });
  at::Tensor tail_in = at::empty({their_tail}, at::kByte);
  at::Tensor prefix_in = at::empty({detail::kSlotPrefixBytes}, at::kByte);
  ops.clear();
  if (from != nullptr) {
    for (int64_t at = 0; at < from->mapped_payload(); at += kChunkBytes) {
      ops.push_back(P2pOp::send(
          bytes_of(from->payload() + at, std::min(kChunkBytes, from->mapped_payload() - at)), to));
    }
    ops.push_back(P2pOp::send(bytes_of(from_tail.data(), static_cast<int64_t>(from_tail.size())), to));
    ops.push_back(P2pOp::send(bytes_of(from->prefix(), detail::kSlotPrefixBytes), to));
  }
  if (into != nullptr) {
    for (int64_t at = 0; at < their_payload; at += kChunkBytes) {
      ops.push_back(P2pOp::recv(
          bytes_of(into->payload() + at, std::min(kChunkBytes, their_payload - at)), src));
    }
    ops.push_back(P2pOp::recv(tail_in, src));
    ops.push_back(P2pOp::recv(prefix_in, src));
  }
  if (!ops.empty()) world->batch_isend_irecv(ops)->wait(world->timeout());
  agree_on_errors(*world, what + ": writing the copy", [&] {
    if (into == nullptr) return;
    into->write_tail(std::string(reinterpret_cast<const char*>(tail_in.data_ptr<uint8_t>()),
                                 static_cast<size_t>(their_tail)));
    std::array<uint8_t, detail::kSlotPrefixBytes> prefix{};
    std::memcpy(prefix.data(), prefix_in.data_ptr<uint8_t>(), prefix.size());
    into->write_prefix(prefix);
  });
}

// The background half of snapshot(): checksum and close the slot, exchange with the buddy, agree,
// commit.
void MemorySnapshots::State::background(int64_t number, std::string tail, int64_t json_bytes,
                                        int64_t steps, const std::array<uint32_t, 4>& payload_crc) {
  const std::string what = fmt::format("snapshot {}", number);
  SlotFile& slot = *own[number % 2];
  agree_on_errors(*world, what + ": closing this rank's slot", [&] {
    SlotPrefix p;
    p.number = number;
    p.payload_bytes = slot.mapped_payload();
    p.tail_bytes = static_cast<int64_t>(tail.size());
    p.json_bytes = json_bytes;
    p.payload_crc = payload_crc;  // computed by the copy (Note [Snapshots in memory])
    p.tail_crc = detail::crc32c(tail.data(), p.tail_bytes);
    slot.write_tail(tail);
    slot.write_prefix(detail::encode_prefix(p));
  });
  if (buddy >= 0) {
    exchange(&slot, tail, buddy, copy[number % 2].get(), holder, what);
  }
  // Every rank has both copies: the job's commit (Note [Snapshots in memory]).
  agree_on_errors(*world, what + ": committing", [&] { write_marker(marker(), number, size, steps); });
  if (!swept) sweep_stale(dir, size, buddy >= 0);
  swept = true;
}

MemorySnapshots::MemorySnapshots(DistributedOptimizer& optimizer, const CommunicatorPtr& world,
                                 const SnapshotOptions& options)
    : state_(std::make_unique<State>(detail::shard_access(optimizer))) {
  State& s = *state_;
  SHARDOPT_CHECK(world != nullptr, InvalidArgument, "snapshot: MemorySnapshots needs the world");
  SHARDOPT_CHECK(!options.dir.empty(), InvalidArgument,
                 "snapshot: SnapshotOptions::dir is empty; give a directory on tmpfs, e.g. "
                 "/dev/shm/shardopt-<job>");
  SHARDOPT_CHECK(!s.a.has_factory_optimizer(), Unsupported,
                 "snapshot: a ShardOptimizerFactory's state lives inside the torch optimizer; "
                 "snapshots take native rules only (as checkpoints do)");
  // Its state is not one element per parameter element (Note [Quantised state in checkpoints]).
  SHARDOPT_CHECK(!std::holds_alternative<AdamW8bit>(s.a.group_rule(0)), Unsupported,
                 "snapshot: adamw8bit's quantised state is not held by snapshots yet (its "
                 "checkpoints hold it)");
  SHARDOPT_CHECK(options.ranks_per_host >= 0, InvalidArgument,
                 "snapshot: SnapshotOptions::ranks_per_host must be >= 0, got {}",
                 options.ranks_per_host);
  s.rank = world->rank();
  s.size = world->size();
  int per_host = options.ranks_per_host;
  if (per_host == 0) {
    per_host = world->split_by_host()->size();
    at::Tensor both = at::tensor({int64_t{per_host}, -int64_t{per_host}}, at::kLong);
    world->all_reduce(both, ReduceOp::Max);
    SHARDOPT_CHECK(both[0].item<int64_t>() == -both[1].item<int64_t>(), InvalidArgument,
                   "snapshot: hosts run {} to {} ranks; buddies need the same number on every "
                   "host (or SnapshotOptions::ranks_per_host)",
                   -both[1].item<int64_t>(), both[0].item<int64_t>());
  }
  SHARDOPT_CHECK(s.size % per_host == 0, InvalidArgument,
                 "snapshot: ranks_per_host {} does not divide the world's {} ranks", per_host,
                 s.size);
  s.per_host = per_host;
  if (per_host < s.size) {
    s.buddy = (s.rank + per_host) % s.size;
    s.holder = (s.rank - per_host + s.size) % s.size;
  }
  s.dir = options.dir;
  s.layout = detail::snapshot_layout(s.a);
  agree_on_errors(*world, "snapshot: making " + s.dir.string(), [&] {
    std::error_code ec;
    fs::create_directories(s.dir, ec);
    SHARDOPT_CHECK(!ec && fs::is_directory(s.dir), Checkpoint,
                   "snapshot: cannot make the directory {}: {}", s.dir.string(), ec.message());
  });
  for (int k = 0; k < 2; ++k) {
    s.own[k] = std::make_unique<SlotFile>((s.dir / fmt::format("rank{}.slot{}", s.rank, k)).string());
    if (s.holder >= 0) {
      s.copy[k] = std::make_unique<SlotFile>(
          (s.dir / fmt::format("copy-of-rank{}.slot{}", s.holder, k)).string());
    }
  }
  // Said once, by rank 0, where it costs (a buddy, 64 MiB up): Note [Huge pages for the slots].
  static std::atomic<bool> said{false};
  if (s.rank == 0 && s.buddy >= 0 && payload_bytes(s.a) >= (int64_t{64} << 20) &&
      detail::tmpfs_without_huge_pages(s.dir.string()) && !said.exchange(true)) {
    fmt::print(stderr,
               "shardopt: snapshot: {} is on a tmpfs without huge pages; the buddy exchange takes "
               "about 1.7x the CPU there (mount a tmpfs with -o huge=within_size for the slots; "
               "docs/recovery.md)\n",
               s.dir.string());
  }
  s.world = world->split(0, s.rank);
  // Numbers keep rising over restarts, so that an older commit never outranks a newer one.
  at::Tensor newest = at::tensor({newest_marker(s.dir).number}, at::kLong);
  s.world->all_reduce(newest, ReduceOp::Max);
  s.next_number = newest.item<int64_t>() + 1;
}

MemorySnapshots::~MemorySnapshots() { state_->join(); }

void MemorySnapshots::wait() {
  State& s = *state_;
  s.join();
  if (s.failure) std::rethrow_exception(std::exchange(s.failure, nullptr));
}

void MemorySnapshots::snapshot(const TrainerState& trainer) {
  const auto t0 = Clock::now();
  const double cpu0 = thread_cpu_s();
  wait();
  State& s = *state_;
  ShardAccess& a = s.a;
  const int64_t number = s.next_number++;
  SlotFile& slot = *s.own[number % 2];
  // Mapping may fail (a full tmpfs), once per slot: every rank maps its slot k at the same call,
  // so the agreement (a collective) is skipped alike on every rank once both are mapped.
  if (slot.mapped_payload() != payload_bytes(a)) {
    agree_on_errors(*s.world, fmt::format("snapshot {}: mapping {}", number, slot.path()),
                    [&] { slot.map(payload_bytes(a)); });
    s.report_host_bytes();
  }
  slot.invalidate();
  std::array<uint32_t, 4> payload_crc{};
  {  // the step waits for this copy only, checksummed on the way (one pass over the bytes)
    at::NoGradGuard no_grad;
    const int64_t elem = static_cast<int64_t>(c10::elementSize(a.master_dtype()));
    const int64_t section = a.layout().shard_numel * elem;
    detail::PayloadChecksum sum(slot.payload(), slot.mapped_payload());
    for (size_t b = 0; b < a.layout().buckets.size(); ++b) {
      const auto& bl = a.layout().buckets[b];
      const int bucket = static_cast<int>(b);
      for (int k = 0; k <= a.state_buffer_count(); ++k) {
        at::Tensor src = k == 0 ? a.owned_param_slice(bucket) : a.owned_state_slice(k - 1, bucket);
        SHARDOPT_INTERNAL_ASSERT(src.numel() == bl.shard, "snapshot: bucket {} section {} holds {} "
                                 "elements, its shard {}", b, k, src.numel(), bl.shard);
        if (!src.device().is_cpu() || !src.is_contiguous() ||
            src.scalar_type() != a.master_dtype()) {
          src = src.to(at::kCPU, a.master_dtype()).contiguous();  // one run of host bytes
        }
        sum.copy(k * section + bl.shard_offset * elem, src.data_ptr(), bl.shard * elem);
      }
    }
    payload_crc = sum.finish();
  }
  json record = {{"format", kSnapshotFormat},    {"version", 1},
                 {"number", number},             {"steps", a.step_count()},
                 {"fingerprint", detail::snapshot_fingerprint(a, s.size, s.rank)},
                 {"layout", s.layout},
                 {"trainer_json", trainer.json}, {"loss_scaler", nullptr}};
  for (int g = 0; g < a.group_count(); ++g) record["rules"].push_back(detail::rule_to_json(a.group_rule(g)));
  if (const auto scaler = a.loss_scaler_state()) {
    record["loss_scaler"] = {{"scale", scaler->scale}, {"good_steps", scaler->good_steps},
                             {"hysteresis_left", scaler->hysteresis_left},
                             {"overflows", scaler->overflows}};
  }
  std::string tensor_bytes;
  record["tensors"] = json::array();
  for (const auto& [key, value] : trainer.tensors) {
    const at::Tensor t = value.detach().to(at::kCPU).contiguous();
    record["tensors"].push_back({{"key", key},
                                 {"dtype", detail::dtype_name(t.scalar_type())},
                                 {"shape", t.sizes().vec()},
                                 {"offset", tensor_bytes.size()},
                                 {"bytes", t.nbytes()}});
    tensor_bytes.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  std::string tail = detail::dump(record);
  const auto json_bytes = static_cast<int64_t>(tail.size());
  tail += tensor_bytes;
  const int64_t steps = a.step_count();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.timing = {seconds_since(t0), 0, thread_cpu_s() - cpu0, 0};
  }
  s.thread = std::thread([&s, number, tail = std::move(tail), json_bytes, steps,
                          payload_crc]() mutable {
    const auto start = Clock::now();
    const double cpu_start = thread_cpu_s();
    try {
      s.background(number, std::move(tail), json_bytes, steps, payload_crc);
    } catch (...) {
      s.failure = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(s.mutex);
    s.timing.background_s = seconds_since(start);
    s.timing.background_cpu_s = thread_cpu_s() - cpu_start;
  });
}

// ---- restore ------------------------------------------------------------------------------------

namespace {

using Staged = detail::StagedSnapshot;

// Reads and verifies this rank's record of snapshot `number` from `slot`.
Staged stage_record(ShardAccess& a, SlotFile& slot, int64_t number, int world, int rank) {
  const std::string where = slot.path();
  const auto p = slot.read_prefix();
  SHARDOPT_CHECK(!p || p->number != number || p->payload_bytes == payload_bytes(a), Mismatch,
                 "snapshot: {} holds {} bytes of state, this optimizer {}: another model or "
                 "layout wrote it (clear the snapshot directory)",
                 where, p ? p->payload_bytes : 0, payload_bytes(a));
  const detail::SnapshotRecord record = detail::open_snapshot_record(slot, number);
  const json now = detail::snapshot_fingerprint(a, world, rank);
  for (const auto& [key, value] : now.items()) {
    const json saved = record.j.at("fingerprint").value(key, json());
    SHARDOPT_CHECK(saved == value, Mismatch,
                   "snapshot: {} was written with {} = {}, this job has {}: another model, stage "
                   "or layout (clear the snapshot directory to start afresh)",
                   where, key, saved.dump(), value.dump());
  }
  return detail::parse_snapshot_record(a, record, where, /*with_tensors=*/true);
}

}  // namespace

std::optional<TrainerState> MemorySnapshots::restore(RestoreReport* report) {
  const auto t0 = Clock::now();
  wait();
  State& s = *state_;
  RestoreReport r;
  // 1. What this host holds for this rank and for the rank whose copies it keeps.
  auto number_in = [](const std::unique_ptr<SlotFile>& slot) -> int64_t {
    if (!slot) return -1;
    const auto p = slot->read_prefix();
    return p ? p->number : -1;
  };
  const Marker marker = newest_marker(s.dir);
  at::Tensor mine = at::tensor({marker.number, marker.world, number_in(s.own[0]),
                                number_in(s.own[1]), number_in(s.copy[0]), number_in(s.copy[1])},
                               at::kLong);
  constexpr int kFields = 6;
  at::Tensor all = at::empty({s.size * kFields}, at::kLong);
  s.world->all_gather(mine, all);
  auto field = [&](int rank, int k) { return all[rank * kFields + k].item<int64_t>(); };
  // 2. The newest snapshot any rank committed, and where each rank's record of it is.
  int64_t number = -1, saved_by = 0;
  for (int q = 0; q < s.size; ++q) {
    if (field(q, 0) <= number) continue;
    number = field(q, 0);
    saved_by = field(q, 1);
  }
  if (number >= 0) r.saved_world = static_cast<int>(saved_by);
  std::vector<int> source(static_cast<size_t>(s.size), -1);
  bool elsewhere = false;  // a record neither on its rank's host nor on its buddy's
  if (number >= 0 && saved_by == s.size) {
    const int k = static_cast<int>(number % 2);
    for (int q = 0; q < s.size; ++q) {
      const int buddy = s.buddy >= 0 ? (q + s.per_host) % s.size : -1;
      if (field(q, 2 + k) == number) {
        source[static_cast<size_t>(q)] = q;
      } else if (buddy >= 0 && field(buddy, 4 + k) == number) {
        source[static_cast<size_t>(q)] = buddy;
        ++r.from_buddy;
      } else {
        elsewhere = true;
      }
    }
  }
  // Another world, or ranks placed on other hosts than their records: the records are served by
  // whoever holds them, resharded (Note [Snapshots at another world size]).
  if (number >= 0 && (saved_by != s.size || elsewhere)) {
    r.from_buddy = 0;
    auto t = detail::restore_resharded(s.a, *s.world, s.dir, number, static_cast<int>(saved_by),
                                       &r);
    if (t) s.next_number = std::max(s.next_number, number + 1);
    r.seconds = seconds_since(t0);
    if (report != nullptr) *report = r;
    return t;
  }
  if (number < 0) r.reason = fmt::format("no snapshot in {}", s.dir.string());
  if (!r.reason.empty()) {
    r.seconds = seconds_since(t0);
    if (report != nullptr) *report = r;
    return std::nullopt;
  }
  const int k = static_cast<int>(number % 2);
  const std::string what = fmt::format("restoring snapshot {}", number);
  // 3. Ranks whose host lost its memory get their record from the buddy.
  if (r.from_buddy > 0) {
    const bool send = s.holder >= 0 && source[static_cast<size_t>(s.holder)] == s.rank;
    const bool receive = source[static_cast<size_t>(s.rank)] != s.rank;
    std::string tail;
    agree_on_errors(*s.world, what + ": reading the copy to send", [&] {
      if (!send) return;
      SlotFile& held = *s.copy[k];
      const auto p = held.read_prefix();
      SHARDOPT_CHECK(p && p->number == number, Checkpoint, "snapshot: {} lost snapshot {}",
                     held.path(), number);
      held.map(p->payload_bytes);
      tail = held.read_tail(*p);
    });
    s.exchange(send ? s.copy[k].get() : nullptr, tail, s.holder, receive ? s.own[k].get() : nullptr,
               s.buddy, what);
  }
  // 4. Every rank checks its record; only then does any optimizer change.
  Staged staged;
  agree_on_errors(*s.world, what, [&] { staged = stage_record(s.a, *s.own[k], number, s.size, s.rank); });
  {
    at::NoGradGuard no_grad;
    ShardAccess& a = s.a;
    at::Tensor view = payload_view(a, s.own[k]->payload());
    for (size_t b = 0; b < a.layout().buckets.size(); ++b) {
      const auto& bl = a.layout().buckets[b];
      const int bucket = static_cast<int>(b);
      a.owned_param_slice(bucket).copy_(view[0].narrow(0, bl.shard_offset, bl.shard));
      for (int q = 0; q < a.state_buffer_count(); ++q) {
        a.owned_state_slice(q, bucket).copy_(view[q + 1].narrow(0, bl.shard_offset, bl.shard));
      }
    }
    a.set_step_count(staged.steps);
    for (int g = 0; g < a.group_count(); ++g) a.set_group_rule(g, staged.rules[static_cast<size_t>(g)]);
    if (staged.scaler) a.set_loss_scaler_state(*staged.scaler);
    a.after_load();
  }
  s.next_number = std::max(s.next_number, number + 1);
  s.report_host_bytes();
  r.restored = true;
  r.saved_world = s.size;
  r.number = number;
  r.step = staged.steps;
  r.seconds = seconds_since(t0);
  if (report != nullptr) *report = r;
  return std::move(staged.trainer);
}

void MemorySnapshots::remove() {
  wait();
  State& s = *state_;
  s.world->barrier();  // every rank's exchange is over: no slot is read or written any more
  std::error_code ec;
  for (int k = 0; k < 2; ++k) {
    for (auto* slot : {&s.own[k], &s.copy[k]}) {
      if (!*slot) continue;
      const std::string path = (*slot)->path();
      *slot = std::make_unique<SlotFile>(path);  // unmapped
      fs::remove(path, ec);
    }
  }
  fs::remove(s.marker(), ec);
  s.report_host_bytes();
  s.world->barrier();
  fs::remove(s.dir, ec);  // only when empty: another job's files, or a peer's, keep it
}

SnapshotTiming MemorySnapshots::last_timing() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->timing;
}

int64_t MemorySnapshots::host_bytes() const { return state_->host_bytes(); }

int MemorySnapshots::buddy() const { return state_->buddy; }

}  // namespace shardopt
