// torch::save(opt, file) / torch::load(opt, file) for DistributedOptimizer: the consolidated state
// (state_dict.cpp) in the archive layout torch::optim's own optimizers write and read
// (torch/optim/serialize.h, the same from torch 1.13 to 2.6):
//   pytorch_version: "1.5.0"
//   state/<key>/{step, <state buffers>}            per parameter that has state
//   param_groups/size, param_groups/<g>/{params/size, params/<j>: "<key>", options/{lr, ...}}
// Keys are the parameter's position over all groups, in decimal: torch 1.13 matches them as
// strings and 2.x parses them as integers (std::stoull), so both read them.
#include <torch/serialize/archive.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "checkpoint/format.hpp"
#include "checkpoint/staging.hpp"
#include "comm/agreement.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/detail/shard_access.hpp"
#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"

namespace shardopt {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// torch::optim's ParamState classes keep "step" for every rule but SGD.
bool keeps_step(const Rule& rule) { return !std::holds_alternative<SGD>(rule); }

// A rule's hyper-parameters under torch::optim's option names (beta1, beta2 are "betas";
// Adafactor's eps1, eps2 "eps"; Muon's ns_a, ns_b, ns_c "ns_coefficients").
void write_options(OutputArchive& archive, const Rule& rule) {
  detail::visit_torch_options(rule, [&](const char* name, const auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::pair<double, double>>) {
      archive.write(name, c10::IValue(std::make_tuple(value.first, value.second)));
    } else {
      archive.write(name, c10::IValue(value));
    }
  });
}

// The same back, over `rule` (fields the archive lacks keep their value).
void read_options(InputArchive& archive, Rule& rule) {
  std::visit(
      [&](auto& r) {
        std::decay_t<decltype(r)>::fields(r, [&](const detail::Field& f, auto& value) {
          const std::string name = f.name;
          c10::IValue v;
          if (name == "ns_a" || name == "ns_b" || name == "ns_c") {  // Muon's ns_coefficients
            if (!archive.try_read("ns_coefficients", v)) return;
            const auto abc = v.to<std::tuple<double, double, double>>();
            value = name == "ns_a" ? std::get<0>(abc) : name == "ns_b" ? std::get<1>(abc)
                                                                     : std::get<2>(abc);
          } else if (name == "beta1" || name == "beta2" || name == "eps1" || name == "eps2") {
            const bool betas = name[0] == 'b';
            if (!archive.try_read(betas ? "betas" : "eps", v)) return;
            const auto pair = v.to<std::tuple<double, double>>();
            value = name.back() == '1' ? std::get<0>(pair) : std::get<1>(pair);
          } else if (archive.try_read(name, v)) {
            value = v.to<std::decay_t<decltype(value)>>();
          }
        });
      },
      rule);
}

int64_t read_size(InputArchive& archive, const std::string& key) {
  at::Tensor size;
  archive.read(key, size);
  detail::check_tensor_from_file(size, fmt::format("optimizer: torch::load: '{}'", key));
  return size.item<int64_t>();
}

}  // namespace

void DistributedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  const OptimizerStateDict& sd = state_dict();  // Error{Unsupported} unless consolidated here
  archive.write("pytorch_version", c10::IValue("1.5.0"));
  OutputArchive state(archive.compilation_unit());
  OutputArchive groups(archive.compilation_unit());
  groups.write("param_groups/size", at::scalar_tensor(static_cast<int64_t>(sd.groups.size()),
                                                      at::kLong));
  int64_t key = 0;
  for (size_t g = 0; g < sd.groups.size(); ++g) {
    const auto& group = sd.groups[g];
    OutputArchive group_archive(archive.compilation_unit());
    group_archive.write("params/size", at::scalar_tensor(static_cast<int64_t>(group.params.size()),
                                                         at::kLong));
    for (size_t j = 0; j < group.params.size(); ++j, ++key) {
      group_archive.write(fmt::format("params/{}", j), c10::IValue(std::to_string(key)));
      const auto& buffers = group.params[j].state;
      if (buffers.empty()) continue;
      OutputArchive param(archive.compilation_unit());
      if (keeps_step(group.rule)) param.write("step", c10::IValue(sd.step));
      for (const auto& [name, tensor] : buffers) param.write(name, c10::IValue(tensor));
      state.write(std::to_string(key), param);
    }
    OutputArchive options(archive.compilation_unit());
    write_options(options, group.rule);
    group_archive.write("options", options);
    groups.write(fmt::format("param_groups/{}", g), group_archive);
  }
  archive.write("state", state);
  archive.write("param_groups", groups);
}

