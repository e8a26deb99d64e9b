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
- the share of a step spent inside the heavy kernels (matmuls and attention, self time under
  torch.profiler): what remains is Python and per-op dispatch, the part a GPU's CUDA graphs
  remove and a CPU pays in full.
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
from tlt_core.model.placement import resolve_placement

PHASES = ("_draft", "_verify", "_accept", "_commit", "_plain_step")
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


def _phase_labels(engine: RolloutEngine, phase: list[str]) -> None:
    """Wraps the engine's step phases so the op counter knows which one runs."""
    for name in PHASES:
        method = getattr(engine, name)

        def labelled(*args, _method=method, _name=name, **kwargs):
            outer, phase[0] = phase[0], _name
            try:
                return _method(*args, **kwargs)
            finally:
                phase[0] = outer

        setattr(engine, name, labelled)


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
    _phase_labels(engine, phase)
    counter = _OpCounter(phase)
    with counter:
        result = engine.generate([request], plan)
    for name in PHASES:  # back to the class's methods
        delattr(engine, name)
    steps = result.decode_steps
    best["ops_per_step"] = sum(counter.counts.values()) / steps
    best["ops_per_phase"] = {name.strip("_"): counter.counts[name] / steps
                             for name in PHASES if counter.counts[name]}
    with profile() as prof:
        start = time.perf_counter()
        engine.generate([request], plan)
        profiled_s = time.perf_counter() - start
    heavy_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in HEAVY)
    best["heavy_kernel_share"] = heavy_us / 1e6 / profiled_s
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--drafter", required=True, help="its drafter folder")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--strategy", action="append", default=None, metavar="D,K,N",
                        help="a plan to profile (repeatable; sD: a sampled chain); default "
                             "5,4,16 and 6,1,7")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per run")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per plan (best kept)")
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
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
