// Python bindings: torch.optim's hyper-parameter names <-> shardopt::Rule (bindings.hpp).
// Torch-free: only pybind11 and the rule field lists (Note [One place per rule] in
// shardopt/rules.hpp).
#include <fmt/ranges.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "shardopt/detail/rule_traits.hpp"
#include "shardopt/error.hpp"

namespace py = pybind11;

namespace shardopt::python {
namespace {

// ---- hyper-parameters: torch.optim's names <-> shardopt::Rule ---------------------------------

// Reads a {name: value} dict of torch-style hyper-parameters into one rule, rejecting unknown
// names and out-of-range values with InvalidArgument (ValueError) messages that name them.
class HyperReader {
 public:
  HyperReader(const char* rule, const py::dict& values, bool strict)
      : rule_(rule), strict_(strict) {
    for (auto item : values) {
      SHARDOPT_CHECK(py::isinstance<py::str>(item.first), InvalidArgument,
                     "optimizer: {} hyper-parameter names must be strings", rule_);
      items_.emplace(py::cast<std::string>(item.first),
                     py::reinterpret_borrow<py::object>(item.second));
    }
  }

  // lower <= value (< upper when upper_open).
  void number(const char* key, double lower, const std::function<void(double)>& set,
              double upper = std::numeric_limits<double>::infinity()) {
    known_.push_back(key);
    auto it = items_.find(key);
    if (it == items_.end()) return;
    const double v = to_double(key, it->second);
    SHARDOPT_CHECK(v >= lower && v < upper, InvalidArgument,
                   "optimizer: {} hyper-parameter '{}' must lie in [{}, {}), got {}", rule_, key,
                   lower, upper, v);
    set(v);
    items_.erase(it);
  }
  void flag(const char* key, const std::function<void(bool)>& set) {
    known_.push_back(key);
    auto it = items_.find(key);
    if (it == items_.end()) return;
    SHARDOPT_CHECK(py::isinstance<py::bool_>(it->second), InvalidArgument,
                   "optimizer: {} hyper-parameter '{}' must be True or False, got {}", rule_, key,
                   py::str(py::repr(it->second)).cast<std::string>());
    set(it->second.cast<bool>());
    items_.erase(it);
  }
  void betas(const std::function<void(double, double)>& set) {
    known_.push_back("betas");
    auto it = items_.find("betas");
    if (it == items_.end()) return;
    SHARDOPT_CHECK(py::isinstance<py::sequence>(it->second) && py::len(it->second) == 2,
                   InvalidArgument, "optimizer: {} hyper-parameter 'betas' must be a pair "
                   "(beta1, beta2), got {}", rule_,
                   py::str(py::repr(it->second)).cast<std::string>());
    py::sequence pair = it->second;
    const double b1 = to_double("betas[0]", pair[0]), b2 = to_double("betas[1]", pair[1]);
    SHARDOPT_CHECK(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1, InvalidArgument,
                   "optimizer: {} betas must lie in [0, 1), got ({}, {})", rule_, b1, b2);
    set(b1, b2);
    items_.erase(it);
  }
  // Adafactor's eps = (eps1 or None, eps2); None is the dtype's machine epsilon (eps1 < 0).
  void eps_pair(const std::function<void(double, double)>& set) {
    known_.push_back("eps");
    auto it = items_.find("eps");
    if (it == items_.end()) return;
    SHARDOPT_CHECK(py::isinstance<py::sequence>(it->second) && py::len(it->second) == 2,
                   InvalidArgument, "optimizer: {} hyper-parameter 'eps' must be a pair "
                   "(eps1 or None, eps2), got {}", rule_,
                   py::str(py::repr(it->second)).cast<std::string>());
    py::sequence pair = it->second;
    const double e1 = pair[0].is_none() ? -1.0 : to_double("eps[0]", pair[0]);
    const double e2 = to_double("eps[1]", pair[1]);
    SHARDOPT_CHECK(pair[0].is_none() || e1 >= 0, InvalidArgument,
                   "optimizer: {}: epsilon1 should be >= 0 but is: {}", rule_, e1);
    SHARDOPT_CHECK(e2 >= 0, InvalidArgument, "optimizer: {}: epsilon2 should be >= 0 but is: {}",
                   rule_, e2);
    set(e1, e2);
    items_.erase(it);
  }
  // Muon's ns_coefficients = (a, b, c).
  void triple(const char* key, const std::function<void(double, double, double)>& set) {
    known_.push_back(key);
    auto it = items_.find(key);
    if (it == items_.end()) return;
    SHARDOPT_CHECK(py::isinstance<py::sequence>(it->second) && py::len(it->second) == 3,
                   InvalidArgument, "optimizer: {} hyper-parameter '{}' must be a tuple of "
                   "exactly 3 values (a, b, c), got {}", rule_, key,
                   py::str(py::repr(it->second)).cast<std::string>());
    py::sequence abc = it->second;
    set(to_double("ns_coefficients[0]", abc[0]), to_double("ns_coefficients[1]", abc[1]),
        to_double("ns_coefficients[2]", abc[2]));
    items_.erase(it);
  }
  // A name among `choices` (None: the first) stored as its index; `extra` are the numbers also
  // accepted as themselves (Muon's adjust_lr_fn: None, "original", "match_rms_adamw",
  // "spectral_unclamped"; ns_dtype: "bfloat16", "float32", "float64" or 16, 32, 64).
  void choice(const char* key, const std::vector<std::string>& choices,
              const std::vector<double>& codes, const std::function<void(double)>& set) {
    known_.push_back(key);
    auto it = items_.find(key);
    if (it == items_.end()) return;
    double code = -1;
    if (it->second.is_none()) {
      code = codes[0];
    } else if (py::isinstance<py::str>(it->second) || py::hasattr(it->second, "is_floating_point")) {
      std::string name = py::str(it->second).cast<std::string>();
      if (name.rfind("torch.", 0) == 0) name = name.substr(6);  // a torch.dtype
      for (size_t k = 0; k < choices.size(); ++k) {
        if (name == choices[k]) code = codes[k];
      }
    } else if (!py::isinstance<py::bool_>(it->second) &&
               (PyFloat_Check(it->second.ptr()) || PyLong_Check(it->second.ptr()))) {
      const double v = it->second.cast<double>();
      if (std::find(codes.begin(), codes.end(), v) != codes.end()) code = v;
    }
    SHARDOPT_CHECK(code >= 0, InvalidArgument, "optimizer: {} hyper-parameter '{}' must be one "
                   "of {}, got {}", rule_, key, fmt::join(choices, ", "),
                   py::str(py::repr(it->second)).cast<std::string>());
    set(code);
    items_.erase(it);
  }
  // Unknown names are an error when strict (what the user wrote), ignored otherwise (what LR
  // schedulers add to param_groups: initial_lr, max_lr, ...).
  void finish() const {
    if (!strict_ || items_.empty()) return;
    SHARDOPT_FAIL(InvalidArgument,
                  "optimizer: {} has no hyper-parameter '{}'; expected one of {}", rule_,
                  items_.begin()->first, fmt::join(known_, ", "));
  }

