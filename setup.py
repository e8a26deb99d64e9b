"""Builds tlt_core._C with CMake + Ninja (see CMakeLists.txt).

Environment knobs, forwarded to CMake:
  TLT_CUDA=auto|on|off   compile the CUDA kernels (auto: when nvcc is found)
  TLT_CUDA_ARCHS="90"    CUDA architectures (default "80-real;90")
  TLT_BUILD_TYPE=Debug   CMake build type (default Release)
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TLT_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={output_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DTLT_CUDA={os.environ.get('TLT_CUDA', 'auto')}",
        ]
        if "TLT_CUDA_ARCHS" in os.environ:
            configure.append(f"-DTLT_CUDA_ARCHS={os.environ['TLT_CUDA_ARCHS']}")
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_C"], check=True)


setup(ext_modules=[CMakeExtension("tlt_core._C")], cmdclass={"build_ext": CMakeBuild})
