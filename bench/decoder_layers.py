"""A bf16 target's pass with its decoder layers in one kernel call (tlt_core.ops.decoder_layers)
against the same kernels called one by one from Python (`tlt_core.model.packed.
DECODER_LAYERS_KERNEL` off), on a checkpoint, alternating, best of `--reps` twice over; and
how many PyTorch ops (torch.profiler) each pass dispatches:

    python bench/decoder_layers.py --model DIR --json FILE

Rows: (batch, context, tokens); `speedup` is the one-by-one pass's time over the one call's.
Both compute the same bits (tests/test_decoder_layers.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import tlt_core.model.packed as packed
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype

CASES = [(1, 200, 1), (1, 200, 3), (1, 200, 8), (1, 200, 16), (1, 800, 1), (4, 200, 1),
         (16, 200, 1), (64, 200, 1)]


def _best_ms(run, reps: int) -> float:
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def compare(target, batch: int, context: int, tokens: int, reps: int) -> dict:
    config, weight = target.config, target.lm_head.weight
    shape = CacheShape(config.num_layers, batch, config.num_kv_heads, context + tokens + 1,
                       config.head_dim)
    cache = KVCache(shape, dtype=cache_dtype(weight.dtype, weight.device))
    cache.set_lengths(context)
    ids = torch.zeros(batch, tokens, dtype=torch.int64)
    positions = (context + torch.arange(tokens)).expand(batch, tokens)
    ms, ops = {}, {}
    try:
        with torch.no_grad():
            for _ in range(2):
                for name, on in (("one_call", True), ("one_by_one", False)):
                    packed.DECODER_LAYERS_KERNEL = on
                    ms[name] = min(ms.get(name, float("inf")),
                                   _best_ms(lambda: target.step(ids, positions, cache), reps))
            for name, on in (("one_call", True), ("one_by_one", False)):
                packed.DECODER_LAYERS_KERNEL = on
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    target.step(ids, positions, cache)
                ops[name] = sum(e.count for e in prof.key_averages())
    finally:
        packed.DECODER_LAYERS_KERNEL = True
    return {"one_call_ms": ms["one_call"], "one_by_one_ms": ms["one_by_one"],
            "speedup": ms["one_by_one"] / ms["one_call"], "aten_ops_one_call": ops["one_call"],
            "aten_ops_one_by_one": ops["one_by_one"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (best kept)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    target = load_checkpoint(args.model, dtype=torch.bfloat16).eval()
    target.inference_layout = "panels"
    if target._decoder.layers.decoder_kernel() is None:
        parser.error(f"--model: {args.model}'s layers do not fit the one-call kernel (bf16 "
                     "panels with each layer's own RMSNorms and no q/k norms)")
    rows = []
    for batch, context, tokens in CASES:
        row = {"batch": batch, "context": context, "tokens": tokens,
               **compare(target, batch, context, tokens, args.reps)}
        rows.append(row)
        print(f"batch {batch:>3} context {context:>4} tokens {tokens:>3}: one call "
              f"{row['one_call_ms']:6.2f} ms ({row['aten_ops_one_call']} ATen ops), one by one "
              f"{row['one_by_one_ms']:6.2f} ms ({row['aten_ops_one_by_one']}): "
              f"{row['speedup']:.3f}x", flush=True)
    if args.json:
        label = f"{Path(args.model).name} (bfloat16)"
        args.json.write_text(json.dumps({"model": label, "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
