# Installs the build into a private prefix, configures the consumer project against it with
# find_package(shardopt) (the CUDA toolkit made unfindable: the package must not need it), builds it
# and runs it. Fails on the first step that fails. EXTRA_PREFIX_PATH: where this build found torch
# (pip's); TORCH_NEEDS_CUDA: torch's own CMake config needs the CUDA toolkit (pip's CUDA wheels),
# so it stays findable there.
function(step)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: '${ARGV}' failed (${rc})")
  endif()
endfunction()
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
set(no_cuda -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDA=ON)
if(TORCH_NEEDS_CUDA)
  set(no_cuda)
endif()
string(REPLACE "|" ";" extra "${EXTRA_PREFIX_PATH}")
# Not through step(): its ${ARGV} would split the prefix list at each ';' into separate arguments,
# leaving pip's torch/ (where TorchConfig must find the wheel's libtorch.so before the system's)
# off CMAKE_PREFIX_PATH.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${prefix};${extra}"
                        ${no_cuda} "-DCMAKE_EXE_LINKER_FLAGS=${CONSUMER_LINKER_FLAGS}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer test: configuring the consumer project failed (${rc})")
endif()
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/consumer)