 private:
  double to_double(const char* key, py::handle value) const {
    const bool number = !py::isinstance<py::bool_>(value) &&
                        (PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr()) ||
                         py::hasattr(value, "__float__"));
    SHARDOPT_CHECK(number, InvalidArgument,
                   "optimizer: {} hyper-parameter '{}' must be a number, got {}", rule_, key,
                   py::str(py::repr(value)).cast<std::string>());
    return py::float_(py::reinterpret_borrow<py::object>(value)).cast<double>();
  }

  const char* rule_;
  bool strict_;
  std::map<std::string, py::object> items_;
  std::vector<const char*> known_;
};

// The codec is written once over each rule's field list (Note [One place per rule] in
// shardopt/rules.hpp); torch spells the fields beta1, beta2 as one pair, 'betas'.
template <typename R>
Rule read_rule_of(HyperReader& h, const py::dict& values, bool strict) {
  if (detail::kNeedsLr<R>) {
    // torch.optim.SGD has no default learning rate either.
    SHARDOPT_CHECK(!strict || values.contains("lr"), InvalidArgument,
                   "optimizer: {} needs a learning rate, e.g. lr=0.1", R::kName);
  }
  R r = detail::blank_rule<R>();
  double* first = nullptr;  // beta1, eps1 or ns_a, set with the second of the pair
  double* second = nullptr;  // ns_b
  R::fields(r, [&](const detail::Field& f, auto& value) {
    const std::string name = f.name;
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) {
      h.flag(f.name, [&](bool v) { value = v; });
    } else if (name == "beta1" || name == "eps1" || name == "ns_a") {
      first = &value;
    } else if (name == "ns_b") {
      second = &value;
    } else if (name == "ns_c") {
      h.triple("ns_coefficients", [&](double a, double b, double c) {
        *first = a;
        *second = b;
        value = c;
      });
    } else if (name == "adjust_lr_fn") {
      h.choice("adjust_lr_fn", {"original", "match_rms_adamw", "spectral_unclamped"}, {0, 1, 2},
               [&](double v) { value = v; });
    } else if (name == "ns_dtype") {
      h.choice("ns_dtype", {"bfloat16", "float32", "float64"}, {16, 32, 64},
               [&](double v) { value = v; });
    } else if (name == "beta2" || name == "eps2") {
      auto set = [&](double v1, double v2) {
        *first = v1;
        value = v2;
      };
      if (name == "beta2") h.betas(set); else h.eps_pair(set);
    } else {
      h.number(f.name, f.lowest, [&](double v) { value = v; });
    }
  });
  const std::string problem = detail::rule_problem(r);
  SHARDOPT_CHECK(problem.empty(), InvalidArgument, "optimizer: {}: {}", R::kName, problem);
  return r;
}

}  // namespace

