# Fused optimizer kernels (src/kernels): the CPU kernels go into libshardopt, one translation unit
# per instruction set, chosen at run time; the CUDA kernels build into a static library wherever
# nvcc exists (they need only the CUDA runtime, not a CUDA libtorch), so they compile in CI.

# ---- CPU ----------------------------------------------------------------------------------------
target_sources(shardopt PRIVATE src/kernels/cpu_dispatch.cpp src/kernels/cpu_scalar.cpp)
# Only explicit FMAs may fuse (Note [Kernel arithmetic]); no errno so sqrt stays an instruction.
set(_shardopt_kernel_flags -ffp-contract=off -fno-math-errno)
set_source_files_properties(src/kernels/cpu_scalar.cpp PROPERTIES
  COMPILE_OPTIONS "${_shardopt_kernel_flags}" SKIP_PRECOMPILE_HEADERS ON)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  target_sources(shardopt PRIVATE src/kernels/cpu_avx2.cpp src/kernels/cpu_avx512.cpp)
  target_compile_definitions(shardopt PRIVATE SHARDOPT_KERNELS_X86)
  set(_shardopt_avx2 -mavx2 -mfma -mf16c)
  set(_shardopt_avx512 -mavx512f -mavx512bw -mavx512vl)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12 flags the _mm512_undefined_*() inside its own intrinsics (GCC bug 105593), dozens
    # of times per TU.
    list(APPEND _shardopt_avx512 -Wno-maybe-uninitialized)
  endif()
  set_source_files_properties(src/kernels/cpu_avx2.cpp PROPERTIES
    COMPILE_OPTIONS "${_shardopt_kernel_flags};${_shardopt_avx2}" SKIP_PRECOMPILE_HEADERS ON)
  set_source_files_properties(src/kernels/cpu_avx512.cpp PROPERTIES
    COMPILE_OPTIONS "${_shardopt_kernel_flags};${_shardopt_avx2};${_shardopt_avx512}"
    SKIP_PRECOMPILE_HEADERS ON)
endif()

# ---- CUDA ---------------------------------------------------------------------------------------
# check_language(CUDA) ran in the top-level file (CMAKE_CUDA_COMPILER set when nvcc works).
set(_shardopt_cuda_kernels_default OFF)
if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
  set(_shardopt_cuda_kernels_default ON)
endif()
option(SHARDOPT_WITH_CUDA_KERNELS
       "Fused CUDA optimizer kernels on raw pointers (nvcc + CUDA runtime only)"
       ${_shardopt_cuda_kernels_default})
if(SHARDOPT_WITH_CUDA_KERNELS)
  set(CMAKE_CUDA_ARCHITECTURES ${SHARDOPT_CUDA_ARCHITECTURES})  # CMakeLists.txt
  enable_language(CUDA)
  add_library(shardopt_cuda_kernels STATIC src/kernels/adam_cuda.cu src/kernels/sgd_lamb_cuda.cu
                                          src/kernels/finite_cuda.cu)
  set_target_properties(shardopt_cuda_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON
                        CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_include_directories(shardopt_cuda_kernels
    PUBLIC ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  # It calls into libshardopt (errors, the shared coefficients): link-only, so nvcc never sees
  # torch's compile flags, except the C++ ABI flag, which its std::string arguments must share
  # (pip wheels before torch 2.7 build with _GLIBCXX_USE_CXX11_ABI=0).
  if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
    target_compile_definitions(shardopt_cuda_kernels PRIVATE _GLIBCXX_USE_CXX11_ABI=${CMAKE_MATCH_1})
  endif()
  target_link_libraries(shardopt_cuda_kernels PUBLIC CUDA::cudart fmt::fmt INTERFACE shardopt)
  # The FusedKernels seam's CUDA side: a plugin library that libshardopt loads on first need
  # (src/plugins.hpp), so that libshardopt itself never links CUDA. It needs torch's CPU headers
  # only (c10's device-guard interface for stream order), so it builds in CI as well.
  add_library(shardopt_cuda SHARED src/engine/fused_kernels_cuda.cpp)
  add_library(shardopt::cuda ALIAS shardopt_cuda)
  target_include_directories(shardopt_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(shardopt_cuda PUBLIC shardopt
                        PRIVATE $<BUILD_INTERFACE:shardopt_cuda_kernels> CUDA::cudart)
  shardopt_warnings(shardopt_cuda)
  install(TARGETS shardopt_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  message(STATUS "shardopt: CUDA kernels for architectures ${CMAKE_CUDA_ARCHITECTURES}")
endif()
