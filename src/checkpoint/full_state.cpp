// Whole-model views of a sharded checkpoint, in one process: inspection, the full state and its
// consolidation into torch.load()-able files; and the way back: a full state (or torch.save files)
// loaded into a sharded run.
#include "shardopt/checkpoint.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/files.hpp"
#include "checkpoint/grid_files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/staging.hpp"
#include "checkpoint/torch_save.hpp"
#include "checkpoint/torch_save_reader.hpp"
#include "comm/agreement.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/grid_checkpoint.hpp"

namespace shardopt {

// The checkpoint internals (src/checkpoint/*.hpp) are all in detail.
using namespace detail;  // NOLINT(google-build-using-namespace)

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
    info.params.push_back({p.name, p.shape, dtype_name(m.dtype), p.group, p.split});
  info.trainer_json = dump(m.j.at("trainer"));
  info.manifest_json = dump(m.j, 1);
  return info;
}

FullState read_full_state(const std::string& dir, bool with_optimizer_state) {
  const Manifest m = read_manifest(dir);
  if (with_optimizer_state) check_elementwise_state(m.rule, "read_full_state (optimizer state)");
  // The parameters' sizes are bounded by the sections, those by the files' stated sizes: check
  // those against the disk before allocating (Note [Sizes from files] in checkpoint/format.hpp).
  for (int r = 0; r < m.world; ++r) check_shard_size(m, r);
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
  if (m.j.contains("module")) {
    const json& module = m.j.at("module");
    out.aliases = module.at("aliases").get<std::map<std::string, std::string>>();
    const auto names = module.at("tensors").get<std::vector<std::string>>();
    if (!names.empty()) {
      const LoadedShard shard = load_shard(m, 0);
      for (const auto& name : names) {
        out.module_state[name] = shard.section("trainer/" + std::string(kModulePrefix) + name).clone();
      }
    }
  }
  return out;
}

void consolidate_checkpoint(const std::string& dir, const std::string& out,
                            const ConsolidateOptions& options) {
  // Parameters only: a grid of any layout, its split parameters put back together
  // (read_grid_full_state); with the optimizer state, one folder (or a grid of one).
  std::string folder = dir;
  if (!options.optimizer_state_out.empty() &&
      !std::filesystem::exists(std::filesystem::path(dir) / kManifest)) {
    const GridCommit c = read_grid_commit(dir);
    SHARDOPT_CHECK(c.layout.tp * c.layout.pp == 1, Unsupported,
                   "checkpoint: {}: the optimizer state is consolidated from one folder, and this "
                   "grid checkpoint has {} (tp={} x pp={}); consolidate the parameters alone, or "
                   "load the checkpoint into an optimizer of that layout and take its state dict",
                   dir, c.layout.tp * c.layout.pp, c.layout.tp, c.layout.pp);
    folder = committed_folder(dir);
  }
  const FullState full = options.optimizer_state_out.empty() ? read_grid_full_state(dir)
                                                             : read_full_state(folder, true);
  c10::Dict<std::string, at::Tensor> model;
  for (const auto& item : full.params) model.insert(item.key(), item.value());
  for (const auto& [alias, name] : full.aliases) {
    const at::Tensor* t = full.params.find(name);
    SHARDOPT_CHECK(t != nullptr, Checkpoint,
                   "checkpoint: {}: alias '{}' names parameter '{}', which it does not hold", dir,
                   alias, name);
    model.insert(alias, *t);
  }
  for (const auto& [name, t] : full.module_state) model.insert(name, t);
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

SaveOptions module_save_options(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                                const torch::OrderedDict<std::string, at::Tensor>& named_buffers) {
  SaveOptions options;
  std::map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& item : named_parameters) {
    auto [it, fresh] = first_name.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!fresh) {
      options.aliases[item.key()] = it->second;
    } else if (!item.value().requires_grad()) {
      options.module_state[item.key()] = item.value();
    }
  }
  for (const auto& item : named_buffers) {
    if (item.value().defined()) options.module_state[item.key()] = item.value();
  }
  return options;
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
            checked_step_count(state.step, "the full state's step");
            check_checkpointable(a);
            names = optimizer_state_names(a);
            check_elementwise_state(rule_name(a.group_rule(0)), "load_full_state");
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
    return read_torch_save(p, bytes.numel(), fmt::format("checkpoint: {} {}", what, path));
  } catch (const Error&) {
    throw;  // a bound of Note [Bounds on torch.save files], named already
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
    const std::string& key = entry.key().toStringRef();
    check_tensor_from_file(entry.value().toTensor(),
                           fmt::format("checkpoint: {}: tensor '{}'", what, key));
    out.insert(key, entry.value().toTensor());
  }
  return out;
}
}  // namespace

torch::OrderedDict<std::string, at::Tensor> read_state_dict(const std::string& model_file) {
  return tensor_dict(pickle_load_file(model_file, "model state file"), model_file);
}

std::vector<std::string> load_full_state_dict(DistributedOptimizer& optimizer,
                                              const std::string& model_file,
                                              const std::string& optimizer_file) {
  ShardAccess& a = detail::shard_access(optimizer);
  FullState state;
  // Reading is local: agree on it before anyone goes on to the collective load.
  agree(*a.comm(), a.zero_options().timeout, "reading a full state dict",
        "no rank changed its optimizer", [&] {
          state.params = read_state_dict(model_file);
          if (!optimizer_file.empty()) {
            const c10::IValue v = pickle_load_file(optimizer_file, "optimizer state file");
            SHARDOPT_CHECK(v.isGenericDict(), Checkpoint, "checkpoint: {} does not hold a dict",
                           optimizer_file);
            const auto top = v.toGenericDict();
            SHARDOPT_CHECK(top.contains("format") && top.at("format").isString() &&
                               top.at("format").toStringRef() == kOptimizerFormat,
                           Checkpoint, "checkpoint: {} is not a shardopt optimizer state file",
                           optimizer_file);
            state.step = top.at("step").toInt();  // checked by load_full_state
            state.rule = top.at("rule").toStringRef();
            for (const auto& entry : top.at("state").toGenericDict()) {
              const std::string param = entry.key().toStringRef();
              for (const auto& buffer : entry.value().toGenericDict()) {
                const std::string& name = buffer.key().toStringRef();
                const at::Tensor& t = buffer.value().toTensor();
                check_tensor_from_file(t, fmt::format("checkpoint: {}: '{}' of parameter '{}'",
                                                      optimizer_file, name, param));
                state.optimizer_state[name].insert(param, t);
              }
            }
          }
          return json();
        });
  return load_full_state(optimizer, state);
}

}  // namespace shardopt
