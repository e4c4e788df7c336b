# Note [One owner of releases] (src/engine/part_scheduler.hpp): only the part store
# (part_store.*) and the stage-3 schedulers (part_scheduler.*, auto_gather.cpp) gather,
# prefetch or release parts. Fails naming each other line in src/ that calls the store to.
#   cmake -DSOURCE_DIR=<checkout> -P tests/cmake/release_rule.cmake
cmake_policy(SET CMP0057 NEW)
file(GLOB_RECURSE _sources "${SOURCE_DIR}/src/*.cpp" "${SOURCE_DIR}/src/*.hpp"
     "${SOURCE_DIR}/src/*.cu")
set(_allowed part_store.cpp part_store.hpp part_scheduler.cpp part_scheduler.hpp
    auto_gather.cpp)
set(_calls "store_?(\\.|->)(release\\([^)]|gather_[a-z_]+\\(|prefetch[a-z_]*\\()")
set(_found "")
foreach(_file ${_sources})
  get_filename_component(_name "${_file}" NAME)
  if(_name IN_LIST _allowed)
    continue()
  endif()
  file(STRINGS "${_file}" _lines REGEX "${_calls}")
  foreach(_line ${_lines})
    string(STRIP "${_line}" _line)
    string(APPEND _found "\n  ${_file}: ${_line}")
  endforeach()
endforeach()
if(_found)
  message(FATAL_ERROR "stage-3 parts gathered or released outside the part store and the "
                      "schedulers (Note [One owner of releases]):${_found}")
endif()
list(LENGTH _sources _count)
message(STATUS "release rule: ${_count} files in src/, no gather/prefetch/release of a part outside "
               "the part store and the schedulers")
