#!/usr/bin/env bash
# The GPU check: one command that builds the CUDA kernels, records the environment, runs the GPU
# tests and the GPU benchmarks on one GPU within 8 minutes, and says which stage failed.
#
#   bash bench/gpu_check.sh OUT_DIR [--device cuda|cpu]
#
# Stages, in order; each runs under `timeout`, its limit the smaller of its cap and what the
# overall budget leaves after reserving the floors of the required stages still to come, so
# the whole check ends within TLT_GPU_CHECK_BUDGET_S (default 460 s) plus packing:
#   1 build            CMake + Ninja build of tlt_core._C with the CUDA kernels, copied into
#                      tlt_core/ (cap 180 s)
#   2 environment      bench/gpu_environment.py: GPU, torch / CUDA / cuDNN / nvcc versions, and
#                      which SDPA backend runs our masked grouped-query attention (cap 60 s)
#   3 gpu_tests        an NVML trace for the idle detector, then the GPU tests (cap 150 s)
#   4 decode           bench/gpu_decode.py: Qwen2.5-7B-shaped random weights in bf16, our
#                      engine eager and with CUDA graphs against transformers, the roofline,
#                      syncs and launches per step, memory, speculative break-even (cap 240 s)
#   5 sampling_kernel  bench/sampling_kernel.py --device cuda (cap 60 s); "missing" if the
#                      file does not exist
#   6 kernels_bench    optional: tlt bench kernels --device cuda (cap 45 s)
#   7 rollout          optional: bench/gpu_rollout.py on the embedded model (needs >= 90 s)
# An optional stage runs only if the time left allows and is otherwise "dropped", with the
# reason in the summary. A stage that fails does not stop the next one.
#
# OUT_DIR receives at most six files:
#   summary.json               each stage: status (ok, failed, timeout, missing, skipped,
#                              dropped), seconds, limit, reason; which stages failed
#   environment.json           stage 2
#   gpu_tests.xml              JUnit report of stage 3
#   decode_<device>.json       stage 4
#   sampling_kernel_cuda.json  stage 5
#   logs.tar.gz                every stage's log, kernels_cuda.json, the NVML trace and the
#                              rollout stage's calibration / rollout / projection JSON
# Exit status: 1 if a required stage did not pass or an optional one failed (an optional
# stage cut by its time limit is reported, not counted), 2 for bad arguments, else 0.
#
# --device cpu runs what needs no GPU on the CPU, for CI: the environment and gpu_decode.py on
# its tiny shape (the installed tlt_core._C is used; GPU-only stages are "skipped").
#
# Environment: PYTHON (default python3), TLT_CUDA_ARCHS (default 90: H100 / H200),
# TLT_GPU_CHECK_BUDGET_S (default 460).
set -uo pipefail  # no -e: a failed stage is recorded and the next one still runs

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

DEVICE=cuda
OUT_ARG=
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --device) DEVICE="${2-}"; shift; [ $# -gt 0 ] && shift ;;
    --device=*) DEVICE="${1#--device=}"; shift ;;
    -*) echo "gpu_check.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *)
      if [ -n "$OUT_ARG" ]; then
        echo "gpu_check.sh: OUT_DIR given twice ('$OUT_ARG', '$1')" >&2; exit 2
      fi
      OUT_ARG="$1"; shift ;;
  esac
done
case "$DEVICE" in
  cuda | cpu) ;;
  *) echo "gpu_check.sh: --device: expected cuda or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
if [ -z "$OUT_ARG" ]; then
  echo "usage: bash bench/gpu_check.sh OUT_DIR [--device cuda|cpu]   (--help explains)" >&2
  exit 2
fi
BUDGET_S="${TLT_GPU_CHECK_BUDGET_S:-460}"
case "$BUDGET_S" in
  '' | *[!0-9]*)
    echo "gpu_check.sh: TLT_GPU_CHECK_BUDGET_S: expected whole seconds, got '$BUDGET_S'" >&2
    exit 2 ;;
esac
mkdir -p "$OUT_ARG" || exit 2
OUT_DIR="$(cd "$OUT_ARG" && pwd)"
cd "$(dirname "$0")/.." || exit 2
WORK="$(mktemp -d)"  # logs and secondary results: packed into OUT_DIR/logs.tar.gz
export OUT_DIR WORK DEVICE
export PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# ---- the stages (each runs in its own bash under timeout) -------------------------------------

stage_build() {
  set -euo pipefail
  cmake -S . -B build/gpu -G Ninja -DTLT_CUDA=on -DTLT_CUDA_ARCHS="${TLT_CUDA_ARCHS:-90}" \
    -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
    -Dpybind11_DIR="$("$PYTHON" -m pybind11 --cmakedir)"
  cmake --build build/gpu --target _C
  cp build/gpu/_C*.so tlt_core/
  "$PYTHON" -c 'import sys, tlt_core.ops as ops
sys.exit(0 if ops.built_with_cuda else "tlt_core._C was built without the CUDA kernels")'
}

