# Python bindings: found when pybind11 is installed and an interpreter imports the torch whose
# libtorch this build links (mixing two builds of torch in one process breaks at import or later).
# The interpreter is SHARDOPT_PYTHON_EXECUTABLE, else /usr/bin/python3 (Debian's python3-torch;
# a pyenv/conda `python3` earlier on PATH usually has no torch or another one), else python3.

set(SHARDOPT_PYTHON_EXECUTABLE "" CACHE FILEPATH
    "Interpreter the Python bindings are built for (default: /usr/bin/python3)")

# shardopt_python_available(<out>): sets <out> ON/OFF and, when ON, these variables in the caller:
#   SHARDOPT_PYTHON           the interpreter
#   SHARDOPT_TORCH_PYTHON_LIB libtorch_python of that interpreter's torch
#   SHARDOPT_PYBIND11_ABI     compile definitions that make our pybind11 types share torch's
#                             registry (needed to accept torch.distributed process groups)
function(shardopt_python_available out)
  set(${out} OFF PARENT_SCOPE)
  set(python "${SHARDOPT_PYTHON_EXECUTABLE}")
  if(NOT python)
    if(EXISTS /usr/bin/python3)
      set(python /usr/bin/python3)
    else()
      find_program(python NAMES python3)
    endif()
  endif()
  if(NOT python)
    message(STATUS "shardopt: Python bindings off: no python3 interpreter")
    return()
  endif()
  execute_process(
    COMMAND "${python}" -c
      "import os, torch; c = torch._C; print('|'.join([torch.__version__.split('+')[0], os.path.join(os.path.dirname(torch.__file__), 'lib')] + [getattr(c, '_PYBIND11_' + k, '') for k in ('COMPILER_TYPE', 'STDLIB', 'BUILD_ABI')]))"
    RESULT_VARIABLE rc OUTPUT_VARIABLE lines ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(STATUS "shardopt: Python bindings off: ${python} cannot import torch")
    return()
  endif()
  # One line, '|' between fields: torch >= 2.x with pybind11 3 has no _PYBIND11_* attributes
  # (its ABI id is compiled into the headers, which we take from torch), so fields may be empty.
  string(REPLACE "|" ";" lines "${lines}")
  list(GET lines 0 py_torch_version)
  list(GET lines 1 py_torch_lib)
  list(GET lines 2 pb_compiler)
  list(GET lines 3 pb_stdlib)
  list(GET lines 4 pb_abi)
  # The same libtorch: CMake's and the interpreter's must be one file (Debian symlinks
  # torch/lib into /usr/lib/<arch>; pip wheels carry their own, found via CMAKE_PREFIX_PATH).
  get_filename_component(cmake_torch "${TORCH_LIBRARY}" REALPATH)
  get_filename_component(py_torch "${py_torch_lib}/libtorch.so" REALPATH)
  string(REGEX REPLACE "\\.so.*$" "" cmake_torch_stem "${cmake_torch}")
  string(REGEX REPLACE "\\.so.*$" "" py_torch_stem "${py_torch}")
  if(NOT cmake_torch_stem STREQUAL py_torch_stem)
    message(STATUS "shardopt: Python bindings off: ${python} imports torch ${py_torch_version} "
                   "from ${py_torch_lib}, but this build links ${TORCH_LIBRARY}; configure with "
                   "CMAKE_PREFIX_PATH=$(${python} -c 'import torch; print(torch.utils.cmake_prefix_path)')")
    return()
  endif()
  find_library(torch_python_lib torch_python PATHS "${py_torch_lib}" NO_DEFAULT_PATH)
  if(NOT torch_python_lib)
    message(STATUS "shardopt: Python bindings off: no libtorch_python in ${py_torch_lib}")
    return()
  endif()
  set(Python_EXECUTABLE "${python}")
  find_package(Python 3 COMPONENTS Interpreter Development.Module QUIET)
  if(NOT Python_FOUND)
    message(STATUS "shardopt: Python bindings off: no Python headers for ${python} (python3-dev)")
    return()
  endif()
  set(PYBIND11_FINDPYTHON ON)
  find_package(pybind11 CONFIG QUIET)
  if(NOT pybind11_FOUND)
    message(STATUS "shardopt: Python bindings off: pybind11 not found (pybind11-dev)")
    return()
  endif()
  set(abi "")
  if(pb_compiler)
    list(APPEND abi PYBIND11_COMPILER_TYPE="${pb_compiler}" PYBIND11_STDLIB="${pb_stdlib}"
                    PYBIND11_BUILD_ABI="${pb_abi}")
  endif()
  set(SHARDOPT_PYTHON "${python}" PARENT_SCOPE)
  set(SHARDOPT_TORCH_PYTHON_LIB "${torch_python_lib}" PARENT_SCOPE)
  set(SHARDOPT_PYBIND11_ABI "${abi}" PARENT_SCOPE)
  set(${out} ON PARENT_SCOPE)
  message(STATUS "shardopt: Python bindings for ${python} (torch ${py_torch_version}, "
                 "pybind11 ${pybind11_VERSION})")
endfunction()

# shardopt_python_probe(out label code lacks): "" when SHARDOPT_PYTHON runs `code` (which prints a
# version), else why the tests it guards are named skips ("lacks" says what is missing).
function(shardopt_python_probe out label code lacks)
  if(NOT SHARDOPT_PYTHON)
    set(${out} "no Python with torch for this build (${label} run on the pip platform: scripts/test.sh --platform pip)" PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND "${SHARDOPT_PYTHON}" -c "${code}"
                  OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc ERROR_QUIET)
  if(rc EQUAL 0)
    message(STATUS "shardopt: ${label} with ${version} (${SHARDOPT_PYTHON})")
    set(${out} "" PARENT_SCOPE)
  else()
    set(${out} "${SHARDOPT_PYTHON} has no ${lacks} (the pip platform's venv has them: scripts/test.sh --platform pip)" PARENT_SCOPE)
  endif()
endfunction()

# shardopt_hf_reason(out): the Hugging Face client tests need transformers, tokenizers and
# safetensors (tests/example/bert_hf_client_test.sh, test_hf_bert.py).
function(shardopt_hf_reason out)
  shardopt_python_probe(reason "the Hugging Face client tests"
    "import transformers, tokenizers, safetensors; print('transformers', transformers.__version__)"
    "transformers, tokenizers or safetensors")
  set(${out} "${reason}" PARENT_SCOPE)
endfunction()

# shardopt_peers_reason(out): bench/peers/ needs torch's FSDP2 fully_shard, DeepSpeed and ninja
# for its JIT-built ops. DeepSpeed is found, not imported (its import probes accelerators and
# prints to stdout).
function(shardopt_peers_reason out)
  shardopt_python_probe(reason "the peer tests (DeepSpeed, FSDP2)"
    "import importlib.metadata as m, importlib.util as u, ninja; from torch.distributed.fsdp import fully_shard; assert u.find_spec('deepspeed'); print('DeepSpeed', m.version('deepspeed'))"
    "DeepSpeed, ninja or torch's fully_shard")
  set(${out} "${reason}" PARENT_SCOPE)
endfunction()
