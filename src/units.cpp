#include "shardopt/units.hpp"

#include "shardopt/error.hpp"

namespace shardopt {

int Units::add(std::string name, std::vector<at::Tensor> parameters, UnitOptions options) {
  SHARDOPT_CHECK(runtime_ == nullptr, InvalidArgument,
                 "units: cannot add unit '{}' after an optimizer attached to these units; declare "
                 "every unit before building the optimizer", name);
  for (size_t i = 0; i < parameters.size(); ++i) {
    SHARDOPT_CHECK(parameters[i].defined(), InvalidArgument,
                   "units: parameter #{} of unit '{}' is an undefined tensor", i, name);
  }
  units_.push_back({std::move(name), std::move(parameters), options});
  return static_cast<int>(units_.size()) - 1;
}

const std::string& Units::name(int index) const {
  check_index(index);
  return units_[index].name;
}

const std::vector<at::Tensor>& Units::parameters(int index) const {
  check_index(index);
  return units_[index].parameters;
}

void Units::attach(UnitRuntime* runtime) {
  SHARDOPT_CHECK(runtime_ == nullptr || runtime_ == runtime, InvalidArgument,
                 "units: another stage-3 optimizer is already attached to these units; destroy it "
                 "first");
  runtime_ = runtime;
}

void Units::detach(const UnitRuntime* runtime) {
  if (runtime_ == runtime) runtime_ = nullptr;
}

void Units::set_recompute(int index, bool recompute) {
  check_index(index);
  units_[index].options.recompute = recompute;
}

bool Units::recomputes(int index) const {
  check_index(index);
  return units_[index].options.recompute;
}

void Units::check_plain_run(int index) const {
  SHARDOPT_CHECK(!recomputes(index), InvalidArgument,
                 "units: unit '{}' is declared to recompute, so run() needs the tensors it takes: "
                 "call run({}, fn, inputs) with fn taking const std::vector<at::Tensor>&",
                 units_[index].name, index);
}

void Units::check_index(int index) const {
  SHARDOPT_CHECK(index >= 0 && index < size(), InvalidArgument,
                 "units: no unit #{} (there are {})", index, size());
}

}  // namespace shardopt
