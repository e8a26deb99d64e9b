"""The packed pass's CPU kernels against the PyTorch ops they replace, on a checkpoint: the
attention kernel's call against scaled_dot_product_attention on the model's attention shapes
(the kernel's output in the o projection's layout and dtype; PyTorch's transposed, copied and
narrowed to it, as the pass needs it), then the whole target pass with each kernel called from
Python and without it (`tlt_core.model.packed.ATTENTION_KERNEL`, `SILU_MUL_KERNEL`), with
neither, and with the decoder layers in one call (`DECODER_LAYERS_KERNEL`, bf16 panels: the
same kernels back to back in C++), alternating, best of `--reps`, and the PyTorch ops left
(torch.profiler) with each kernel called from Python, with neither, and in one call:

    python bench/pass_kernels.py --model DIR --dtype bfloat16 --json FILE

Rows: (batch, context, tokens); `speedup` is PyTorch's time over the kernel's;
`pass_speedup_one_call` the one-by-one pass's time over the one call's (1 where the model's
layers do not fit the one-call kernel: `one_call_fits`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

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


FLAGS = {"attention": "ATTENTION_KERNEL", "silu_mul": "SILU_MUL_KERNEL"}


def target_pass(target, batch: int, context: int, tokens: int, reps: int) -> dict:
    """The pass in ms in one call, with both kernels called one by one, without each, and
    without either."""
    config, weight = target.config, target.lm_head.weight
    shape = CacheShape(config.num_layers, batch, config.num_kv_heads, context + tokens + 1,
                       config.head_dim)
    cache = KVCache(shape, dtype=cache_dtype(weight.dtype, weight.device))
    cache.set_lengths(context)
    ids = torch.zeros(batch, tokens, dtype=torch.int64)
    positions = (context + torch.arange(tokens)).expand(batch, tokens)
    # name: (kernels off, the layers in one call)
    variants = {"one_call": ((), True), "both": ((), False),
                "no_attention": (("attention",), False), "no_silu_mul": (("silu_mul",), False),
                "neither": (tuple(FLAGS), False)}

    def switch(name: str) -> None:
        off, one_call = variants[name]
        for kernel, flag in FLAGS.items():
            setattr(packed, flag, kernel not in off)
        packed.DECODER_LAYERS_KERNEL = one_call

    ms = dict.fromkeys(variants, float("inf"))
    try:
        with torch.no_grad():
            for _ in range(2):
                for name in variants:
                    switch(name)
                    ms[name] = min(ms[name],
                                   _best_ms(lambda: target.step(ids, positions, cache), reps))
        # what is left in PyTorch's ops (torch.profiler's self time, our kernels unseen) and
        # how many ops (exact, where a time moves with load)
        aten, aten_ops = {}, {}
        with torch.no_grad():
            for name in ("one_call", "both", "neither"):
                switch(name)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(reps):
                        target.step(ids, positions, cache)
                events = prof.key_averages()
                aten[name] = sum(e.self_cpu_time_total for e in events) / reps / 1e3
                aten_ops[name] = sum(e.count for e in events) / reps
    finally:
        for flag in (*FLAGS.values(), "DECODER_LAYERS_KERNEL"):
            setattr(packed, flag, True)
    return {f"pass_{name}_ms": value for name, value in ms.items()} | {
        f"aten_{name}_ms": value for name, value in aten.items()} | {
        f"aten_ops_{name}": value for name, value in aten_ops.items()} | {
        "one_call_fits": target._decoder.layers.decoder_kernel() is not None,
        "pass_speedup_attention": ms["no_attention"] / ms["both"],
        "pass_speedup_silu_mul": ms["no_silu_mul"] / ms["both"],
        "pass_speedup_both": ms["neither"] / ms["both"],
        "pass_speedup_one_call": ms["both"] / ms["one_call"]}


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
        print(f"batch {batch:>3} context {context:>4} tokens {tokens:>3}: attention layer "
              f"{row['kernel_us']:6.1f} us vs {row['pytorch_us']:6.1f} ({row['speedup']:.2f}x); "
              f"pass {row['pass_both_ms']:6.2f} ms, without attention "
              f"{row['pass_speedup_attention']:.3f}x, without silu_mul "
              f"{row['pass_speedup_silu_mul']:.3f}x, without both "
              f"{row['pass_speedup_both']:.3f}x; in one call {row['pass_one_call_ms']:6.2f} ms "
              f"({row['pass_speedup_one_call']:.3f}x); ATen ops {row['aten_ops_one_call']:.0f} / "
              f"{row['aten_ops_both']:.0f} / {row['aten_ops_neither']:.0f}", flush=True)
    if args.json:
        label = f"{Path(args.model).name} ({args.dtype})"
        args.json.write_text(json.dumps({"model": label, "threads": torch.get_num_threads(),
                                         "layout": target.inference_layout_in_use,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
