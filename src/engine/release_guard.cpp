// Release guard: released stage-3 parameters raise a named error when read.
//
// Note [Released parameters]
// A released unit's parameters keep their shape and autograd identity but no bytes (Note [Stage 3
// units]); reading one would dereference null storage (SIGSEGV) or fail with torch's "storage of
// size 0". The guard adds one dispatch key, TESTING_ONLY_GenericWrapper, to a released
// parameter's key set; our boxed fallback for that key throws Error{InvalidArgument} naming the
// parameter. The key ranks above autograd and every backend, so the fallback sees every operation
// on the tensor (C++ or Python, CPU or CUDA, views included) before any kernel touches storage.
// Cost: one bit flipped per parameter at each gather and release, nothing on gathered parameters.
// Rejected: a zero-element tensor swapped in (silent empty results, shapes change under the
// checkpoint code), a PROT_NONE mapping and a SIGSEGV handler (can only abort), a check in our
// own code only (misses the user's reads). The key is reserved for tests by torch: if another
// library registered a fallback for it first, the guard stays off and released reads go unguarded.
#include "engine/release_guard.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator_compat.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

// Note [Part registration]
// The fallback must find, from any tensor carrying the key (a parameter, or a view autograd saved,
// weight.t()), which scheduler and part own its bytes. They all share the storage, which keeps its
// allocator with or without bytes: the part store registers a part by making its storage allocate
// through a Handle that forwards to the storage's own allocator and carries (owner, part). The one
// path: operation -> released_read -> the storage's Handle -> owner.use(parts) (the scheduler) ->
// the store gathers. No global map, no lock per operation; the registration's end restores the
// allocator (parameters outlive the optimizer).
struct PartRegistration::Handle final : c10::Allocator {
  Handle(c10::Storage s, GatherOnUse* o, int p) : storage(std::move(s)), owner(o), part(p) {
    inner = storage.unsafeGetStorageImpl()->allocator();
    if (inner == nullptr) inner = c10::GetAllocator(storage.device().type());
  }
  c10::DataPtr allocate(size_t n) SHARDOPT_ALLOCATE_CONST override {
    return inner->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner->raw_deleter(); }
#if SHARDOPT_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner->copy_data(dest, src, count);
  }
#endif
  c10::Storage storage;
  GatherOnUse* owner;
  int part;
  c10::Allocator* inner = nullptr;
};

PartRegistration::PartRegistration(const at::Tensor& storage_holder, GatherOnUse* owner, int part)
    : handle_(std::make_unique<Handle>(storage_holder.storage(), owner, part)) {
  handle_->storage.unsafeGetStorageImpl()->set_allocator(handle_.get());
}

PartRegistration::~PartRegistration() {
  handle_->storage.unsafeGetStorageImpl()->set_allocator(handle_->inner);
}

namespace {

constexpr c10::DispatchKey kReleasedKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

// The key set is a protected member of TensorImpl; a pointer to it is formed through a class
// derived from TensorImpl (never instantiated).
struct KeySetAccess : c10::TensorImpl {
  static c10::DispatchKeySet& of(c10::TensorImpl* impl) { return impl->*(&KeySetAccess::key_set_); }
};

struct Known {
  std::string name;
  std::string part_label;
};
std::mutex g_mutex;
std::unordered_map<const c10::TensorImpl*, Known> g_known;  // guarded by g_mutex

std::string describe_released(const c10::TensorImpl* impl) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_known.find(impl);
  if (it == g_known.end()) return "a released stage-3 parameter";
  return fmt::format("parameter '{}' ({})", it->second.name, it->second.part_label);
}

// No bytes behind a tensor that has elements: a released part's storage.
bool without_bytes(const at::Tensor& t) {
  return t.numel() > 0 && t.has_storage() && t.storage().data() == nullptr;
}

// Every operation on a tensor carrying the key lands here: automatic parts are gathered (Note
// [Automatic units]), then the operation proceeds below the key; a tensor still without bytes
// (an explicit unit's released parameter) raises the named error.
void released_read(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  std::vector<at::Tensor> keyed;
  auto note = [&](const at::Tensor& t) {
    if (t.defined() && t.key_set().has(kReleasedKey)) keyed.push_back(t);
  };
  for (size_t i = stack->size() - std::min(n, stack->size()); i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      note(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) note(t);
    } else if (v.isList()) {  // Tensor?[] (index)
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) note(e.toTensor());
      }
    }
  }
  GatherOnUse* owner = nullptr;  // one optimizer's parts per operation (several: each in turn)
  std::vector<int> parts;
  const c10::TensorImpl* first = nullptr;  // the owner's first tensor, for the message
  auto flush = [&] {
    if (owner != nullptr) {
      try {
        owner->use(parts);
      } catch (const Error& e) {
        // The gather is a collective: a read that only this rank makes (outside any pass) waits
        // for ranks that never join. Name what was read, as for a released explicit unit.
        if (e.kind() != ErrorKind::Timeout) throw;
        SHARDOPT_FAIL(Timeout,
                      "stage 3: {} is released (its values live only as shards between uses) and "
                      "was read by {}, but gathering it on first use did not complete: every rank "
                      "must run the same operations on the parameters (a read on one rank alone "
                      "cannot be served; call DistributedOptimizer::gather_full_parameters() on "
                      "every rank first), or a rank died or stalled. {}",
                      describe_released(first), op.schema().name(), e.what());
      }
    }
    owner = nullptr;
    parts.clear();
  };
  for (const auto& t : keyed) {
    if (!t.has_storage()) continue;
    const auto* g = dynamic_cast<const PartRegistration::Handle*>(
        t.storage().unsafeGetStorageImpl()->allocator());
    if (g == nullptr) continue;  // not a registered part: an explicit unit's parameter
    if (g->owner != owner) {
      flush();
      first = t.unsafeGetTensorImpl();
    }
    owner = g->owner;
    if (std::find(parts.begin(), parts.end(), g->part) == parts.end()) parts.push_back(g->part);
  }
  flush();
  for (const auto& t : keyed) {
    SHARDOPT_CHECK(!without_bytes(t), InvalidArgument,
                   "stage 3: {} is released (its values live only as shards between uses) and "
                   "was read by {}; read it inside Units::run of its unit, or call "
                   "DistributedOptimizer::gather_full_parameters() first",
                   describe_released(t.unsafeGetTensorImpl()), op.schema().name());
  }
  c10::impl::ExcludeDispatchKeyGuard below(kReleasedKey);
  op.callBoxed(stack);
}

}  // namespace

// Registered on first use; false when another fallback already holds the key.
bool release_guard_available() {
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

void remember_parameter(const at::Tensor& param, std::string name, std::string part_label) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_known[param.unsafeGetTensorImpl()] = Known{std::move(name), std::move(part_label)};
}

void forget_parameter(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_known.erase(param.unsafeGetTensorImpl());
}

void guard_released(const at::Tensor& param) {
  if (!release_guard_available()) return;
  auto& keys = KeySetAccess::of(param.unsafeGetTensorImpl());
  keys = keys.add(kReleasedKey);
}

void unguard(const at::Tensor& param) {
  auto& keys = KeySetAccess::of(param.unsafeGetTensorImpl());
  keys = keys.remove(kReleasedKey);
}

}  // namespace shardopt::detail