stage_environment() {
  set -euo pipefail
  "$PYTHON" bench/gpu_environment.py "$OUT_DIR/environment.json" --device "$DEVICE"
}

stage_gpu_tests() {
  set -euo pipefail
  # Without a GPU or the CUDA kernels the GPU tests skip, which must not read as a pass.
  "$PYTHON" -c 'import sys, torch, tlt_core.ops as ops
if not torch.cuda.is_available(): sys.exit("torch sees no CUDA device: GPU tests would skip")
if not ops.built_with_cuda: sys.exit("tlt_core._C has no CUDA kernels: GPU tests would skip")'
  local trace_status=0
  "$PYTHON" bench/record_nvml_trace.py "$WORK/nvml_trace.json" || trace_status=$?
  if [ "$trace_status" = 0 ]; then
    export TLT_NVML_TRACE="$WORK/nvml_trace.json"
  else
    echo "recording the NVML trace failed (exit $trace_status): test_idle replays the shipped trace"
  fi
  local test_status=0
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_kernels.py \
    tests/test_arrays_and_random.py tests/test_gpu_engine.py tests/test_idle.py \
    tests/test_graph_pool.py tests/test_gpu_placement.py \
    "tests/test_vllm_sglang_ops.py::test_ops_on_cuda_equal_cpu_and_replay_in_a_cuda_graph" \
    --junitxml="$OUT_DIR/gpu_tests.xml" || test_status=$?
  [ "$trace_status" = 0 ] && [ "$test_status" = 0 ]
}

stage_decode() {
  set -euo pipefail
  # the script's own budget ends its optional parts (1.5B shape, compiled transformers) in time
  "$PYTHON" bench/gpu_decode.py --device "$DEVICE" --json "$OUT_DIR/decode_$DEVICE.json" \
    --budget-s "$DECODE_BUDGET_S"
}

stage_sampling_kernel() {
  set -euo pipefail
  "$PYTHON" bench/sampling_kernel.py --device cuda --json "$OUT_DIR/sampling_kernel_cuda.json"
}

stage_kernels_bench() {
  set -euo pipefail
  "$PYTHON" -m tlt_core.cli bench kernels --device cuda --baseline cpu_fused --no-progress \
    --batch 1,16,64 --nodes 32 \
    --ops verify_tree_sampling,verify_tree_greedy,select_tree,tree_metadata,compact_kv_ \
    --json "$WORK/kernels_cuda.json"
}

stage_rollout() {
  set -euo pipefail
  "$PYTHON" bench/gpu_rollout.py "$WORK/rollout" --device cuda
}

export -f stage_build stage_environment stage_gpu_tests stage_decode stage_sampling_kernel \
  stage_kernels_bench stage_rollout

# ---- bookkeeping ----------------------------------------------------------------------------

NAMES=() REQUIRED=() STATUS=() TOOK=() LIMITS=() WHY=()
CURRENT="" STARTED=0  # the stage running now, and when it started
# floors (s) of the required stages still to run: each stage's limit leaves them this much
declare -A FLOOR=([build]=60 [environment]=20 [gpu_tests]=60 [decode]=150 [sampling_kernel]=30)
if [ "$DEVICE" = cpu ]; then  # skipped there: nothing to reserve
  FLOOR[build]=0 FLOOR[gpu_tests]=0 FLOOR[sampling_kernel]=0
fi
RESERVED=0
for stage in build environment gpu_tests decode sampling_kernel; do
  RESERVED=$((RESERVED + FLOOR[$stage]))
done
TOTAL_STAGES=7

record() {  # NAME REQUIRED STATUS SECONDS LIMIT WHY
  NAMES+=("$1") REQUIRED+=("$2") STATUS+=("$3") TOOK+=("$4") LIMITS+=("$5") WHY+=("$6")
}

# run_stage NAME REQUIRED(1|0) CAP_S MIN_S WHY_SKIPPED: WHY_SKIPPED non-empty records the stage
# as skipped with that reason; else it runs stage_NAME under its time limit.
run_stage() {
  local name="$1" required="$2" cap="$3" least="$4" skip_why="$5"
  local index=$((${#NAMES[@]} + 1))
  if [ "$required" = 1 ]; then
    RESERVED=$((RESERVED - FLOOR[$name]))
  fi
  if [ -n "$skip_why" ]; then
    echo "== [$index/$TOTAL_STAGES] $name: skipped ($skip_why)"
    record "$name" "$required" skipped 0 0 "$skip_why"
    return
  fi
  local left=$((BUDGET_S - SECONDS - RESERVED))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt "$least" ]; then
    local why="needs >= $least s, $((left < 0 ? 0 : left)) s left of the $BUDGET_S s budget"
    echo "== [$index/$TOTAL_STAGES] $name: dropped ($why)"
    record "$name" "$required" dropped 0 0 "$why"
    return
  fi
  echo "== [$index/$TOTAL_STAGES] $name: limit $limit s (at $SECONDS s of $BUDGET_S)"
  export DECODE_BUDGET_S=$((limit > 60 ? limit - 25 : limit))
  CURRENT="$name" STARTED=$SECONDS
  timeout -k 10 "$limit" bash -c "stage_$name" 2>&1 | tee "$WORK/$name.log"
  local code=${PIPESTATUS[0]}
  CURRENT=""
  local took=$((SECONDS - STARTED)) status why=""
  case "$code" in
    0) status=ok ;;
    124 | 137) status=timeout; why="stopped at its $limit s limit" ;;
    *)
      status=failed
      local last
      last="$(grep -v '^[[:space:]]*$' "$WORK/$name.log" | tail -1 | cut -c1-160)"
      why="exit $code; last line: $last" ;;
  esac
  echo "-- $name: $status after $took s${why:+ ($why)}"
  record "$name" "$required" "$status" "$took" "$limit" "$why"
}

