"""The CPU attention kernel against PyTorch's scaled_dot_product_attention, on a checkpoint's
attention shapes: one layer's call (the kernel's output in the o projection's layout and dtype;
PyTorch's transposed, copied and narrowed to it, as the packed pass did), then the whole target
pass with the kernel and without it (`tlt_core.model.packed.ATTENTION_KERNEL`), alternating,
best of `--reps`:

    python bench/decode_attention.py --model DIR --dtype bfloat16 --json FILE

Rows: (batch, context, tokens) for the layer call and the pass; `speedup` is PyTorch's time
over the kernel's."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tlt_core.model.packed as packed
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tlt_core.ops import DecodeAttention

CASES = [(1, 200, 1), (1, 200, 5), (1, 200, 16), (1, 800, 1), (1, 800, 5), (16, 200, 1),
         (64, 200, 1)]


def _best_ms(run, reps: int) -> float:
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_call(config, dtype, batch: int, context: int, tokens: int, reps: int) -> dict:
    H_q, H_kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    slots = context + tokens
    q = torch.randn(batch, H_q, tokens, d)
    cache = torch.randn(2, batch, H_kv, slots + 16, d)
    mask = (None if tokens == 1 else
            torch.ones(tokens, slots, dtype=torch.bool).tril(context)[None, None])
    attend = DecodeAttention(q, mask, slots, H_kv, dtype)

    def pytorch():
        out = F.scaled_dot_product_attention(q, cache[0, :, :, :slots], cache[1, :, :, :slots],
                                             attn_mask=mask, enable_gqa=H_q != H_kv)
        return out.transpose(1, 2).reshape(batch * tokens, H_q * d).to(dtype)

    kernel_ms = min(_best_ms(lambda: attend(cache), reps) for _ in range(2))
    pytorch_ms = min(_best_ms(pytorch, reps) for _ in range(2))
    return {"kernel_us": kernel_ms * 1e3, "pytorch_us": pytorch_ms * 1e3,
            "speedup": pytorch_ms / kernel_ms}


def target_pass(target, batch: int, context: int, tokens: int, reps: int) -> dict:
    config, weight = target.config, target.lm_head.weight
    shape = CacheShape(config.num_layers, batch, config.num_kv_heads, context + tokens + 1,
                       config.head_dim)
    cache = KVCache(shape, dtype=cache_dtype(weight.dtype, weight.device))
    cache.set_lengths(context)
    ids = torch.zeros(batch, tokens, dtype=torch.int64)
    positions = (context + torch.arange(tokens)).expand(batch, tokens)
    ms = {True: float("inf"), False: float("inf")}
    try:
        with torch.no_grad():
            for kernel in (True, False, True, False):
                packed.ATTENTION_KERNEL = kernel
                ms[kernel] = min(ms[kernel],
                                 _best_ms(lambda: target.step(ids, positions, cache), reps))
    finally:
        packed.ATTENTION_KERNEL = True
    return {"pass_kernel_ms": ms[True], "pass_pytorch_ms": ms[False],
            "pass_speedup": ms[False] / ms[True]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (best kept)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target = load_checkpoint(args.model, dtype=dtype).eval()
    rows = []
    for batch, context, tokens in CASES:
        row = {"batch": batch, "context": context, "tokens": tokens,
               **layer_call(target.config, dtype, batch, context, tokens, args.reps),
               **target_pass(target, batch, context, tokens, max(args.reps // 2, 3))}
        rows.append(row)
        print(f"batch {batch:>3} context {context:>4} tokens {tokens:>3}: layer "
              f"{row['kernel_us']:7.1f} us vs {row['pytorch_us']:7.1f} ({row['speedup']:.2f}x); "
              f"pass {row['pass_kernel_ms']:7.2f} ms vs {row['pass_pytorch_ms']:7.2f} "
              f"({row['pass_speedup']:.3f}x)", flush=True)
    if args.json:
        label = f"{Path(args.model).name} ({args.dtype})"
        args.json.write_text(json.dumps({"model": label, "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
