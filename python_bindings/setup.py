"""pip install ./python_bindings: builds shardopt with CMake for the running interpreter's torch and
packages the module with libshardopt next to it (the extension's RPATH is $ORIGIN).

Debian's system Python is externally managed (PEP 668): install into a virtual environment that
sees python3-torch, e.g.

    /usr/bin/python3 -m venv --system-site-packages .venv
    .venv/bin/pip install ./python_bindings

The CMake build directory is $SHARDOPT_BUILD_DIR, else <repo>/build-pip (reused by later
installs); CMAKE_PREFIX_PATH is taken from torch.utils.cmake_prefix_path unless set.
"""
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def version():
    parts = {}
    with open(os.path.join(ROOT, "include", "shardopt", "version.hpp")) as f:
        for line in f:
            for part in ("MAJOR", "MINOR", "PATCH"):
                if line.startswith(f"#define SHARDOPT_VERSION_{part} "):
                    parts[part] = line.split()[-1]
    return "{MAJOR}.{MINOR}.{PATCH}".format(**parts)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch.utils

        build = os.environ.get("SHARDOPT_BUILD_DIR") or os.path.join(ROOT, "build-pip")
        args = ["-DSHARDOPT_BUILD_PYTHON=ON", "-DSHARDOPT_PYTHON_INSTALL_DIR:STRING=.",
                f"-DSHARDOPT_PYTHON_EXECUTABLE={sys.executable}"]
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            args += ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DSHARDOPT_BUILD_TESTS=OFF",
                     "-DSHARDOPT_BUILD_EXAMPLES=OFF", "-DSHARDOPT_BUILD_BENCH=OFF"]
            if "CMAKE_PREFIX_PATH" not in os.environ:
                args.append(f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}")
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build] + args)
        subprocess.check_call(["cmake", "--build", build, "--target", "shardopt_python"])
        # Installs shardopt/{*.py, _C*.so, libshardopt.so.N} under build_lib.
        subprocess.check_call(["cmake", "--install", build, "--component", "python", "--prefix",
                               os.path.abspath(self.build_lib)])


setup(
    name="shardopt",
    version=version(),
    description="ZeRO-style sharded data-parallel optimizers (stages 0-3) for PyTorch, in C++",
    packages=["shardopt"],
    ext_modules=[Extension("shardopt._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.8",
    zip_safe=False,
)
