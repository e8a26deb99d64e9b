"""`tlt bench engine`: the engine's plain decoding throughput against Hugging Face transformers'
`generate` on the same model and weights, side by side in one run.

The model is exported through our checkpoint format (save_checkpoint) and loaded by
transformers, so both run identical weights in float32 on the CPU. Both decode greedily from
the same equal-length prompts for exactly `new_tokens` tokens (no stop tokens; transformers with
min_new_tokens = max_new_tokens), so they do the same work; a row reports generated tokens per
second for each and ratio = ours / transformers.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import save_checkpoint


@dataclass(frozen=True)
class EngineCase:
    batch: int
    ours_tok_s: float
    hf_tok_s: float
    ratio: float
    new_tokens: int
    prompt_len: int


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(model: torch.nn.Module, batches=(1, 32), new_tokens: int = 128, prompt_len: int = 16,
        reps: int = 3, seed: int = 0) -> list[EngineCase]:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(model, folder)
        hf_model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    results = []
    for batch in batches:
        prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
        engine = RolloutEngine(model, EngineConfig(max_batch=batch, max_len=prompt_len + new_tokens))
        requests = [Request(p.tolist(), params) for p in prompts]

        def ours():
            return engine.generate(requests)

        def hf():
            with torch.inference_mode():
                return hf_model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         do_sample=False, pad_token_id=0)

        ours(), hf()  # untimed: one-time costs
        ours_s, hf_s = _median_time(ours, reps), _median_time(hf, reps)
        tokens = batch * new_tokens
        results.append(EngineCase(batch, tokens / ours_s, tokens / hf_s, hf_s / ours_s,
                                  new_tokens, prompt_len))
    return results


def as_rows(results: list[EngineCase]) -> list[dict]:
    return [asdict(r) for r in results]


def format_table(results: list[EngineCase]) -> str:
    lines = [f"{'batch':>6}{'ours_tok_s':>12}{'hf_tok_s':>12}{'ratio':>8}"]
    for r in results:
        lines.append(f"{r.batch:>6}{r.ours_tok_s:>12.1f}{r.hf_tok_s:>12.1f}{r.ratio:>7.2f}x")
    return "\n".join(lines)
