# Fused optimizer kernels (src/kernels): the CPU kernels go into libshardopt, one translation unit
# per instruction set, chosen at run time; the CUDA kernels build into a static library wherever
# nvcc exists (they need only the CUDA runtime, not a CUDA libtorch), so they compile in CI.

# ---- CPU ----------------------------------------------------------------------------------------
target_sources(shardopt PRIVATE src/kernels/cpu_dispatch.cpp src/kernels/cpu_scalar.cpp)
# Only explicit FMAs may fuse (Note [Kernel arithmetic]); no errno so sqrt stays an instruction.
set(_shardopt_kernel_flags -ffp-contract=off -fno-math-errno)
set_source_files_properties(src/kernels/cpu_scalar.cpp PROPERTIES
  COMPILE_OPTIONS "${_shardopt_kernel_flags}" SKIP_PRECOMPILE_HEADERS ON)
# 8-bit AdamW: scalar and AVX-512 (function-level target) in one unit, with its own driver.
target_sources(shardopt PRIVATE src/kernels/adam8bit_cpu.cpp)
set_source_files_properties(src/kernels/adam8bit_cpu.cpp PROPERTIES
  COMPILE_OPTIONS "${_shardopt_kernel_flags}" SKIP_PRECOMPILE_HEADERS ON)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")  # GCC bug 105593, as for cpu_avx512.cpp below
  set_property(SOURCE src/kernels/adam8bit_cpu.cpp APPEND PROPERTY COMPILE_OPTIONS
               -Wno-maybe-uninitialized)
endif()
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  target_sources(shardopt PRIVATE src/kernels/cpu_avx2.cpp src/kernels/cpu_avx512.cpp
                                  src/kernels/adam8bit_vbmi.cpp)
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
  # 8-bit AdamW on AVX-512 VBMI: instruction sets by function attribute (picked at run time).
  set_source_files_properties(src/kernels/adam8bit_vbmi.cpp PROPERTIES
    COMPILE_OPTIONS "${_shardopt_kernel_flags}" SKIP_PRECOMPILE_HEADERS ON)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    set_property(SOURCE src/kernels/adam8bit_vbmi.cpp APPEND PROPERTY COMPILE_OPTIONS
                 -Wno-maybe-uninitialized)
  endif()
  set_source_files_properties(src/kernels/cpu_avx512.cpp PROPERTIES
    COMPILE_OPTIONS "${_shardopt_kernel_flags};${_shardopt_avx2};${_shardopt_avx512}"
    SKIP_PRECOMPILE_HEADERS ON)
  # The checkpoint image's one-pass copy (AVX-512 by function attribute): the same GCC bug.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    set_property(SOURCE src/checkpoint/image_copy.cpp APPEND PROPERTY COMPILE_OPTIONS
                 -Wno-uninitialized -Wno-maybe-uninitialized)
  endif()
endif()

# Note [OpenMP for at::parallel_for]
# With torch's OpenMP backend (AT_PARALLEL_OPENMP, Debian's and pip's builds) at::parallel_for is
# a header template whose `#pragma omp parallel` compiles into the caller: without -fopenmp it
# runs the whole range on the calling thread. Until 2026-11-26 the kernels did exactly that, so
# their "threads" never changed anything. The kernel driver (and the benches' triad probe,
# bench/triad.hpp) compile with OpenMP and link libgomp, the runtime torch itself loads (pip's
# wheel ships its own copy under the same soname, so one runtime serves both in a process); the
# thread count is torch's (at::set_num_threads, read per thread by at::parallel_for).
set(SHARDOPT_PARALLEL_OPENMP OFF)
foreach(_dir IN LISTS TORCH_INCLUDE_DIRS)
  if(EXISTS "${_dir}/ATen/Config.h")
    file(STRINGS "${_dir}/ATen/Config.h" _omp REGEX "#define AT_PARALLEL_OPENMP 1")
    if(_omp)
      set(SHARDOPT_PARALLEL_OPENMP ON)
    endif()
    break()
  endif()
endforeach()
if(SHARDOPT_PARALLEL_OPENMP)
  find_package(OpenMP COMPONENTS CXX)
  if(OpenMP_CXX_FOUND)
    # Not through the precompiled header: parsed without _OPENMP, its ATen would be serial.
    set_property(SOURCE src/kernels/cpu_dispatch.cpp src/kernels/adam8bit_cpu.cpp APPEND
                 PROPERTY COMPILE_OPTIONS ${OpenMP_CXX_FLAGS})
    set_property(SOURCE src/kernels/cpu_dispatch.cpp PROPERTY SKIP_PRECOMPILE_HEADERS ON)
    target_link_libraries(shardopt PRIVATE OpenMP::OpenMP_CXX)
  else()
    message(WARNING "shardopt: torch uses OpenMP but this compiler has none: the fused CPU "
                    "kernels will run on one thread whatever at::set_num_threads says")
  endif()
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
