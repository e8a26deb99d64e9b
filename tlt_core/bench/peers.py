"""`tlt bench peers`: tlt_core next to the tools people already use, on the same work.

hf_assisted: Hugging Face transformers' assisted decoding (`generate(assistant_model=...)`, batch
1, the only batch size it supports) against our speculative decoding at batch 1, with the same
target weights: the warm embedded model exported to a Hugging Face checkpoint. The assistant is
what assisted decoding expects, a small model of the same vocabulary: the embedded model's
architecture with 2 layers instead of 8, warmed up on the same task the same way (trained and
cached on first use, about a minute); ours drafts with its one-layer EAGLE drafter, strategy
(6,1,7). Both generate every prompt of a fixed set of task problems to <eos>, one at a time;
the numbers are generated tokens per second over the whole set, at T = 0 (greedy: both must
produce the same tokens, checked) and at T = 1. Rows carry `peer`, `setting`, `ours`, `theirs`
(tokens per second) and `ratio` (ours / theirs: above 1, ours is faster).

trl_grpo (TRL's GRPOTrainer on the same model and task) is not measured yet.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace

import torch

from tlt_core.checkpoint import save_checkpoint
from tlt_core.embedded import EMBEDDED_MODEL_CONFIG
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.speculative import Strategy
from tlt_core.task import CharTokenizer, TaskConfig, generate_problems

ASSISTANT_LAYERS = 2


def assistant_model(progress: bool = True):
    """The 2-layer assistant for assisted decoding, warmed up like the target (cached)."""
    from tlt_core.warmup import WarmupConfig, load_or_train

    config = replace(EMBEDDED_MODEL_CONFIG, num_layers=ASSISTANT_LAYERS)
    return load_or_train(WarmupConfig(), config, progress=progress)[0]


def hf_assisted(target, drafter, *, problems: int = 12, seed: int = 4242, progress: bool = True
                ) -> list[dict]:
    from transformers import AutoModelForCausalLM

    tokenizer = CharTokenizer()
    prompts = [tokenizer.prompt_ids(p.prompt)
               for p in generate_problems(TaskConfig(seed=seed, num_problems=problems))]
    max_new = 7 * 63 + 16
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        save_checkpoint(target, a)
        save_checkpoint(assistant_model(progress), b)
        hf_target = AutoModelForCausalLM.from_pretrained(a, torch_dtype=torch.float32).eval()
        hf_assistant = AutoModelForCausalLM.from_pretrained(b, torch_dtype=torch.float32).eval()
    engine = RolloutEngine(target, EngineConfig(max_batch=1, max_len=max_new + 16, seed=seed),
                           drafter)
    rows = []
    for temperature in (0.0, 1.0):
        def ours():
            params = SamplingParams(temperature=temperature, max_tokens=max_new,
                                    stop_ids=(tokenizer.eos_id,))
            outs = []
            for prompt in prompts:  # one at a time: batch 1, as assisted decoding runs
                outs += engine.generate([Request(prompt, params)], Strategy(6, 1, 7)).rollouts
            return [r.tokens.tolist() for r in outs]

        def theirs():
            outs = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                with torch.inference_mode():
                    generated = hf_target.generate(
                        ids, attention_mask=torch.ones_like(ids), assistant_model=hf_assistant,
                        do_sample=temperature > 0, temperature=temperature or None, top_k=0,
                        max_new_tokens=max_new, eos_token_id=tokenizer.eos_id,
                        pad_token_id=tokenizer.pad_id)
                outs.append(generated[0, len(prompt):].tolist())
            return outs

        ours(), theirs()  # warm-up
        (ours_out, ours_s), (theirs_out, theirs_s) = _timed(ours), _timed(theirs)
        if temperature == 0.0:
            assert ours_out == theirs_out, "greedy outputs differ between tlt_core and transformers"
        ours_tokens = sum(map(len, ours_out))
        theirs_tokens = sum(map(len, theirs_out))
        rows.append({"peer": "hf_assisted", "setting": f"batch 1, T={temperature:g}",
                     "ours": ours_tokens / ours_s, "theirs": theirs_tokens / theirs_s,
                     "ratio": (ours_tokens / ours_s) / (theirs_tokens / theirs_s),
                     "tokens_ours": ours_tokens, "tokens_theirs": theirs_tokens})
    return rows


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def format_table(rows: list[dict]) -> str:
    lines = [f"{'peer':<12}{'setting':<16}{'ours':>10}{'theirs':>10}{'ratio':>8}"]
    for r in rows:
        lines.append(f"{r['peer']:<12}{r['setting']:<16}{r['ours']:>10.0f}{r['theirs']:>10.0f}"
                     f"{r['ratio']:>7.2f}x")
    return "\n".join(lines)
