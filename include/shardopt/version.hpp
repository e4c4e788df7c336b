/// \file
/// shardopt's version: the single source of truth (CMake parses these three lines).
#pragma once

/// Major version.
#define SHARDOPT_VERSION_MAJOR 0
/// Minor version.
#define SHARDOPT_VERSION_MINOR 1
/// Patch version.
#define SHARDOPT_VERSION_PATCH 0

namespace shardopt {
/// "MAJOR.MINOR.PATCH" of the headers this code was compiled against.
inline constexpr const char* version() { return "0.1.0"; }
}  // namespace shardopt
