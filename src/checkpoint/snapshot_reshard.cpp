// Restoring an in-memory snapshot at another world size: Note [Snapshots at another world size]
// (shardopt/snapshot.hpp). The index maths is the disk checkpoint's (saved_pieces, plan_copies in
// shardopt/detail/shard_plan.hpp); only the source differs: a slice of a record mapped on some
// rank's host, sent over the communicator.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not reached through ATen.h on torch 2.6
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "checkpoint/snapshot_record.hpp"
#include "checkpoint/staging.hpp"  // state_sections
#include "shardopt/detail/shard_plan.hpp"
#include "shardopt/error.hpp"
#include "shardopt/job.hpp"

namespace shardopt::detail {

namespace {

namespace fs = std::filesystem;
constexpr int64_t kChunkBytes = int64_t{1} << 30;  // MPI counts are ints

// Where this rank's directory holds old rank q's record of snapshot `number`.
enum Held : int64_t { kNone = 0, kCopy = 1, kOwn = 2 };

fs::path held_path(const fs::path& dir, Held held, int q, int64_t number) {
  return dir / fmt::format("{}rank{}.slot{}", held == kOwn ? "" : "copy-of-", q, number % 2);
}

Held held_here(const fs::path& dir, int q, int64_t number) {
  for (Held h : {kOwn, kCopy}) {
    const auto p = SlotFile(held_path(dir, h, q, number).string()).read_prefix();
    if (p && p->number == number) return h;
  }
  return kNone;
}

// A record this rank serves: mapped, verified, its payload as [1 + state buffers, shard_numel].
struct Served {
  std::unique_ptr<SlotFile> slot;
  SnapshotRecord record;
  at::Tensor payload;
};

// Sends or receives `t` (contiguous) in chunks an int count can carry.
void add_chunks(std::vector<P2pOp>& ops, const at::Tensor& t, int peer, bool send) {
  const at::Tensor bytes =
      at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, at::kByte);
  for (int64_t at = 0; at < bytes.numel(); at += kChunkBytes) {
    const at::Tensor chunk = bytes.narrow(0, at, std::min(kChunkBytes, bytes.numel() - at));
    ops.push_back(send ? P2pOp::send(chunk, peer) : P2pOp::recv(chunk, peer));
  }
}

// Copies `from` into section k (0: the parameters, k: state buffer k - 1) of the optimizer's
// shard elements [dst, dst + numel), bucket by bucket (a joined run may cross buckets).
void write_owned(ShardAccess& a, int k, int64_t dst, const at::Tensor& from) {
  const auto& buckets = a.layout().buckets;
  auto it = std::upper_bound(
      buckets.begin(), buckets.end(), dst,
      [](int64_t v, const BucketLayout& b) { return v < b.shard_offset + b.shard; });
  for (int64_t done = 0; done < from.numel() && it != buckets.end(); ++it) {
    const int bucket = static_cast<int>(it - buckets.begin());
    const int64_t at = dst + done - it->shard_offset;
    const int64_t n = std::min(from.numel() - done, it->shard - at);
    if (n <= 0) continue;
    at::Tensor owned = k == 0 ? a.owned_param_slice(bucket) : a.owned_state_slice(k - 1, bucket);
    owned.narrow(0, at, n).copy_(from.narrow(0, done, n));
    done += n;
  }
}

int64_t elements(const std::vector<CopyOp>& ops) {
  int64_t n = 0;
  for (const CopyOp& op : ops) n += op.numel;
  return n;
}

// Joins runs that continue each other in the same record and in the new shard (neighbouring
// parameters of a bucket): fewer, longer messages. Both ends join the same lists alike.
void coalesce(std::vector<CopyOp>& ops) {
  std::vector<CopyOp> out;
  for (const CopyOp& op : ops) {
    if (!out.empty() && out.back().src_rank == op.src_rank &&
        out.back().src + out.back().numel == op.src &&
        out.back().dst + out.back().numel == op.dst) {
      out.back().numel += op.numel;
    } else {
      out.push_back(op);
    }
  }
  ops = std::move(out);
}

}  // namespace

