/// \file
/// shardopt's version: the single source of truth. CMake and pyproject.toml's regex parse the
/// three lines below, which must stay adjacent (no comment between them).
#pragma once

/// \def SHARDOPT_VERSION_MINOR
/// Minor version.

/// \def SHARDOPT_VERSION_PATCH
/// Patch version.

/// Major version.
#define SHARDOPT_VERSION_MAJOR 0
#define SHARDOPT_VERSION_MINOR 1
#define SHARDOPT_VERSION_PATCH 0

namespace shardopt {
/// "MAJOR.MINOR.PATCH" of the headers this code was compiled against.
inline constexpr const char* version() { return "0.1.0"; }
}  // namespace shardopt