// Every rank reads the archive; the parse is agreed on before load_state_dict (collective) runs,
// so a rank that cannot read it fails every rank instead of leaving them waiting.
void DistributedOptimizer::load(torch::serialize::InputArchive& archive) {
  OptimizerStateDict sd;
  detail::agree(
      *communicator(), options().timeout, "reading an optimizer archive",
      "no rank changed its optimizer", [&] {
        detail::check_has_torch_state(detail::shard_access(*this), "torch::load");
        c10::IValue version;
        SHARDOPT_CHECK(archive.try_read("pytorch_version", version), Checkpoint,
                       "optimizer: torch::load: the archive is not a torch::optim optimizer "
                       "state (no 'pytorch_version'); sharded checkpoints load with "
                       "load_checkpoint(dir)");
        InputArchive state, groups;
        archive.read("state", state);
        archive.read("param_groups", groups);
        // The state of every key: its buffers and its step.
        std::map<std::string, OptimizerStateDict::Param> by_key;
        std::set<int64_t> steps;
        const std::vector<std::string> names = detail::state_names(group_rule(0));
        for (const std::string& key : state.keys()) {
          InputArchive param;
          if (key == "training" || !state.try_read(key, param)) continue;
          auto& entry = by_key[key];
          for (const std::string& buffer : param.keys()) {
            if (buffer == "training" || buffer == "step") continue;
            SHARDOPT_CHECK(std::find(names.begin(), names.end(), buffer) != names.end(), Mismatch,
                           "optimizer: torch::load: the archive holds '{}' state, but this "
                           "optimizer ({}) keeps [{}]",
                           buffer, rule_name(group_rule(0)), fmt::join(names, ", "));
            c10::IValue v;
            param.read(buffer, v);
            // Note [Tensors from files] (checkpoint/staging.hpp)
            detail::check_tensor_from_file(
                v.toTensor(),
                fmt::format("optimizer: torch::load: '{}' of state '{}'", buffer, key));
            entry.state[buffer] = v.toTensor();
          }
          c10::IValue step;
          if (param.try_read("step", step)) steps.insert(step.toInt());
        }
        SHARDOPT_CHECK(steps.size() <= 1, Unsupported,
                       "optimizer: torch::load: parameters were saved at different steps ({}); "
                       "shardopt keeps one step count for all of them",
                       fmt::join(steps, ", "));
        sd.step = steps.empty() ? 0 : *steps.begin();
        const int64_t group_count = read_size(groups, "param_groups/size");
        for (int64_t g = 0; g < group_count; ++g) {
          InputArchive group_archive;
          groups.read(fmt::format("param_groups/{}", g), group_archive);
          OptimizerStateDict::Group group;
          group.rule = group_rule(std::min<size_t>(g, param_groups().size() - 1));
          InputArchive options_archive;
          if (group_archive.try_read("options", options_archive)) {
            read_options(options_archive, group.rule);
          }
          const int64_t n = read_size(group_archive, "params/size");
          for (int64_t j = 0; j < n; ++j) {
            c10::IValue key;
            group_archive.read(fmt::format("params/{}", j), key);
            auto it = by_key.find(key.toStringRef());
            group.params.push_back(it == by_key.end() ? OptimizerStateDict::Param{}
                                                      : it->second);
          }
          sd.groups.push_back(std::move(group));
        }
        return detail::json();
      });
  load_state_dict(sd);
}

}  // namespace shardopt
