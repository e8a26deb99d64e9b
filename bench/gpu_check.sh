#!/usr/bin/env bash
# The GPU check: build with the CUDA kernels, run the GPU tests, the GPU kernel benchmarks,
# and write JSON results into OUT_DIR. Meant for one H100/H200 and under 8 minutes:
#
#   bash bench/gpu_check.sh OUT_DIR
#
# OUT_DIR/gpu_tests.xml     JUnit report of `pytest -m gpu` (CUDA = CPU = reference)
# OUT_DIR/gpu_tests.log     its console output
# OUT_DIR/kernels_cuda.json `tlt bench kernels --device cuda` rows
# OUT_DIR/environment.json  GPU, driver, torch and nvcc versions
set -euo pipefail
OUT_DIR="${1:?usage: bash bench/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."

export TLT_CUDA=on TLT_CUDA_ARCHS="${TLT_CUDA_ARCHS:-90}"
bash scripts/setup.sh >"$OUT_DIR/build.log" 2>&1 || { tail -50 "$OUT_DIR/build.log"; exit 1; }

python - "$OUT_DIR/environment.json" <<'PY'
import json, subprocess, sys, torch, tlt_core.ops as ops
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
        "built_with_cuda": ops.built_with_cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(info)
PY

python -m pytest -m gpu tests -q --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log"
# CUDA kernel vs our CPU kernel on the full grid (the Python reference would take too long).
python -m tlt_core.cli bench kernels --device cuda --baseline cpu_fused --no-progress \
  --json "$OUT_DIR/kernels_cuda.json" 2>&1 | tee "$OUT_DIR/kernels_cuda.log"