std::optional<TrainerState> restore_resharded(ShardAccess& a, Communicator& world,
                                              const fs::path& dir, int64_t number, int old_world,
                                              RestoreReport* report) {
  const auto t0 = std::chrono::steady_clock::now();
  const int me = world.rank(), size = world.size();
  const int sections = 1 + a.state_buffer_count();
  const int params = static_cast<int>(a.layout().slots.size());
  RestoreReport r;
  r.saved_world = old_world;
  auto refuse = [&](const std::string& why) -> std::optional<TrainerState> {
    r.reason = old_world == size
                   ? fmt::format(
                         "snapshot {} was saved by a world of {} ranks, as this job's, "
                         "and {}",
                         number, old_world, why)
                   : fmt::format(
                         "snapshot {} was saved by a world of {} ranks, this job has {}, "
                         "and {}",
                         number, old_world, size, why);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (report != nullptr) *report = r;
    return std::nullopt;
  };
  if (old_world < 1 || old_world > (1 << 24)) {  // read from a marker file
    return refuse("its commit marker is unreadable");
  }
  // 0. The saved pieces map onto shard ranks: only a layout sharded over the whole world (no
  // hybrid sharding, no model-parallel grid) reshards here.
  at::Tensor flat =
      at::tensor({static_cast<int64_t>(a.replicas() == 1 && a.comm()->size() == size &&
                                       a.comm()->rank() == me)},
                 at::kLong);
  world.all_reduce(flat, ReduceOp::Min);
  if (flat.item<int64_t>() == 0) {
    return refuse(
        "only an optimizer sharded over the whole world reshards a snapshot (no hybrid "
        "sharding, no model-parallel grid): restore from a checkpoint on disk");
  }
  // 1. What each rank's directory holds of every old rank's record.
  at::Tensor mine = at::empty({old_world}, at::kLong);
  for (int q = 0; q < old_world; ++q) mine[q] = static_cast<int64_t>(held_here(dir, q, number));
  at::Tensor all = at::empty({int64_t{size} * old_world}, at::kLong);
  world.all_gather(mine, all);
  const auto held = all.accessor<int64_t, 1>();
  // 2. One server per old record: a rank holding the record itself before one holding the
  // buddy's copy, then the least loaded, so that ranks of one host share the sending.
  std::vector<int> server(static_cast<size_t>(old_world), -1), load(static_cast<size_t>(size), 0);
  for (int q = 0; q < old_world; ++q) {
    int best = -1;
    for (int p = 0; p < size; ++p) {
      const int64_t h = held[int64_t{p} * old_world + q];
      if (h == kNone) continue;
      const int64_t hb = best < 0 ? kNone : held[int64_t{best} * old_world + q];
      const bool lighter =
          load[static_cast<size_t>(p)] < load[static_cast<size_t>(best < 0 ? 0 : best)];
      if (best < 0 || h > hb || (h == hb && lighter)) best = p;
    }
    if (best < 0) {
      return refuse(
          fmt::format("old rank {}'s record of it is on no host of this job (its own "
                      "host's memory and its buddy's are both gone)",
                      q));
    }
    server[static_cast<size_t>(q)] = best;
    ++load[static_cast<size_t>(best)];
    if (held[int64_t{best} * old_world + q] == kCopy) ++r.from_buddy;
  }
  const std::string what =
      fmt::format("restoring snapshot {} of {} ranks at {} ranks", number, old_world, size);
  at::NoGradGuard no_grad;
  // 3. Every server verifies the records it serves before anything is sent.
  std::map<int, Served> served;
  bool grouped = false;  // a record of a layout sharded over groups (hybrid sharding, a grid)
  bool unlaid = false;   // a record without its layout
  agree_on_errors(world, what + ": verifying the records this rank serves", [&] {
    const json now = snapshot_fingerprint(a, size, me);
    for (int q = 0; q < old_world; ++q) {
      if (server[static_cast<size_t>(q)] != me) continue;
      const auto h = static_cast<Held>(held[int64_t{me} * old_world + q]);
      Served s;
      s.slot = std::make_unique<SlotFile>(held_path(dir, h, q, number).string());
      const std::string where = s.slot->path();
      s.record = open_snapshot_record(*s.slot, number);
      const json& fp = s.record.j.at("fingerprint");
      if (fp.value("shard_ranks", -1) != fp.value("world", -2) || fp.value("replica", -1) != 0) {
        grouped = true;
        continue;
      }
      for (const auto& [key, value] : now.items()) {
        if (fingerprint_key_follows_world(key)) continue;
        const json saved = fp.value(key, json());
        SHARDOPT_CHECK(saved == value, Mismatch,
                       "snapshot: {} was written with {} = {}, this job has {}: another model, "
                       "stage or layout (clear the snapshot directory to start afresh)",
                       where, key, saved.dump(), value.dump());
      }
      SHARDOPT_CHECK(fp.value("world", -1) == old_world && fp.value("rank", -1) == q &&
                         fp.value("shard_ranks", -1) == old_world,
                     Checkpoint,
                     "snapshot: {} holds rank {} of {} ranks (sharded over {}), not rank {} of "
                     "the {} that committed snapshot {}",
                     where, fp.value("rank", -1), fp.value("world", -1),
                     fp.value("shard_ranks", -1), q, old_world, number);
      if (!s.record.j.contains("layout")) {  // written before records carried it
        unlaid = true;
        continue;
      }
      const json& lj = s.record.j.at("layout");
      const FlatLayout old = layout_from_snapshot(lj, params, where);
      SHARDOPT_CHECK(lj.value("shard_rank", -1) == q, Checkpoint,
                     "snapshot: {}: its layout is shard rank {}'s, not {}'s", where,
                     lj.value("shard_rank", -1), q);
      SHARDOPT_CHECK(
          s.record.prefix.payload_bytes ==
              sections * old.shard_numel * static_cast<int64_t>(c10::elementSize(a.master_dtype())),
          Checkpoint, "snapshot: {} holds {} bytes of state, its layout says {} x {}", where,
          s.record.prefix.payload_bytes, sections, old.shard_numel);
      s.payload = at::from_blob(s.slot->payload(), {sections, old.shard_numel},
                                at::TensorOptions().dtype(a.master_dtype()));
      served.emplace(q, std::move(s));
    }
  });
  at::Tensor why =
      at::tensor({static_cast<int64_t>(grouped), static_cast<int64_t>(unlaid)}, at::kLong);
  world.all_reduce(why, ReduceOp::Max);
  if (why[1].item<int64_t>() != 0) {
    return refuse(
        "its records carry no layout (written before snapshots resharded): restore from a "
        "checkpoint on disk");
  }
  if (why[0].item<int64_t>() != 0) {
    return refuse(
        "its layout was sharded over groups of ranks (hybrid sharding or a "
        "model-parallel grid), which resharding from memory does not map: restore from "
        "a checkpoint on disk");
  }
  // 4. Old rank 0's record (the steps, rules, loss scaler, the trainer's JSON and the layout) to
  // every rank.
  const int root = server[0];
  at::Tensor length =
      at::tensor({root == me ? served.at(0).record.prefix.json_bytes : int64_t{0}}, at::kLong);
  world.broadcast(length, root);
  at::Tensor text = at::empty({length.item<int64_t>()}, at::kByte);
  if (root == me) std::memcpy(text.data_ptr(), served.at(0).record.tail.data(), text.numel());
  world.broadcast(text, root);
  // 5. The plan, the same on every rank: which old rank's elements fill which of each rank's.
  StagedSnapshot staged;
  std::vector<std::vector<CopyOp>> receive(static_cast<size_t>(size)),
      send(static_cast<size_t>(size));
  std::vector<at::Tensor> received;  // per section: the runs other ranks send, in plan order
  agree_on_errors(world, what + ": planning", [&] {
    const std::string where = fmt::format("old rank 0's record of snapshot {}", number);
    SnapshotRecord first;
    try {
      first.j = json::parse(std::string(static_cast<const char*>(text.data_ptr()), text.numel()));
    } catch (const std::exception& e) {
      SHARDOPT_FAIL(Checkpoint, "snapshot: {}: unreadable: {}", where, e.what());
    }
    staged = parse_snapshot_record(a, first, where, /*with_tensors=*/false);
    const json& lj = first.j.at("layout");
    const FlatLayout old = layout_from_snapshot(lj, params, where);
    for (const auto& [q, s] : served) {  // every record of the one snapshot, by one layout
      SHARDOPT_CHECK(s.record.j.at("steps") == first.j.at("steps") &&
                         s.record.j.at("layout").at("pieces") == lj.at("pieces") &&
                         s.record.j.at("layout").at("buckets") == lj.at("buckets"),
                     Checkpoint,
                     "snapshot: {} disagrees with old rank 0's record of snapshot {} on the step "
                     "or the layout",
                     s.slot->path(), number);
    }
    for (const SectionMap& map : state_sections(a).maps) {
      SHARDOPT_CHECK(map.size() == a.layout().shard_numel, Unsupported,
                     "snapshot: this optimizer's state is not one element per parameter element; "
                     "it does not reshard from memory: restore from a checkpoint on disk");
    }
    for (int i = 0; i < params; ++i) {
      const std::vector<SavedPiece> saved = saved_pieces(old, i, old_world);
      SHARDOPT_CHECK(covers(saved, a.layout().slots[i].numel), Checkpoint,
                     "snapshot: {}: the saved pieces of parameter '{}' do not cover its {} "
                     "elements",
                     where, a.param_name(i), a.layout().slots[i].numel);
      for (const CopyOp& op : plan_copies(a.layout(), me, i, saved)) {
        receive[static_cast<size_t>(server[static_cast<size_t>(op.src_rank)])].push_back(op);
      }
      for (int to = 0; to < size; ++to) {
        for (const CopyOp& op : plan_copies(a.layout(), to, i, saved)) {
          if (server[static_cast<size_t>(op.src_rank)] == me)
            send[static_cast<size_t>(to)].push_back(op);
        }
      }
    }
    for (auto& list : receive) coalesce(list);
    for (auto& list : send) coalesce(list);
  });
  // 6. The slices, and to each new rank q < old_world the tail of old rank q's record (its trainer
  // tensors, as a checkpoint on disk gives rank q the tensors its rank q saved).
  at::Tensor my_tail_bytes = at::zeros({2}, at::kLong);  // the tail's bytes, its JSON's
  {
    std::vector<P2pOp> ops;
    std::vector<at::Tensor> lengths;
    for (const auto& [q, s] : served) {
      if (q >= size || q == me) continue;
      lengths.push_back(
          at::tensor({s.record.prefix.tail_bytes, s.record.prefix.json_bytes}, at::kLong));
      ops.push_back(P2pOp::send(lengths.back(), q));
    }
    if (me < old_world && server[static_cast<size_t>(me)] != me) {
      ops.push_back(P2pOp::recv(my_tail_bytes, server[static_cast<size_t>(me)]));
    }
    if (!ops.empty()) world.batch_isend_irecv(ops)->wait(world.timeout());
  }
  // Each run goes from the mapped record into one buffer per section (one message per run and
  // section, posted in the plan's order on both sides): no packing. Runs of the records this rank
  // serves itself are copied from the mapped record at the commit.
  int64_t remote = 0;
  for (int from = 0; from < size; ++from) {
    if (from != me) remote += elements(receive[static_cast<size_t>(from)]);
  }
  for (int k = 0; k < sections; ++k) {
    received.push_back(at::empty({remote}, at::TensorOptions().dtype(a.master_dtype())));
  }
  at::Tensor my_tail = at::empty({my_tail_bytes[0].item<int64_t>()}, at::kByte);
  {
    std::vector<P2pOp> ops;
    for (int to = 0; to < size; ++to) {
      if (to == me) continue;
      for (const CopyOp& op : send[static_cast<size_t>(to)]) {
        const at::Tensor& payload = served.at(op.src_rank).payload;
        for (int k = 0; k < sections; ++k) {
          add_chunks(ops, payload[k].narrow(0, op.src, op.numel), to, /*send=*/true);
        }
      }
    }
    for (const auto& [q, s] : served) {
      if (q >= size || q == me) continue;
      at::Tensor tail = at::from_blob(const_cast<char*>(s.record.tail.data()),  // NOLINT: sent only
                                      {s.record.prefix.tail_bytes}, at::kByte);
      add_chunks(ops, tail, q, /*send=*/true);
    }
    int64_t at = 0;
    for (int from = 0; from < size; ++from) {
      if (from == me) continue;
      for (const CopyOp& op : receive[static_cast<size_t>(from)]) {
        for (int k = 0; k < sections; ++k) {
          add_chunks(ops, received[static_cast<size_t>(k)].narrow(0, at, op.numel), from,
                     /*send=*/false);
        }
        at += op.numel;
      }
    }
    if (me < old_world && server[static_cast<size_t>(me)] != me) {
      add_chunks(ops, my_tail, server[static_cast<size_t>(me)], /*send=*/false);
    }
    if (!ops.empty()) world.batch_isend_irecv(ops)->wait(world.timeout());
  }
  // 7. Every rank has what it needs; they agree before any optimizer changes.
  agree_on_errors(world, what + ": receiving", [&] {
    if (me < old_world) {
      SnapshotRecord own;
      const std::string where = fmt::format("old rank {}'s record of snapshot {}", me, number);
      if (server[static_cast<size_t>(me)] == me) {
        own = served.at(me).record;
      } else {
        // Verified by its server (step 3).
        own.tail.assign(static_cast<const char*>(my_tail.data_ptr()),
                        static_cast<size_t>(my_tail.numel()));
        own.prefix.tail_bytes = my_tail.numel();
        own.prefix.json_bytes = my_tail_bytes[1].item<int64_t>();
        SHARDOPT_CHECK(own.prefix.json_bytes >= 0 && own.prefix.json_bytes <= own.prefix.tail_bytes,
                       Checkpoint, "snapshot: {}: its JSON's length {} lies outside its {} bytes",
                       where, own.prefix.json_bytes, own.prefix.tail_bytes);
        try {
          own.j = json::parse(own.tail.substr(0, static_cast<size_t>(own.prefix.json_bytes)));
        } catch (const std::exception& e) {
          SHARDOPT_FAIL(Checkpoint, "snapshot: {}: unreadable: {}", where, e.what());
        }
      }
      staged.trainer.tensors = parse_snapshot_record(a, own, where, true).trainer.tensors;
    }
  });
  // 8. The commit, bucket by bucket (padding keeps its values, as load_checkpoint's staging does).
  int64_t at = 0;
  for (int from = 0; from < size; ++from) {
    for (const CopyOp& op : receive[static_cast<size_t>(from)]) {
      for (int k = 0; k < sections; ++k) {
        write_owned(a, k, op.dst,
                    from == me ? served.at(op.src_rank).payload[k].narrow(0, op.src, op.numel)
                               : received[static_cast<size_t>(k)].narrow(0, at, op.numel));
      }
      if (from != me) at += op.numel;
    }
  }
  a.set_step_count(staged.steps);
  for (int g = 0; g < a.group_count(); ++g)
    a.set_group_rule(g, staged.rules[static_cast<size_t>(g)]);
  if (staged.scaler) a.set_loss_scaler_state(*staged.scaler);
  a.after_load();
  r.restored = true;
  r.number = number;
  r.step = staged.steps;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (report != nullptr) *report = r;
  return std::move(staged.trainer);
}

}  // namespace shardopt::detail
