// Precompiled header for the library, tests and benchmarks (SHARDOPT_PCH): <ATen/ATen.h> alone
// costs 10-14 s per TU on 2 cores; precompiled, a TU drops to ~2.4 s.
#pragma once
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>
