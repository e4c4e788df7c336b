// Release guard: released stage-3 parameters raise a named error when read.
//
// Note [Released parameters]
// A released unit's parameters keep their shape and autograd identity but no bytes (Note [Stage 3
// units]). Reading one used to dereference null storage (SIGSEGV) or, for view ops, fail with
// torch's "storage of size 0". The guard adds one dispatch key, TESTING_ONLY_GenericWrapper, to
// a parameter's key set while it is released; shardopt registers the only kernel for that key, a
// boxed fallback that throws Error{InvalidArgument} naming the parameter. The key ranks above
// autograd and every backend, so the fallback sees every operation on the tensor (C++ or
// Python, CPU or CUDA, views included) before any kernel touches storage. Cost: flipping one bit
// per parameter at each gather and release; no memory, no check in any kernel, nothing on the
// path of gathered parameters. Alternatives rejected: a zero-element tensor swapped in (reads
// silently give empty results and shapes change under the checkpoint code), a PROT_NONE mapping
// plus a SIGSEGV handler (can only abort, never raise), a check in our own code only (misses the
// user's reads, which is the bug). The key is documented by torch as reserved for tests: if
// another library in the process registered a fallback for it first, the guard stays off and
// released reads are unguarded, as before.
#include "engine/release_guard.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

constexpr c10::DispatchKey kReleasedKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

// The key set is a protected member of TensorImpl; a pointer to it is formed through a class
// derived from TensorImpl (never instantiated).
struct KeySetAccess : c10::TensorImpl {
  static c10::DispatchKeySet& of(c10::TensorImpl* impl) { return impl->*(&KeySetAccess::key_set_); }
};

struct Known {
  std::string name;
  std::string unit;
};
std::mutex g_mutex;
std::unordered_map<const c10::TensorImpl*, Known> g_known;  // guarded by g_mutex

std::string describe_released(const c10::TensorImpl* impl) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_known.find(impl);
  if (it == g_known.end()) return "a released stage-3 parameter";
  return fmt::format("parameter '{}' ({})", it->second.name, it->second.unit);
}

void released_read(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const c10::TensorImpl* found = nullptr;
  auto check = [&](const at::Tensor& t) {
    if (!found && t.defined() && t.key_set().has(kReleasedKey)) found = t.unsafeGetTensorImpl();
  };
  for (size_t i = stack->size() - std::min(n, stack->size()); i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      check(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) check(t);
    }
  }
  SHARDOPT_FAIL(InvalidArgument,
                "stage 3: {} is released (its values live only as shards between uses) and was "
                "read by {}; read it inside Units::run of its unit, or call "
                "DistributedOptimizer::gather_full_parameters() first",
                describe_released(found), op.schema().name());
}

// Registered on first use; false when another fallback already holds the key.
bool guard_available() {
  static const bool available = [] {
    try {
      static auto handle = std::make_unique<c10::RegistrationHandleRAII>(
          c10::Dispatcher::singleton().registerFallback(
              kReleasedKey, c10::KernelFunction::makeFromBoxedFunction<&released_read>(),
              "shardopt: released stage-3 parameter guard (src/engine/release_guard.cpp)"));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return available;
}

}  // namespace

void remember_parameter(const at::Tensor& param, std::string name, std::string unit) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_known[param.unsafeGetTensorImpl()] = Known{std::move(name), std::move(unit)};
}

void forget_parameter(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_known.erase(param.unsafeGetTensorImpl());
}

void guard_released(const at::Tensor& param) {
  if (!guard_available()) return;
  auto& keys = KeySetAccess::of(param.unsafeGetTensorImpl());
  keys = keys.add(kReleasedKey);
}

void unguard(const at::Tensor& param) {
  auto& keys = KeySetAccess::of(param.unsafeGetTensorImpl());
  keys = keys.remove(kReleasedKey);
}

}  // namespace shardopt::detail
