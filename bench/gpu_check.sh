#!/usr/bin/env bash
# The GPU check: build the CUDA kernels in place (CMake + Ninja, no network needed), run the
# GPU tests, then the GPU kernel benchmark, writing results into OUT_DIR. Sized for one
# H100/H200 and well under 8 minutes:
#
#   bash bench/gpu_check.sh OUT_DIR
#
# OUT_DIR/environment.json  GPU, torch, nvcc
# OUT_DIR/gpu_tests.xml     JUnit report of the GPU tests (CUDA = CPU = reference, CuPy round trip,
#                           bf16 placement with fused views and bounded prefill memory)
# OUT_DIR/gpu_tests.log     their console output
# OUT_DIR/kernels_cuda.json `tlt bench kernels --device cuda --baseline cpu_fused` rows
# OUT_DIR/nvml_trace_h200.json  an NVML utilization trace for tests/test_idle.py
# OUT_DIR/calibration_cuda.json, rollout_cuda.json, projection_cuda.json  bench/gpu_rollout.py:
#                           the cost model, `tlt bench rollout` (graph-pool study included) and
#                           the simulator's projection on this GPU, on the shipped embedded
#                           model and drafter
# TLT_GPU_KERNEL_BENCH=0 skips the kernel benchmark; TLT_GPU_ROLLOUT=0 the rollout stage.
set -euo pipefail
OUT_DIR="$(mkdir -p "${1:?usage: bash bench/gpu_check.sh OUT_DIR}" && cd "$1" && pwd)"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

cmake -S . -B build/gpu -G Ninja -DTLT_CUDA=on -DTLT_CUDA_ARCHS="${TLT_CUDA_ARCHS:-90}" \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$("$PYTHON" -m pybind11 --cmakedir)" \
  >"$OUT_DIR/build.log" 2>&1
cmake --build build/gpu --target _C >>"$OUT_DIR/build.log" 2>&1 || { tail -40 "$OUT_DIR/build.log"; exit 1; }
cp build/gpu/_C*.so tlt_core/
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - "$OUT_DIR/environment.json" <<'PY'
import json, subprocess, sys, torch, tlt_core.ops as ops
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
        "built_with_cuda": ops.built_with_cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(info)
PY

"$PYTHON" bench/record_nvml_trace.py "$OUT_DIR/nvml_trace_h200.json" 2>&1 | tail -2 || true
export TLT_NVML_TRACE="$OUT_DIR/nvml_trace_h200.json"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_arrays_and_random.py \
  tests/test_gpu_engine.py tests/test_idle.py tests/test_graph_pool.py tests/test_gpu_placement.py \
  --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log" || true
if [ "${TLT_GPU_ROLLOUT:-1}" = 1 ]; then
  "$PYTHON" bench/gpu_rollout.py "$OUT_DIR" --device cuda 2>&1 | tee "$OUT_DIR/gpu_rollout.log" || true
fi
[ "${TLT_GPU_KERNEL_BENCH:-1}" = 1 ] || exit 0  # 0: tests, trace and rollout only
"$PYTHON" -m tlt_core.cli bench kernels --device cuda --baseline cpu_fused --no-progress \
  --batch "${TLT_BENCH_BATCH:-1,16,64}" --nodes "${TLT_BENCH_NODES:-32}" \
  --ops verify_tree_sampling,verify_tree_greedy,select_tree,tree_metadata,compact_kv_ \
  --json "$OUT_DIR/kernels_cuda.json" 2>&1 | tee "$OUT_DIR/kernels_cuda.log"
