// expect_error(): the one way tests check that a call fails with a named shardopt::Error.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardopt/error.hpp"

namespace shardopt::test {

// Runs `fn`, expecting a shardopt::Error of `kind` whose message contains every needle; a
// failure otherwise. Returns the message ("" when nothing was thrown) for further checks.
template <typename Fn>
std::string expect_error(Fn&& fn, ErrorKind kind, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), kind) << what;
    for (const auto& n : needles) {
      EXPECT_NE(what.find(n), std::string::npos) << "missing '" << n << "' in: " << what;
    }
    return what;
  }
  ADD_FAILURE() << "expected an error of kind " << to_string(kind) << " mentioning '"
                << (needles.empty() ? std::string() : needles.front()) << "'";
  return "";
}

}  // namespace shardopt::test
