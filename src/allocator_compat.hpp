// c10::Allocator across torch versions, for shardopt's allocators (src/memory_tracker.cpp, the
// release guard's part handles): torch 2.3 made allocate() non-const and added the pure
// copy_data().
#pragma once

#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#if defined(TORCH_VERSION_MAJOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))
#define SHARDOPT_ALLOCATE_CONST
#define SHARDOPT_ALLOCATOR_HAS_COPY_DATA 1
#else
#define SHARDOPT_ALLOCATE_CONST const
#define SHARDOPT_ALLOCATOR_HAS_COPY_DATA 0
#endif
