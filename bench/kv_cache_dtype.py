"""A bf16 model's KV cache on the CPU in bf16 against float32, side by side: the same engine
decoding the same requests with each cache, alternating, at each (batch, context) cell.

    python bench/kv_cache_dtype.py --model DIR --batch 1,8,32 --context 100,800 \
        --json bench/results/kv_cache_dtype.json

Both caches hold the same values (a bf16 model's K and V are bf16 values) and the attention
kernel widens a bf16 element exactly, so both decode the same tokens (checked); the bf16 cache
reads half the bytes. Each request's prompt is the first workload prompt's ids repeated to
`context` tokens; each row then decodes --tokens tokens at T = 1 (its stops masked, so every row
runs to the end). A cell's time is the median decode step of the call (prefill excluded), best
of --reps calls per cache. With --drafter and --strategy, the same cells decode with each plan
too, so SD's speedup over plain decoding is given under each cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

import tlt_core.model.kv_cache as kv_cache
from tlt_core.bench.model_workload import load_model_workload
from tlt_core.bench.speculative import parse_strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.placement import resolve_placement

CACHES = {"float32": False, "bfloat16": True}  # name -> kv_cache.BF16_CACHE_ON_CPU


def requests(prompt: tuple[int, ...], batch: int, context: int, tokens: int) -> list[Request]:
    ids = (list(prompt) * (context // len(prompt) + 1))[:context]
    return [Request(tuple(ids), SamplingParams(temperature=1.0, max_tokens=tokens,
                                               min_tokens=tokens, seed=row))
            for row in range(batch)]


def timed(engine: RolloutEngine, reqs: list[Request], plan) -> tuple[float, list]:
    """(median decode-step seconds per committed token a row, the rows' tokens)."""
    steps = []
    result = engine.generate(reqs, plan, observe=steps.append)
    per_token = [o.seconds / (o.emitted / o.batch) for o in steps if o.emitted]
    return statistics.median(per_token), [list(map(int, r.tokens)) for r in result.rollouts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--drafter", help="its drafter folder (for --strategy)")
    parser.add_argument("--strategy", action="append", default=[],
                        help="an SD plan to compare with plain decoding under each cache "
                             "(repeatable; sD: a sampled chain); needs --drafter")
    parser.add_argument("--batch", default="1,8,32", help="running rows, comma-separated")
    parser.add_argument("--context", default="100,800",
                        help="prompt tokens before decoding, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each row decodes")
    parser.add_argument("--reps", type=int, default=3, help="calls per cache and cell")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.strategy and not args.drafter:
        parser.error("--strategy needs --drafter")
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    placement = resolve_placement("cpu", "bfloat16")
    workload = load_model_workload(args.model, placement, drafter=args.drafter, prompts=1)
    plans = [None] + [parse_strategy(s) for s in args.strategy]
    engines = {}
    for name, bf16 in CACHES.items():
        kv_cache.BF16_CACHE_ON_CPU = bf16
        engines[name] = RolloutEngine(workload.target, EngineConfig(
            max_batch=max(batches), max_len=max(contexts) + args.tokens + 16), workload.drafter)
        assert engines[name].cache.data.dtype == (torch.bfloat16 if bf16 else torch.float32)
    kv_cache.BF16_CACHE_ON_CPU = True
    rows = []
    with torch.inference_mode():
        for batch in batches:
            for context in contexts:
                reqs = requests(workload.prompts[0], batch, context, args.tokens)
                for plan in plans:
                    best = {name: float("inf") for name in CACHES}
                    tokens = {}
                    for rep in range(args.reps + 1):  # the first round warms
                        for name in CACHES:
                            seconds, tokens[name] = timed(engines[name], reqs, plan)
                            if rep:
                                best[name] = min(best[name], seconds)
                    if plan is None and tokens["float32"] != tokens["bfloat16"]:
                        raise AssertionError(f"batch {batch}, context {context}: the caches "
                                             "decoded different tokens")
                    row = {"model": workload.label, "batch": batch, "context": context,
                           "plan": "plain" if plan is None else plan.key,
                           **{f"ms_per_token_{name}": 1e3 * best[name] for name in CACHES},
                           "speedup_bf16_cache": best["float32"] / best["bfloat16"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    for row in rows:  # SD against plain decoding under each cache
        if row["plan"] != "plain":
            plain = next(r for r in rows if r["plan"] == "plain" and r["batch"] == row["batch"]
                         and r["context"] == row["context"])
            for name in CACHES:
                key = f"ms_per_token_{name}"
                row[f"sd_speedup_{name}"] = plain[key] / row[key]
    if args.json:
        args.json.write_text(json.dumps({"bench": "kv_cache_dtype", "cpu": platform.machine(),
                                         "threads": torch.get_num_threads(), "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
