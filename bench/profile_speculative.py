"""Where a speculative step's time goes, against a plain step, on one checkpoint and drafter:
the evidence behind the speed limits the README states for SmolLM2.

    python bench/profile_speculative.py --model DIR --drafter DIR --strategy 5,4,16 \
        --strategy s4 --json bench/results/profile_speculative_smollm2_bf16_cpu.json

For plain decoding and each plan, one request (the workload's first prompt, its chat template,
no stop ids, so every run has the same number of steps) at batch 1:
- ms per step, and per phase (draft, verify: the target's pass and the verification kernel,
  accept: compaction, the drafter's catch-up, committing), from the engine's step records,
  best of --reps runs;
- aten ops dispatched per step and per phase (counted, not timed: exact and repeatable);
- the share of a step spent inside the heavy kernels (ATen's matmuls and attention, self time
  under torch.profiler): what remains is Python and per-op dispatch, the part a GPU's CUDA
  graphs remove and a CPU pays in full. The "panels" layout's products (float32 on AVX2) are
  tlt_core's own kernel, which torch.profiler does not see: there the share is attention's.

Then what a speculative step cannot avoid on this machine, as a separate row
("plan": "widths"):
- the target's pass over N tokens at the prompt's context (--widths, N = 1 is the plain
  step's pass), best of --reps, in one-token passes: verifying a tree of N nodes costs at least
  this much. On a CPU without AMX the matmuls of a 16-token pass are compute-bound, so this is
  where a wide tree's step cost starts;
- the same passes with RoPE and the K/V write in tensor ops instead of the fused kernel
  (tlt_core.ops.rope), side by side;
- one drafter pass over one token (a drafting level of a chain), against a target layer's
  share of the one-token pass;
- each packed matmul of a layer and the LM head alone at one row and at the widest pass's
  rows, with the rate one row reads its weights at;
- the processor's bf16 matrix instructions (amx_bf16, avx512_bf16 or none).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

from tlt_core.bench.model_workload import load_model_workload
from tlt_core.bench.speculative import parse_strategy
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
import tlt_core.model.packed as packed
from tlt_core.model.attention_plan import AttentionPlan
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tlt_core.model.placement import cpu_bf16_flag, resolve_placement
from tlt_core.model.weight_layout import matmul

# The step's phases: (label, where the method lives: the engine or its decode passes, name)
PHASES = (("draft", "engine", "_draft"), ("verify", "passes", "verify"),
          ("accept", "engine", "_accept"), ("commit", "engine", "_commit"),
          ("plain_step", "engine", "_plain_step"))
HEAVY = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm",
         "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_efficient_attention_forward",
         "aten::_scaled_dot_product_attention_math")


class _OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched, by the engine phase running it."""

    def __init__(self, phase: list[str]):
        super().__init__()
        self.phase, self.counts = phase, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase[0]] += 1
        return func(*args, **(kwargs or {}))


def _phase_labels(engine: RolloutEngine, phase: list[str]) -> list[tuple[object, str]]:
    """Wraps the step's phases so the op counter knows which one runs; returns the (owner,
    name) pairs wrapped, to be restored."""
    owners = {"engine": engine, "passes": engine._passes}
    wrapped = []
    for label, where, name in PHASES:
        owner = owners[where]
        method = getattr(owner, name)

        def labelled(*args, _method=method, _label=label, **kwargs):
            outer, phase[0] = phase[0], _label
            try:
                return _method(*args, **kwargs)
            finally:
                phase[0] = outer

        setattr(owner, name, labelled)
        wrapped.append((owner, name))
    return wrapped


def profile_plan(engine: RolloutEngine, request: Request, plan, reps: int) -> dict:
    steps_s: list[float] = []
    best = None
    for _ in range(reps):
        steps_s.clear()
        start = time.perf_counter()
        result = engine.generate([request], plan, observe=lambda o: steps_s.append(o.seconds))
        wall = time.perf_counter() - start
        run = {"ms_per_step": 1e3 * sum(steps_s) / len(steps_s), "steps": len(steps_s),
               "tokens": len(result.rollouts[0].tokens), "wall_s": wall}
        if result.spec_steps:
            for field in ("draft_s", "verify_s", "accept_s"):
                run[field.replace("_s", "_ms")] = 1e3 * sum(
                    getattr(s, field) for s in result.spec_steps) / len(result.spec_steps)
            run["acceptance_length"] = result.acceptance_length
        if best is None or run["ms_per_step"] < best["ms_per_step"]:
            best = run
    phase = ["other"]
    wrapped = _phase_labels(engine, phase)
    counter = _OpCounter(phase)
    with counter:
        result = engine.generate([request], plan)
    for owner, name in wrapped:  # back to the class's methods
        delattr(owner, name)
    steps = result.decode_steps
    best["ops_per_step"] = sum(counter.counts.values()) / steps
    best["ops_per_phase"] = {label: counter.counts[label] / steps
                             for label, _, _ in PHASES if counter.counts[label]}
    with profile() as prof:
        start = time.perf_counter()
        engine.generate([request], plan)
        profiled_s = time.perf_counter() - start
    heavy_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in HEAVY)
    best["heavy_kernel_share"] = heavy_us / 1e6 / profiled_s
    return best


