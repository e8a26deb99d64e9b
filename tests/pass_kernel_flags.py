"""The packed pass's CPU kernels against the PyTorch ops they replace, through the model: the
same engine run, and the same bf16 pass, with one of tlt_core.model.packed's kernel flags on
and off (tests/test_decode_attention.py, tests/test_silu_mul.py, tests/test_rope_kernel.py)."""

from __future__ import annotations

import copy

import torch

import tlt_core.model.packed as packed
from tlt_core.drafting.drafter import Drafter
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tests.speculative_fixtures import PROMPTS


def assert_engine_decodes_alike(target, drafter, plan, flag: str, monkeypatch, *,
                                dtype: torch.dtype = torch.float32, atol: float = 1e-4) -> None:
    """Prefill, plain steps, draft levels and verification at T = 0 and T = 1 give the same
    tokens with the flag on and off, and log-probs within atol (0: bit for bit)."""
    model = copy.deepcopy(target).to(dtype)
    draft = Drafter(model, drafter.config)
    draft.load_state_dict(drafter.state_dict())
    runs = []
    for kernel in (True, False):
        monkeypatch.setattr(packed, flag, kernel)
        engine = RolloutEngine(model, EngineConfig(max_batch=4, max_len=64), draft.eval())
        requests = [Request(p, SamplingParams(temperature=t, max_tokens=12, seed=i))
                    for i, p in enumerate(PROMPTS[:3]) for t in (0.0, 1.0)]
        runs.append(engine.generate(requests, plan).rollouts)
    for through_kernel, through_pytorch in zip(*runs):
        assert through_kernel.tokens.tolist() == through_pytorch.tokens.tolist()
        torch.testing.assert_close(through_kernel.logprobs, through_pytorch.logprobs, rtol=0,
                                   atol=atol)


def assert_bf16_pass_alike(target, tokens: int, flag: str, monkeypatch) -> None:
    """bf16 rounds differently on the two paths (so sampled tokens may part after a near tie):
    the logits of a pass of `tokens` new tokens over a prompt's cache agree to a few bf16
    places with the flag on and off."""
    model = copy.deepcopy(target).to(torch.bfloat16)
    config = model.config
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, config.vocab_size, (2, 23), generator=g)
    new = torch.randint(0, config.vocab_size, (2, tokens), generator=g)
    logits = {}
    for kernel in (True, False):
        monkeypatch.setattr(packed, flag, kernel)
        shape = CacheShape(config.num_layers, 2, config.num_kv_heads, 40, config.head_dim)
        cache = KVCache(shape, dtype=cache_dtype(torch.bfloat16, torch.device("cpu")))
        with torch.no_grad():
            model.step(prompt, torch.arange(23).expand(2, 23), cache)
            cache.set_lengths(23)
            logits[kernel] = model.step(new, 23 + torch.arange(tokens).expand(2, tokens),
                                        cache).logits
    scale = float(logits[False].abs().max())
    assert float((logits[True] - logits[False]).abs().max()) <= 4 * 2 ** -8 * scale
