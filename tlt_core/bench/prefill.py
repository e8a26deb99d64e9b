"""`tlt bench prefill`: the peak memory of prefilling many long prompts, before and after the
engine's memory bounds, on the same model in one run.

- all_positions: the prompts in one batched pass with logits at every position, as a prefill
  without the bounds computes them ((B, T, V) in the weights' dtype, then float32);
- engine: the engine's admission (`EngineConfig.prefill_tokens`: prompts admitted and prefilled
  in chunks of at most that many tokens) with logits at each row's last position only.

Each variant runs in a fresh process (peak memory is a process's high-water mark), which loads
the model, records its memory, prefills, and reports the peak above what it held before
(CUDA: peak allocation; CPU: peak resident set, its high-water mark reset first); both include
what the first pass allocates besides logits (a layout's packed copy of the weights, caches).
Seconds are the prefill's own.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tlt_core.model.placement import peak_memory_bytes, reset_peak_memory

VARIANTS = ("all_positions", "engine")


@dataclass(frozen=True)
class PrefillOptions:
    """`tlt bench prefill`: the checkpoint and the prompts prefilled."""
    model: Path = option("a local Hugging Face checkpoint folder", metavar="DIR")
    prompts: int = option("prompts prefilled together", 64)
    prompt_len: int = option("tokens per prompt", 512)
    dtype: str = option("weights' dtype", "bfloat16", choices=("float32", "bfloat16", "float16"))
    device: str = option("where it runs", "cpu", choices=("cpu", "cuda"))
    json: Path | None = option("write the rows as JSON", None, metavar="FILE")


CLI_OPTIONS = (PrefillOptions,)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench prefill`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


@dataclass(frozen=True)
class PrefillCase:
    variant: str
    prompts: int
    prompt_len: int
    dtype: str
    peak_extra_mib: float  # peak memory above the loaded model's
    seconds: float


def _measure(folder: str, variant: str, prompts: int, prompt_len: int, dtype: str,
             device: str, queue) -> None:
    model = load_checkpoint(folder, dtype=getattr(torch, dtype), device=device)
    ids = torch.randint(3, model.config.vocab_size, (prompts, prompt_len),
                        generator=torch.Generator().manual_seed(0))
    c = model.config
    placement = torch.device(device)
    if variant == "engine":
        engine = RolloutEngine(model, EngineConfig(max_batch=prompts, max_len=prompt_len + 2))
        requests = [Request(row.tolist(), SamplingParams(temperature=0.0, max_tokens=1))
                    for row in ids]
    else:
        shape = CacheShape(c.num_layers, prompts, c.num_kv_heads, prompt_len, c.head_dim)
        cache = KVCache(shape, dtype=cache_dtype(model.lm_head.weight.dtype, placement),
                        device=placement)
    reset_peak_memory(placement)
    before = peak_memory_bytes(placement)  # just reset: what the process holds now
    start = time.perf_counter()
    with torch.no_grad():
        if variant == "engine":
            engine.generate(requests)
        else:
            positions = torch.arange(prompt_len, device=placement).expand(prompts, -1)
            model.step(ids.to(placement), positions, cache)
    seconds = time.perf_counter() - start
    queue.put((peak_memory_bytes(placement) - before, seconds))


def run(folder: str | Path, *, prompts: int = 64, prompt_len: int = 512,
        dtype: str = "bfloat16", device: str = "cpu", progress=print) -> list[PrefillCase]:
    context = multiprocessing.get_context("spawn")
    results = []
    for variant in VARIANTS:
        queue = context.Queue()
        process = context.Process(target=_measure, args=(str(folder), variant, prompts,
                                                         prompt_len, dtype, device, queue))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"prefill bench: the {variant} process failed (exit code "
                               f"{process.exitcode}; out of memory?)")
        extra, seconds = queue.get()
        case = PrefillCase(variant, prompts, prompt_len, dtype, extra / 2**20, seconds)
        progress(format_table([case], header=not results))
        results.append(case)
    return results


def as_rows(results: list[PrefillCase]) -> list[dict]:
    return [asdict(r) for r in results]


def format_table(results: list[PrefillCase], header: bool = True) -> str:
    lines = [f"{'variant':>14}{'prompts':>9}{'len':>6}{'dtype':>10}{'peak_extra_MiB':>16}"
             f"{'seconds':>9}"] if header else []
    for r in results:
        lines.append(f"{r.variant:>14}{r.prompts:>9}{r.prompt_len:>6}{r.dtype:>10}"
                     f"{r.peak_extra_mib:>16.0f}{r.seconds:>9.1f}")
    return "\n".join(lines)