def _best_ms(run, reps: int) -> float:
    run()  # warm
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def width_costs(target, drafter, context: int, widths: list[int], reps: int) -> dict:
    """The target's pass over N tokens at `context` committed slots (uncommitted: the cache's
    contents do not change the cost), and one drafter pass over one token."""
    config, weight = target.config, target.lm_head.weight
    shape = CacheShape(config.num_layers, 1, config.num_kv_heads, context + max(widths),
                       config.head_dim)
    cache = KVCache(shape, dtype=cache_dtype(weight.dtype, weight.device), device=weight.device)
    cache.set_lengths(context)
    ms, without_kernel = {}, {}
    for width in widths:
        tokens = torch.zeros(1, width, dtype=torch.int64)
        positions = context + torch.arange(width)[None]
        ms[width] = _best_ms(lambda: target.step(tokens, positions, cache), reps)
        packed.ROPE_KV_KERNEL = False  # the same pass in tensor ops, side by side
        try:
            without_kernel[width] = _best_ms(lambda: target.step(tokens, positions, cache), reps)
        finally:
            packed.ROPE_KV_KERNEL = True
    draft_cache = drafter.new_cache(1, context + 1)
    draft_cache.set_lengths(context)
    hidden = torch.zeros(1, 1, config.hidden_size, dtype=weight.dtype)
    slot = torch.full((1, 1), context, dtype=torch.int64)
    plan = AttentionPlan(None, slot, context + 1)
    draft_ms = _best_ms(lambda: drafter.logits(drafter(
        tokens[:, :1], hidden, slot, draft_cache, plan=plan)[:, 0]), reps)
    one = ms[widths[0]]
    # the packed matmuls alone, one row against the widest pass: bandwidth-bound or not
    layer = target._decoder.layers.get()[0]
    head = target._decoder.head.refresh(target.lm_head.weight, layer.layout)
    H, I, q_width = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    matmuls = {}
    for name, packed_weight, inputs, outputs in (
            ("qkv", layer.qkv, H, q_width + 2 * kv_width), ("o", layer.o, q_width, H),
            ("gate_up", layer.gate_up, H, 2 * I), ("down", layer.down, I, H),
            ("lm_head", head, H, config.vocab_size)):
        us = {}
        for rows in (1, max(widths)):
            x = torch.randn(rows, inputs).to(weight.dtype)
            us[rows] = 1e3 * _best_ms(lambda: matmul(x, packed_weight, layer.layout), reps)
        matmuls[name] = {"us_one_row": us[1], f"us_{max(widths)}_rows": us[max(widths)],
                         "x_one_row": us[max(widths)] / us[1],
                         "read_gb_s_one_row": inputs * outputs * weight.element_size()
                         / us[1] / 1e3}
    return {"plan": "widths", "context": context, "cpu_bf16_instructions": cpu_bf16_flag(),
            "target_pass_ms": {str(w): m for w, m in ms.items()},
            "target_pass_x_one_token": {str(w): m / one for w, m in ms.items()},
            "target_pass_ms_without_rope_kernel": {str(w): m for w, m in without_kernel.items()},
            "drafter_level_ms": draft_ms,
            "drafter_level_x_target_layer": draft_ms / (one / config.num_layers),
            "matmul_us": matmuls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--drafter", required=True, help="its drafter folder")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--strategy", action="append", default=None, metavar="D,K,N",
                        help="a plan to profile (repeatable; sD: a sampled chain, sD,K: a sampled tree); default "
                             "5,4,16 and 6,1,7")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per run")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per plan (best kept)")
    parser.add_argument("--widths", default="1,2,4,8,16,24", metavar="N,N,...",
                        help="token counts of the target-pass row (the first is the baseline)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    placement = resolve_placement("cpu", args.dtype)
    workload = load_model_workload(args.model, placement, drafter=args.drafter, prompts=1)
    request = Request(workload.prompts[0], SamplingParams(temperature=args.temperature,
                                                          max_tokens=args.tokens, seed=0))
    engine = RolloutEngine(workload.target, EngineConfig(
        max_batch=1, max_len=len(request.prompt_ids) + args.tokens + 8), workload.drafter)
    plans = [None] + [parse_strategy(s) for s in (args.strategy or ["5,4,16", "6,1,7"])]
    rows = []
    with torch.inference_mode():
        for plan in plans:
            engine.generate([request], plan)  # warm: packs, caches
        for plan in plans:
            row = {"model": workload.label, "plan": "plain" if plan is None else plan.key,
                   "temperature": args.temperature,
                   **profile_plan(engine, request, plan, args.reps)}
            rows.append(row)
            print(json.dumps(row))
        widths = [int(w) for w in args.widths.split(",")]
        rows.append(width_costs(workload.target, workload.drafter, len(request.prompt_ids),
                                widths, 3 * args.reps))
        print(json.dumps(rows[-1]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
