// A path in the temp directory unique to this test process.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace bert {

inline std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("bert_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

}  // namespace bert
