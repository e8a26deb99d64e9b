"""Where a decoding step's time goes, and what each design choice of the packed pass buys, on
one model: the evidence behind tlt_core.model.weight_layout and kv_cache.cache_dtype.

    python bench/profile_step.py --model DIR --dtype bfloat16 --batch 1,32

1. layouts: greedy decoding tokens/s of the engine with each weight layout that applies to the
   dtype (views: the parameters through F.linear; onednn: prepacked once; fold: float32 only;
   panels: float32 and bfloat16, where the CPU has AVX2 + FMA; bfloat16 in pairs where it has
   AVX512-BF16),
   the layouts alternating rep by rep, best of --reps;
2. the bf16 RMSNorm kernel (tlt_core.ops.add_rms_norm, with the residual add before it) against
   PyTorch's ops (packed.RMS_NORM_KERNEL off), greedy decoding tok/s alternating rep by rep,
   best of --reps, and how many rows decode the same tokens both ways (bf16 ties may flip);
3. attention at decoding shapes (the model's heads, one query per row, --context cache slots):
   the fused kernel in the weights' dtype against float32, and the first call of a bf16/fp16
   batched matmul at each new cache length (a kernel compiled per shape) against a repeat;
4. a torch.profiler table of one generate call with the automatic layout.
Without --model it runs the embedded model (float32).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import profile

import tlt_core.model.packed as packed
from tlt_core.embedded.workload import load_embedded
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.weight_layout import onednn_supports
from tlt_core.ops.panel_matmul import vectorised as panels_vectorised


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _greedy_workload(model, batch: int, new_tokens: int, seed: int
                     ) -> tuple[RolloutEngine, list[Request]]:
    """An engine for batch rows and batch greedy requests of new_tokens from random 16-token
    prompts."""
    prompts = torch.randint(3, model.config.vocab_size, (batch, 16),
                            generator=torch.Generator().manual_seed(seed))
    requests = [Request(row.tolist(), SamplingParams(temperature=0.0, max_tokens=new_tokens))
                for row in prompts]
    return RolloutEngine(model, EngineConfig(max_batch=batch, max_len=16 + new_tokens)), requests


def layouts(model, batches: list[int], new_tokens: int, reps: int) -> None:
    dtype = model.lm_head.weight.dtype
    candidates = ["views"] + (["onednn"] if onednn_supports(dtype) else []) + (
        ["fold"] if dtype == torch.float32 else []) + (
        ["panels"] if dtype in (torch.float32, torch.bfloat16) and panels_vectorised() else [])
    for batch in batches:
        engine, requests = _greedy_workload(model, batch, new_tokens, seed=0)
        warm = [Request(requests[0].prompt_ids, SamplingParams(temperature=0.0, max_tokens=2))]
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(reps):
            for layout in candidates:  # alternating, so all see the same machine
                model.inference_layout = layout
                engine.generate(warm)  # untimed: packs the weights in this layout
                best[layout] = min(best[layout], _timed(lambda: engine.generate(requests)))
        model.inference_layout = "auto"
        rates = "  ".join(f"{name} {batch * new_tokens / s:7.1f} tok/s" for name, s in best.items())
        print(f"layouts, batch {batch:>3}: {rates}")


def norm_kernel(model, batches: list[int], new_tokens: int, reps: int) -> None:
    if model.lm_head.weight.dtype != torch.bfloat16:
        return  # the kernel is for bf16 models
    for batch in batches:
        engine, requests = _greedy_workload(model, batch, new_tokens, seed=1)
        engine.generate(requests[:1])
        best, tokens = {True: float("inf"), False: float("inf")}, {}
        for _ in range(reps):
            for kernel in (True, False):
                packed.RMS_NORM_KERNEL = kernel
                start = time.perf_counter()
                result = engine.generate(requests)
                best[kernel] = min(best[kernel], time.perf_counter() - start)
                tokens[kernel] = [r.tokens.tolist() for r in result.rollouts]
        packed.RMS_NORM_KERNEL = True
        same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
        print(f"rms_norm kernel, batch {batch:>3}: {batch * new_tokens / best[True]:7.1f} tok/s "
              f"against {batch * new_tokens / best[False]:7.1f} with tensor ops "
              f"({best[False] / best[True]:.3f}x); rows decoding the same tokens {same}/{batch}")


def attention(model, batches: list[int], context: int) -> None:
    c, dtype = model.config, model.lm_head.weight.dtype
    for batch in batches:
        q = torch.randn(batch, c.num_heads, 1, c.head_dim)
        kv = torch.randn(2, batch, c.num_kv_heads, context, c.head_dim)
        times = {}
        for name, kind in (("weights' dtype", dtype), ("float32", torch.float32)):
            args = (q.to(kind), kv[0].to(kind), kv[1].to(kind))

            def run():
                F.scaled_dot_product_attention(*args, enable_gqa=c.num_heads != c.num_kv_heads)

            run()
            times[name] = min(_timed(run) for _ in range(20))
        print(f"attention, batch {batch:>3}, {context} slots: "
              + "  ".join(f"{name} {1e6 * s:8.0f} us" for name, s in times.items()))
    if dtype == torch.float32:
        return
    calls = {"first": 0.0, "repeated": 0.0}
    lengths = range(context, context + 20)
    for call in calls:
        for length in lengths:
            scores = torch.randn(batches[-1], c.num_kv_heads, 3, length, dtype=dtype)
            values = torch.randn(batches[-1], c.num_kv_heads, length, c.head_dim, dtype=dtype)
            calls[call] += _timed(lambda: torch.matmul(scores, values)) / len(lengths)
    print(f"{dtype} batched matmul at a new cache length: first call "
          f"{1e3 * calls['first']:.1f} ms, repeated {1e3 * calls['repeated']:.2f} ms")


def profile_generate(model, batch: int, new_tokens: int) -> None:
    prompt = torch.randint(3, model.config.vocab_size, (16,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    requests = [Request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens))] * batch
    engine = RolloutEngine(model, EngineConfig(max_batch=batch, max_len=16 + new_tokens))
    engine.generate(requests)
    with profile() as prof:
        engine.generate(requests)
    print(f"profile, batch {batch}, {new_tokens} steps, {model.inference_layout_in_use} layout:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face checkpoint folder (default: embedded)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="cache slots for attention")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.model is None:
        model = load_embedded(with_drafter=False).target
    else:
        model = load_checkpoint(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    with torch.no_grad():
        layouts(model, batches, args.new_tokens, args.reps)
        norm_kernel(model, batches, args.new_tokens, args.reps)
        attention(model, batches, args.context)
        for batch in batches:
            profile_generate(model, batch, args.new_tokens)


if __name__ == "__main__":
    main()
