# CTest docs_api: builds the API reference with Doxygen (docs/Doxyfile.in) and fails on any
# warning, printing them. Doxygen is looked up when the test runs, so installing it
# (scripts/setup.sh does) needs no reconfigure; without it the test fails and says so.
#   cmake -DDOXYFILE=build/docs/Doxyfile -DOUT=build/docs/api -P run_doxygen.cmake
find_program(DOXYGEN_EXE doxygen)
if(NOT DOXYGEN_EXE)
  message(FATAL_ERROR "docs_api: doxygen is not installed; scripts/setup.sh installs it (Debian "
                      "package 'doxygen'), or: apt-get install doxygen")
endif()
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
execute_process(COMMAND ${DOXYGEN_EXE} ${DOXYFILE} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
set(log "")
if(EXISTS ${OUT}/warnings.log)
  file(READ ${OUT}/warnings.log log)
endif()
if(NOT rc EQUAL 0 OR NOT log STREQUAL "")
  string(REGEX MATCHALL "\n" lines "\n${log}")
  list(LENGTH lines n)
  message(FATAL_ERROR "docs_api: doxygen reported ${n} lines of warnings (a public name in "
                      "include/shardopt needs a /// comment):\n${log}${err}")
endif()
message(STATUS "docs_api: API reference without warnings: ${OUT}/html/index.html")
