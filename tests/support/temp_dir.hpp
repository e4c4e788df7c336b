// A fresh directory under TMPDIR (default /tmp), removed with the test.
#pragma once

#include <stdlib.h>  // mkdtemp

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "checkpoint/files.hpp"

namespace shardopt::test {

class TempDir {
 public:
  // `prefix` names the test's directories, e.g. "shardopt-ckpt".
  explicit TempDir(const std::string& prefix) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp ? tmp : "/tmp") + "/" + prefix + "-XXXXXX";
    path_ = mkdtemp(templ.data());
  }
  ~TempDir() {
    std::error_code ec;
    detail::remove_tree(path_, ec);  // Note [No std::filesystem::remove_all]
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace shardopt::test
