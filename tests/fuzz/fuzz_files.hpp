// Shared by the optimizer-state harnesses: the outcome check, and for readers that take files by
// path (checkpoint directories, torch.save files) the input after its first byte (flags) as a
// small archive of named files, written into a
// fresh directory that is removed after the input. Record: u8 name length, the name, u32 length
// (little-endian, clamped to what is left), the bytes. The harness writes only plain names inside
// its directory (not "", ".", "..", nothing with '/' or NUL); whether the *reader* stays inside
// the directory (a manifest naming "../x") is what is fuzzed.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <map>
#include <string>

#include "checkpoint/files.hpp"
#include "shardopt/error.hpp"

namespace shardopt::fuzz {

// With SHARDOPT_FUZZ_VERBOSE set, what each reader threw (to see how far a seed gets).
inline void note(const char* what) {
  static const bool verbose = std::getenv("SHARDOPT_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "[fuzz] %s\n", what);
}

// Runs one reader: true when it returned, false when it threw shardopt::Error of one of the
// `kinds` it documents. Another kind aborts and another exception type escapes to libFuzzer:
// both are findings.
template <typename Fn>
bool returns_or_throws(Fn&& fn, std::initializer_list<ErrorKind> kinds) {
  try {
    fn();
    return true;
  } catch (const Error& e) {
    note(e.what());
    for (const ErrorKind k : kinds) {
      if (e.kind() == k) return false;
    }
    std::fprintf(stderr, "unexpected error kind: %s\n", e.what());
    std::abort();
  }
}

// name -> bytes of the archive in `data[0, size)` (later records of a name replace earlier ones).
inline std::map<std::string, std::string> decode_files(const uint8_t* data, size_t size) {
  std::map<std::string, std::string> files;
  size_t at = 0;
  while (at < size) {
    const size_t name_len = data[at++];
    if (name_len > size - at) break;
    std::string name(reinterpret_cast<const char*>(data + at), name_len);
    at += name_len;
    uint32_t len = 0;
    for (int k = 0; k < 4 && at < size; ++k) len |= static_cast<uint32_t>(data[at++]) << (8 * k);
    const size_t n = len < size - at ? len : size - at;
    const bool plain = !name.empty() && name != "." && name != ".." &&
                       name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
    if (plain) files[name] = std::string(reinterpret_cast<const char*>(data + at), n);
    at += n;
  }
  return files;
}

// The inverse, for the seed writer.
inline std::string encode_files(const std::map<std::string, std::string>& files) {
  std::string out;
  for (const auto& [name, bytes] : files) {
    out += static_cast<char>(name.size());
    out += name;
    for (int k = 0; k < 4; ++k) out += static_cast<char>((bytes.size() >> (8 * k)) & 0xff);
    out += bytes;
  }
  return out;
}

// A fresh directory under /dev/shm (else TMPDIR or /tmp), removed with this object.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (tmp ? tmp : "/tmp");
    std::string templ = base + "/shardopt-fuzz-XXXXXX";
    if (mkdtemp(templ.data()) == nullptr) std::abort();
    path_ = templ;
  }
  ~ScratchDir() {
    std::error_code ec;
    detail::remove_tree(path_, ec);  // Note [No std::filesystem::remove_all]
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  void write(const std::map<std::string, std::string>& files, const std::string& sub = "") const {
    for (const auto& [name, bytes] : files) {
      std::ofstream(*this / (sub.empty() ? name : sub + "/" + name), std::ios::binary)
          .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
  }

 private:
  std::string path_;
};

}  // namespace shardopt::fuzz
