// Loading the optional CUDA parts of shardopt (plugins.hpp).
#include "plugins.hpp"

#include <dlfcn.h>

#include <map>
#include <mutex>

#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

std::mutex& plugin_mutex() {
  static std::mutex m;
  return m;
}

// The directory libshardopt was loaded from ("" when it cannot be told).
std::string own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&load_plugin), &info) == 0 || !info.dli_fname) return "";
  const std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1);
}

NcclFactory& nccl_slot() {
  static NcclFactory factory = nullptr;
  return factory;
}

}  // namespace

std::string load_plugin(const std::string& stem) {
  std::lock_guard<std::mutex> lock(plugin_mutex());
  static std::map<std::string, std::string> outcome;  // stem -> "" or the error
  if (auto it = outcome.find(stem); it != outcome.end()) return it->second;
  const std::string file = "lib" + stem + ".so";
  std::string why;
  for (const std::string& candidate : {own_directory() + file, file}) {
    if (dlopen(candidate.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
      why.clear();
      break;
    }
    const char* err = dlerror();
    why += fmt::format("{}{}", why.empty() ? "" : "; ", err ? err : candidate + ": not loadable");
  }
  return outcome[stem] = why;
}

void register_nccl_factory(NcclFactory factory) { nccl_slot() = factory; }

NcclFactory nccl_factory() {
  if (nccl_slot() == nullptr) {
    const std::string why = load_plugin("shardopt_nccl");
    SHARDOPT_CHECK(nccl_slot() != nullptr, Unsupported,
                   "comm: the NCCL engine is not available: libshardopt_nccl could not be "
                   "loaded ({}); build shardopt where CUDA and NCCL are found",
                   why.empty() ? "it registered nothing" : why);
  }
  return nccl_slot();
}

}  // namespace shardopt::detail
