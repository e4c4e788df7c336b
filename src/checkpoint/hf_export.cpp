// The streaming Hugging Face export (Note [Streaming Hugging Face export] in
// shardopt/hf_export.hpp).
#include "shardopt/hf_export.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <fcntl.h>  // AT_FDCWD
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "comm/agreement.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "shardopt/safetensors.hpp"
#include "shardopt/tensor_parallel.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int64_t kPieceElements = int64_t{1} << 16;  // at most this many copied on their way out
constexpr const char* kIndex = "model.safetensors.index.json";

// One given tensor this rank's stage exports.
struct Item {
  std::string name;               // as given
  at::Tensor tensor;
  std::vector<std::string> out;   // its names in the export
  std::vector<int64_t> local;     // this rank's shape
  std::vector<int64_t> shape;     // the unsplit shape
  std::optional<tp::Split> split; // split over `group`
  CommunicatorPtr group;
  int index = -1;                 // its slot in the optimizer's layout; -1: not the optimizer's
  bool from_master = false;       // assembled from the optimizer's owned master slices
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The files one writer plans: tensors in order, each file closed before max_bytes is passed.
std::vector<std::vector<safetensors::TensorInfo>> plan_files(const std::vector<Item>& items,
                                                             int64_t max_bytes) {
  std::vector<std::vector<safetensors::TensorInfo>> files;
  int64_t bytes = 0;
  for (const auto& it : items) {
    for (const auto& name : it.out) {
      safetensors::TensorInfo info{name, "F32", it.shape};
      const auto n = static_cast<int64_t>(info.nbytes());
      if (files.empty() || (bytes > 0 && bytes + n > max_bytes)) {
        files.emplace_back();
        bytes = 0;
      }
      files.back().push_back(std::move(info));
      bytes += n;
    }
  }
  return files;
}

std::string file_name(int k, int n) {
  return n == 1 ? std::string("model.safetensors")
                : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

// Receives a writer's tensors in plan order and moves from file to file.
class Sink {
 public:
  Sink(fs::path dir, std::vector<std::string> names,
       std::vector<std::vector<safetensors::TensorInfo>> files)
      : dir_(std::move(dir)), names_(std::move(names)), files_(std::move(files)) {}
  // The next tensor's values, any view whose row-major order is the tensor's.
  void write(const at::Tensor& values) {
    if (failed_) return;
    try {
      if (!out_) {
        out_ = std::make_unique<safetensors::Writer>((dir_ / names_[file_]).string(), files_[file_]);
        entry_ = 0;
      }
      append(values);
      bytes_ += static_cast<int64_t>(files_[file_][entry_].nbytes());
      ++tensors_;
      if (++entry_ == files_[file_].size()) {
        out_->close();
        out_.reset();
        ++file_;
      }
    } catch (...) {
      failed_ = std::current_exception();
      out_.reset();
    }
  }
  // Rethrows the first failure (the collectives went on without writing).
  void finish() {
    if (failed_) std::rethrow_exception(failed_);
    SHARDOPT_CHECK(file_ == files_.size(), Internal,
                   "export: {} of {} planned files written", file_, files_.size());
  }
  int64_t bytes() const { return bytes_; }
  int64_t tensors() const { return tensors_; }

 private:
  // A contiguous fp32 host tensor goes out as it is; anything else (a view across the rank
  // chunks, another dtype or device) in copies of at most kPieceElements.
  void append(const at::Tensor& v) {
    if (v.is_contiguous() && v.device().is_cpu() && v.scalar_type() == at::kFloat) {
      out_->append(v.data_ptr(), v.nbytes());
    } else if (v.numel() <= kPieceElements || v.dim() == 0) {
      const at::Tensor c = v.to(at::kCPU, at::kFloat).contiguous();
      out_->append(c.data_ptr(), c.nbytes());
    } else if (v.dim() == 1) {
      for (int64_t i = 0; i < v.size(0); i += kPieceElements) {
        append(v.narrow(0, i, std::min(kPieceElements, v.size(0) - i)));
      }
    } else {
      for (int64_t i = 0; i < v.size(0); ++i) append(v[i]);
    }
  }

  fs::path dir_;
  std::vector<std::string> names_;
  std::vector<std::vector<safetensors::TensorInfo>> files_;
  std::unique_ptr<safetensors::Writer> out_;
  size_t file_ = 0, entry_ = 0;
  int64_t bytes_ = 0, tensors_ = 0;
  std::exception_ptr failed_;
};

// Parameter `index` of the optimizer's layout, this rank's values of it (split: its slice) from
// the owned slices of the master: into `dest` on the rank that receives (data-parallel rank 0;
// `dest` undefined elsewhere). One broadcast per rank that owns a part; collective over the
// optimizer's ranks.
void gather_master(detail::ShardAccess& access, int index, const at::Tensor& dest) {
  const auto& layout = access.layout();
  const auto& comm = access.comm();
  const int n = comm->size(), me = comm->rank();
  for (const auto* p = layout.pieces_begin(index); p != layout.pieces_end(index); ++p) {
    const auto& bucket = layout.buckets[p->bucket];
    for (int r = 0; r < n; ++r) {
      const auto in = detail::intersect({p->offset, p->offset + p->numel}, bucket.owned(r));
      if (in.empty()) continue;
      at::Tensor dst = dest.defined() ? dest.narrow(0, p->param_offset + in.begin - p->offset, in.size())
                                      : at::Tensor();
      if (me == r) {
        at::Tensor src = access.owned_param_slice(p->bucket).narrow(0, in.begin - r * bucket.shard, in.size());
        if (dst.defined()) dst.copy_(src);
        if (n > 1) comm->broadcast(dst.defined() ? dst : src, r);
      } else {
        comm->broadcast(dst.defined() ? dst : at::empty({in.size()}, dest.defined() ? dest.options()
                                                      : access.owned_param_slice(p->bucket).options()),
                        r);
      }
    }
  }
}

// The unsplit values from the all-gathered rank chunks [t, local...]: a view whose row-major order
// is the unsplit tensor's, padding left out (a copy only for padding along a dimension > 0).
at::Tensor unsplit_view(const at::Tensor& gathered, const Item& it) {
  const int64_t t = it.group->size();
  const tp::Split& s = *it.split;
  std::vector<int64_t> sizes = it.local;
  if (s.padded_size == s.full_size) {
    sizes.insert(sizes.begin(), t);
    return gathered.view(sizes).movedim(0, s.dim);  // [..., t, local_dim, ...]
  }
  if (s.dim == 0) {
    sizes[0] *= t;
    return gathered.view(sizes).narrow(0, 0, s.full_size);
  }
  std::vector<int64_t> chunks = it.local;
  chunks.insert(chunks.begin(), t);
  sizes[s.dim] *= t;
  return gathered.view(chunks).movedim(0, s.dim).reshape(sizes).narrow(s.dim, 0, s.full_size);
}

fs::path normalised(const std::string& dir) {
  fs::path d = fs::absolute(fs::path(dir)).lexically_normal();
  if (d.filename().empty()) d = d.parent_path();
  return d;
}

// An earlier export's directory (or an empty one) may be replaced; anything else is refused.
void check_replaceable(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return;
  SHARDOPT_CHECK(fs::is_directory(dir, ec), InvalidArgument,
                 "export: '{}' exists and is not a directory", dir.string());
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string ext = e.path().extension().string();
    SHARDOPT_CHECK(e.is_regular_file() && (ext == ".safetensors" || ext == ".json" || ext == ".txt"),
                   InvalidArgument,
                   "export: '{}' holds '{}', which no export writes; remove it or export elsewhere",
                   dir.string(), e.path().filename().string());
  }
}

void sync_directory(const fs::path& dir) {
  FILE* f = std::fopen(dir.c_str(), "r");
  if (f == nullptr) return;
  ::fsync(fileno(f));
  std::fclose(f);
}

// Puts `tmp` in place of `dir`: a rename, or an atomic exchange with an existing directory
// (renameat2 RENAME_EXCHANGE; where the file system refuses it, two renames).
void commit(const fs::path& tmp, const fs::path& dir) {
  sync_directory(tmp);
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    fs::rename(tmp, dir);
  } else {
#if defined(SYS_renameat2)
    constexpr unsigned kExchange = 1u << 1;  // RENAME_EXCHANGE (linux/fs.h)
    const bool swapped =
        ::syscall(SYS_renameat2, AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), kExchange) == 0;
#else
    const bool swapped = false;
#endif
    if (!swapped) {
      const fs::path old = tmp.string() + "-old";
      fs::remove_all(old);
      fs::rename(dir, old);
      fs::rename(tmp, dir);
      fs::remove_all(old);
    } else {
      fs::remove_all(tmp);  // now the earlier export
    }
  }
  sync_directory(dir.parent_path());
}

}  // namespace

