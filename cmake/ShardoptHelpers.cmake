# Helpers shared by the library, tests and benchmarks.

function(shardopt_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()

# Gloo: torch's c10d headers with ProcessGroupGloo plus Gloo's own headers/library. One adapter
# for torch 1.13 and 2.x (Note [c10d across torch versions] in process_group_communicator.cpp).
function(shardopt_gloo_available out)
  set(${out} OFF PARENT_SCOPE)
  find_file(_pg_gloo torch/csrc/distributed/c10d/ProcessGroupGloo.hpp PATHS ${TORCH_INCLUDE_DIRS}
            NO_DEFAULT_PATH)
  find_file(_gloo_h gloo/algorithm.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  if(NOT _pg_gloo)
    set(SHARDOPT_GLOO_OFF_REASON "torch has no c10d ProcessGroupGloo.hpp" PARENT_SCOPE)
    message(STATUS "shardopt: Gloo engine off: torch has no c10d ProcessGroupGloo.hpp")
  elseif(NOT _gloo_h)
    # pip's wheels: ProcessGroupGloo.hpp includes <gloo/...>, which torch/include does not carry;
    # another Gloo's headers (Debian's libgloo-dev) describe another build than the one inside
    # libtorch (its Store lacks the virtuals torch's GlooStore overrides).
    set(SHARDOPT_GLOO_OFF_REASON "torch's include directory has ProcessGroupGloo.hpp but not Gloo's own headers (gloo/*.h)" PARENT_SCOPE)
    message(STATUS "shardopt: Gloo engine off: ${TORCH_INSTALL_PREFIX}/include has "
                   "ProcessGroupGloo.hpp but not Gloo's own headers (gloo/*.h)")
  else()
    find_package(Gloo QUIET CONFIG)
    if(NOT TARGET gloo)
      # Gloo's headers next to torch's and its code inside libtorch.
      add_library(gloo INTERFACE IMPORTED GLOBAL)
      message(STATUS "shardopt: Gloo from torch's own headers and libraries (${_gloo_h})")
    endif()
    set(${out} ON PARENT_SCOPE)
  endif()
endfunction()

# Links lld when available: linking against libtorch is several seconds faster.
find_program(SHARDOPT_LLD ld.lld)
function(shardopt_fast_link target)
  if(SHARDOPT_LLD)
    target_link_options(${target} PRIVATE -fuse-ld=lld)
  endif()
endfunction()

# shardopt_skipped_test(NAME name REASON text [LABELS labels...]): a CTest entry for a test this
# build cannot run (e.g. no Gloo engine against pip's torch): it prints "skipped: <reason>" and
# CTest counts it as skipped, so the summary names it instead of silently having one entry less.
function(shardopt_skipped_test)
  cmake_parse_arguments(T "" "NAME;REASON" "LABELS" ${ARGN})
  add_test(NAME ${T_NAME} COMMAND sh -c "echo \"skipped: $1\"; exit 77" skip "${T_REASON}")
  set_tests_properties(${T_NAME} PROPERTIES SKIP_RETURN_CODE 77 LABELS "${T_LABELS}")
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

# shardopt_split_entry(ENTRY N FIELDS_VAR FILTER_VAR): a test table's "f1:...:fN:Suite.*:Other*"
# entry -> its first N fields as a list in FIELDS_VAR, the rest (a gtest filter) in FILTER_VAR.
function(shardopt_split_entry entry n fields_var filter_var)
  string(REPLACE ":" ";" _parts "${entry}")
  list(SUBLIST _parts 0 ${n} _fields)
  list(SUBLIST _parts ${n} -1 _rest)
  string(REPLACE ";" ":" _filter "${_rest}")
  set(${fields_var} "${_fields}" PARENT_SCOPE)
  set(${filter_var} "${_filter}" PARENT_SCOPE)
endfunction()
