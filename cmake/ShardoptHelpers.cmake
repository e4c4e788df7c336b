# Helpers shared by the library, tests and benchmarks.

function(shardopt_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()

# Gloo: torch's c10d headers with ProcessGroupGloo plus Gloo's own headers/library. One adapter
# for torch 1.13 and 2.x (Note [c10d across torch versions] in process_group_communicator.cpp).
function(shardopt_gloo_available out)
  find_package(Gloo QUIET CONFIG)
  find_file(_pg_gloo torch/csrc/distributed/c10d/ProcessGroupGloo.hpp PATHS ${TORCH_INCLUDE_DIRS})
  if(Gloo_FOUND AND TARGET gloo AND _pg_gloo)
    set(${out} ON PARENT_SCOPE)
  elseif(_pg_gloo AND NOT TARGET gloo)
    # pip wheels: no Gloo package, but Gloo's headers next to torch's and its code in libtorch.
    find_file(_gloo_h gloo/algorithm.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
    if(_gloo_h)
      add_library(gloo INTERFACE IMPORTED GLOBAL)
      message(STATUS "shardopt: Gloo from torch's own headers and libraries (${_gloo_h})")
      set(${out} ON PARENT_SCOPE)
    else()
      set(${out} OFF PARENT_SCOPE)
    endif()
  else()
    message(STATUS "shardopt: no Gloo engine: Gloo package found=${Gloo_FOUND}, "
                   "c10d ProcessGroupGloo.hpp at '${_pg_gloo}'")
    set(${out} OFF PARENT_SCOPE)
  endif()
endfunction()

# Links lld when available: linking against libtorch is several seconds faster.
find_program(SHARDOPT_LLD ld.lld)
function(shardopt_fast_link target)
  if(SHARDOPT_LLD)
    target_link_options(${target} PRIVATE -fuse-ld=lld)
  endif()
endfunction()

# shardopt_add_mpi_test(NAME name RANKS n COMMAND exe args... [TIMEOUT s])
# Runs under mpirun; PROCESSORS and RESOURCE_LOCK keep oversubscribed jobs from piling up.
function(shardopt_add_mpi_test)
  cmake_parse_arguments(T "" "NAME;RANKS;TIMEOUT" "COMMAND;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  add_test(NAME ${T_NAME}
           COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root --bind-to none
                   -np ${T_RANKS} ${T_COMMAND})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${T_RANKS}
                       RESOURCE_LOCK mpi LABELS "dist;${T_LABELS}"
                       ENVIRONMENT "OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1;OMPI_MCA_btl=self,vader;OMPI_MCA_rmaps_base_oversubscribe=1")
endfunction()