json_string() {  # a shell string as a JSON string (the reasons are short, one line)
  local s="${1//\\/\\\\}"
  s="${s//\"/\\\"}"
  s="${s//$'\t'/ }"
  printf '"%s"' "${s//$'\n'/ }"
}

finish() {
  local code=0 failed=() i
  if [ -n "$CURRENT" ]; then
    record "$CURRENT" 1 interrupted $((SECONDS - STARTED)) 0 "the check was interrupted here"
  fi
  for i in "${!NAMES[@]}"; do
    case "${STATUS[$i]}" in
      ok | skipped) ;;
      timeout | dropped) [ "${REQUIRED[$i]}" = 1 ] && failed+=("${NAMES[$i]}") ;;
      *) failed+=("${NAMES[$i]}") ;;
    esac
  done
  [ ${#failed[@]} -eq 0 ] || code=1
  {
    printf '{\n "device": "%s",\n "budget_s": %s,\n "elapsed_s": %s,\n "exit_status": %s,\n' \
      "$DEVICE" "$BUDGET_S" "$SECONDS" "$code"
    printf ' "failed": ['
    for i in "${!failed[@]}"; do
      printf '%s"%s"' "$([ "$i" = 0 ] || echo ', ')" "${failed[$i]}"
    done
    printf '],\n "stages": [\n'
    for i in "${!NAMES[@]}"; do
      printf '  {"name": "%s", "required": %s, "status": "%s", "seconds": %s, "limit_s": %s, ' \
        "${NAMES[$i]}" "$([ "${REQUIRED[$i]}" = 1 ] && echo true || echo false)" "${STATUS[$i]}" \
        "${TOOK[$i]}" "${LIMITS[$i]}"
      printf '"why": %s, "log": "logs.tar.gz:%s.log"}%s\n' "$(json_string "${WHY[$i]}")" \
        "${NAMES[$i]}" "$([ $((i + 1)) = ${#NAMES[@]} ] || echo ,)"
    done
    printf ' ]\n}\n'
  } >"$OUT_DIR/summary.json"
  rm -f "$OUT_DIR"/*.partial  # a results file cut mid-write
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" . && rm -rf "$WORK"
  echo
  echo "GPU check summary (--device $DEVICE, $SECONDS s of a $BUDGET_S s budget;" \
    "logs in $OUT_DIR/logs.tar.gz)"
  for i in "${!NAMES[@]}"; do
    printf '  %-16s %-9s %-11s %4s s  %s\n' "${NAMES[$i]}" \
      "$([ "${REQUIRED[$i]}" = 1 ] && echo required || echo optional)" "${STATUS[$i]}" \
      "${TOOK[$i]}" "${WHY[$i]}"
  done
  if [ $code = 0 ]; then
    echo "PASSED"
  else
    echo "FAILED: ${failed[*]}"
  fi
  exit $code
}
trap finish EXIT
trap 'exit 130' INT TERM

# ---- the check --------------------------------------------------------------------------------

GPU_ONLY=""
[ "$DEVICE" = cpu ] && GPU_ONLY="GPU-only (--device cpu)"
run_stage build 1 180 30 \
  "$([ "$DEVICE" = cpu ] && echo "--device cpu uses the installed tlt_core._C")"
run_stage environment 1 60 10 ""
run_stage gpu_tests 1 150 30 "$GPU_ONLY"
run_stage decode 1 240 60 ""
if [ -n "$GPU_ONLY" ]; then
  run_stage sampling_kernel 1 60 15 "$GPU_ONLY"
elif [ -f bench/sampling_kernel.py ]; then
  run_stage sampling_kernel 1 60 15 ""
else
  RESERVED=$((RESERVED - FLOOR[sampling_kernel]))
  echo "== [5/$TOTAL_STAGES] sampling_kernel: missing (bench/sampling_kernel.py does not exist)"
  record sampling_kernel 1 missing 0 0 "bench/sampling_kernel.py does not exist in this checkout"
fi
run_stage kernels_bench 0 45 20 "$GPU_ONLY"
run_stage rollout 0 240 90 "$GPU_ONLY"