Rule read_rule(const std::string& name, const py::dict& values, bool strict) {
  HyperReader h(name.c_str(), values, strict);
  Rule rule;
  const bool known = detail::with_rule_named(name, [&](auto type) {
    rule = read_rule_of<typename decltype(type)::type>(h, values, strict);
  });
  SHARDOPT_CHECK(known, InvalidArgument,
                 "optimizer: unknown optimizer '{}'; expected one of {} (or a "
                 "torch.optim.Optimizer class)",
                 name, fmt::join(detail::rule_names(), ", "));
  h.finish();
  return rule;
}

// The torch-style hyper-parameter dict of a rule (what param_groups hold).
py::dict rule_dict(const Rule& rule) {
  py::dict d;
  detail::visit_torch_options(rule, [&](const char* name, const auto& value) {
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<V, std::pair<double, double>>) {
      // Adafactor's eps: a negative eps1 is torch's None.
      const bool none = std::string(name) == "eps" && value.first < 0;
      d[name] = py::make_tuple(none ? py::object(py::none()) : py::float_(value.first),
                               value.second);
    } else if constexpr (std::is_same_v<V, std::tuple<double, double, double>>) {
      d[name] = py::make_tuple(std::get<0>(value), std::get<1>(value), std::get<2>(value));
    } else if constexpr (std::is_same_v<V, double>) {
      // Muon's codes as torch spells them: adjust_lr_fn None (original) or a name; ns_dtype.
      if (std::string(name) == "adjust_lr_fn") {
        const char* names[] = {"original", "match_rms_adamw", "spectral_unclamped"};
        d[name] = value == 0 ? py::object(py::none()) : py::str(names[static_cast<int>(value)]);
      } else if (std::string(name) == "ns_steps") {  // torch iterates range(ns_steps)
        d[name] = static_cast<int64_t>(value);
      } else if (std::string(name) == "ns_dtype") {
        d[name] = value == 64 ? "float64" : value == 32 ? "float32" : "bfloat16";
      } else {
        d[name] = value;
      }
    } else {
      d[name] = value;
    }
  });
  return d;
}

}  // namespace shardopt::python