HfExportReport export_hf_safetensors(const std::string& dir,
                                     const torch::OrderedDict<std::string, at::Tensor>& tensors,
                                     const ParallelGroups& groups, DistributedOptimizer* optimizer,
                                     const HfExportOptions& options) {
  SHARDOPT_CHECK(groups.world && groups.dp && groups.tp, InvalidArgument,
                 "export: the groups are not made (make_parallel_groups)");
  Communicator& world = *groups.world;
  const Duration timeout = world.timeout();
  const fs::path target = normalised(dir);
  const fs::path tmp = target.parent_path() / ("." + target.filename().string() + ".export-tmp");
  detail::ShardAccess* access = optimizer ? &detail::shard_access(*optimizer) : nullptr;
  const bool stage3 = access && access->zero_options().stage == Stage::Parameters;

  // Data-parallel rank 0 of each (pipeline, tensor) position receives; tensor rank 0 writes.
  const bool receives = access ? access->comm()->rank() == 0 && access->replica() == 0
                               : groups.dp_rank == 0;
  const bool writer = receives && groups.tp_rank == 0;
  auto remove_tmp = [&] {
    std::error_code ec;
    if (world.rank() == 0) fs::remove_all(tmp, ec);
  };

  // ---- what this stage exports, and the plan agreed by every rank --------------------------
  std::vector<Item> items;
  std::vector<std::vector<safetensors::TensorInfo>> my_files;
  const auto plans = detail::agree(
      world, timeout, "planning the Hugging Face export", "nothing was written",
      [&]() -> json {
        SHARDOPT_CHECK(options.max_shard_bytes > 0, InvalidArgument,
                       "export: max_shard_bytes must be positive, got {}", options.max_shard_bytes);
        std::unordered_map<const c10::TensorImpl*, int> slots;
        if (access) {
          for (int i = 0; i < static_cast<int>(access->layout().slots.size()); ++i) {
            slots[access->param_tensor(i).unsafeGetTensorImpl()] = i;
          }
        }
        std::string signature;
        for (const auto& kv : tensors) {
          Item it;
          it.name = kv.key();
          it.tensor = kv.value();
          const auto named = options.names.find(it.name);
          it.out = named == options.names.end() ? std::vector<std::string>{it.name} : named->second;
          if (it.out.empty()) continue;
          // The tied embedding's copies: the first stage's is written.
          if (groups.layout.pp > 1 && groups.pp_rank != 0 && is_pipeline_shared(it.tensor)) continue;
          SHARDOPT_CHECK(it.tensor.defined(), InvalidArgument, "export: '{}' is undefined", it.name);
          const auto slot = slots.find(it.tensor.unsafeGetTensorImpl());
          if (slot != slots.end()) it.index = slot->second;
          it.local = it.index >= 0 ? access->param_shape(it.index) : it.tensor.sizes().vec();
          it.shape = it.local;
          // A split of one rank (t = 1) may still carry padding to leave out.
          if (const auto record = tp::record_of(it.tensor); record && record->split && record->group) {
            it.split = record->split;
            it.group = record->group;
            it.shape[it.split->dim] = it.split->full_size;
          }
          it.from_master = it.index >= 0 && (stage3 || it.tensor.scalar_type() != access->master_dtype());
          signature += fmt::format("{}[{}]->{};", it.name, fmt::join(it.shape, ","), fmt::join(it.out, ","));
          items.push_back(std::move(it));
        }
        json mine = {{"pp", groups.pp_rank}, {"signature", signature}, {"files", json::array()}};
        int64_t largest = 0, buffer = 0;
        for (const auto& it : items) {
          largest = std::max(largest, numel_of(it.shape) * 4);
          const int64_t element = it.from_master ? c10::elementSize(access->master_dtype())
                                                 : static_cast<int64_t>(it.tensor.element_size());
          buffer = std::max(buffer, numel_of(it.local) * (it.split ? it.group->size() : 1) * element);
        }
        mine["largest"] = largest;
        mine["buffer"] = buffer;
        if (writer) {
          my_files = plan_files(items, options.max_shard_bytes);
          for (const auto& f : my_files) {
            json names = json::array();
            int64_t bytes = 0;
            for (const auto& info : f) {
              names.push_back(info.name);
              bytes += static_cast<int64_t>(info.nbytes());
            }
            mine["files"].push_back({{"names", names}, {"bytes", bytes}});
          }
        }
        if (world.rank() == 0) {
          check_replaceable(target);
          fs::remove_all(tmp);
          fs::create_directories(tmp);
        }
        return mine;
      },
      remove_tmp, "export");

  // Every rank reads the same plans, so every rank reaches the same verdicts.
  HfExportReport report;
  std::vector<std::string> my_names;
  std::map<std::string, std::string> weight_map;
  std::string stage_signature_problem, duplicate_problem;
  {
    int total_files = 0;
    for (const auto& p : plans) total_files += static_cast<int>(p["files"].size());
    std::map<int, std::pair<int, std::string>> signature_of_stage;  // pp -> (first rank, signature)
    int k = 0;
    for (int r = 0; r < static_cast<int>(plans.size()); ++r) {
      const auto& p = plans[r];
      const int pp = p["pp"].get<int>();
      const auto sig = p["signature"].get<std::string>();
      const auto [first, inserted] = signature_of_stage.emplace(pp, std::make_pair(r, sig));
      if (!inserted && first->second.second != sig && stage_signature_problem.empty()) {
        stage_signature_problem = fmt::format(
            "ranks {} and {} of pipeline stage {} give different tensors (names, shapes or export "
            "names): {} vs {}", first->second.first, r, pp, first->second.second, sig);
      }
      report.largest_tensor_bytes = std::max(report.largest_tensor_bytes, p["largest"].get<int64_t>());
      report.largest_buffer_bytes = std::max(report.largest_buffer_bytes, p["buffer"].get<int64_t>());
      for (const auto& f : p["files"]) {
        const std::string name = file_name(k++, total_files);
        report.files.push_back(name);
        report.total_bytes += f["bytes"].get<int64_t>();
        if (r == world.rank()) my_names.push_back(name);
        for (const auto& t : f["names"]) {
          const auto [where, fresh] = weight_map.emplace(t.get<std::string>(), name);
          if (!fresh && duplicate_problem.empty()) {
            duplicate_problem = fmt::format("'{}' would be written twice, into {} and {}",
                                            t.get<std::string>(), where->second, name);
          }
        }
      }
    }
    if (total_files > 1) report.files.push_back(kIndex);
  }
  if (!stage_signature_problem.empty() || !duplicate_problem.empty()) remove_tmp();
  SHARDOPT_CHECK(stage_signature_problem.empty(), Mismatch, "export: {}", stage_signature_problem);
  SHARDOPT_CHECK(duplicate_problem.empty(), InvalidArgument, "export: {}", duplicate_problem);

  // ---- the tensors, one at a time --------------------------------------------------------------
  Sink sink(tmp, my_names, my_files);
  for (const auto& it : items) {
    const bool split = it.split.has_value();
    const int tp_rank = split ? it.group->rank() : groups.tp_rank;
    // What every tensor rank holds whole, tensor rank 0 alone exports.
    if (!split && tp_rank != 0) continue;
    const int64_t local_numel = numel_of(it.local);
    const at::TensorOptions opts =
        it.from_master ? access->owned_param_slice(access->layout().slots[it.index].bucket).options()
                       : it.tensor.options();
    at::Tensor gathered, local;
    if (receives && split) {
      gathered = at::empty({it.group->size() * local_numel}, opts);
      local = gathered.narrow(0, tp_rank * local_numel, local_numel);
    } else if (receives && it.from_master) {
      local = at::empty({local_numel}, opts);
    }
    if (it.from_master) {
      gather_master(*access, it.index, local);
    } else if (split && receives) {
      local.copy_(it.tensor.detach().reshape({-1}));
    }
    if (!receives) continue;
    if (split) it.group->all_gather(local, gathered);
    if (!writer) continue;
    const at::Tensor values = split            ? unsplit_view(gathered, it)
                              : it.from_master ? local.view(it.local)
                                               : it.tensor.detach();
    for (size_t n = 0; n < it.out.size(); ++n) sink.write(values);
  }

  // ---- agreement, then the index and the commit by world rank 0 ----------------------------------
  detail::agree(
      world, timeout, "writing the Hugging Face export", fmt::format("'{}' is unchanged", dir),
      [&]() -> json {
        if (writer) sink.finish();
        if (options.after_files_written) options.after_files_written(world.rank());
        return nullptr;
      },
      remove_tmp, "export");
  report.rank_bytes = sink.bytes();
  report.rank_tensors = sink.tensors();
  detail::agree(
      world, timeout, "committing the Hugging Face export", fmt::format("'{}' is unchanged", dir),
      [&]() -> json {
        if (world.rank() != 0) return nullptr;
        if (report.files.size() > 1) {
          const json index = {{"metadata", {{"total_size", report.total_bytes}}},
                              {"weight_map", weight_map}};
          std::ofstream out(tmp / kIndex);
          out << index.dump(2) << '\n';
          out.close();
          SHARDOPT_CHECK(out, Checkpoint, "export: cannot write '{}'", (tmp / kIndex).string());
        }
        if (options.write_extra) options.write_extra(tmp.string());
        commit(tmp, target);
        return nullptr;
      },
      remove_tmp, "export");
  return report;
}

}  // namespace shardopt
