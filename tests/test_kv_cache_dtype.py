"""A bf16 model's KV cache on the CPU is bf16 (tlt_core.model.kv_cache.cache_dtype): its keys and
values are bf16 values, so the cache holds them exactly and the attention kernel, widening each
element as it loads it, computes what a float32 cache holding them computes. An engine decodes
the same tokens and log-probs, bit for bit, with either cache: prefill (one over the packed
products' widest rows too), plain steps, chains, trees and sampled chains, the drafter's cache
included, at T = 0 and T = 1."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tlt_core.model.kv_cache as kv_cache
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.kv_cache import cache_dtype
from tests.cli_fixtures import tiny_checkpoint
from tests.speculative_fixtures import PROMPTS

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_cache_dtype_follows_the_weights():
    cpu = torch.device("cpu")
    assert cache_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert cache_dtype(torch.float32, cpu) == torch.float32
    assert cache_dtype(torch.float16, cpu) == torch.float32  # no float16 kernels on the CPU


def test_the_float32_switch_is_only_for_bf16_weights(monkeypatch):
    monkeypatch.setattr(kv_cache, "BF16_CACHE_ON_CPU", False)
    assert cache_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert cache_dtype(torch.float32, torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("plan", [None, Strategy(4, 1, 5), Strategy(3, 2, 6), SampledChain(3)],
                         ids=str)
def test_an_engine_decodes_the_same_bits_with_a_bf16_cache(target, drafter, plan, monkeypatch):
    model = copy.deepcopy(target).to(torch.bfloat16)
    draft = Drafter(model, drafter.config)
    draft.load_state_dict(drafter.state_dict())
    draft = draft.to(torch.bfloat16).eval()
    long_prompt = [(7 * i) % model.config.vocab_size for i in range(150)]  # prefill past 128 rows
    requests = [Request(p, SamplingParams(temperature=t, max_tokens=12, seed=i))
                for i, p in enumerate(PROMPTS[:3] + [long_prompt]) for t in (0.0, 1.0)]
    runs = {}
    for bf16 in (True, False):
        monkeypatch.setattr(kv_cache, "BF16_CACHE_ON_CPU", bf16)
        engine = RolloutEngine(model, EngineConfig(max_batch=4, max_len=192), draft)
        assert engine.cache.data.dtype == (torch.bfloat16 if bf16 else torch.float32)
        with torch.inference_mode():
            runs[bf16] = engine.generate(requests, plan).rollouts
    for narrow, wide in zip(runs[True], runs[False]):
        assert narrow.tokens.tolist() == wide.tokens.tolist()
        assert torch.equal(narrow.logprobs, wide.logprobs)


def test_the_bench_times_both_caches_on_a_tiny_checkpoint(tmp_path):
    """bench/kv_cache_dtype.py: a row per (batch, context, plan), both caches timed, the same
    tokens decoded (it raises otherwise), SD's speedup given under each cache."""
    model, drafter = tiny_checkpoint(tmp_path, with_drafter=True)
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "kv_cache_dtype.py"), "--model",
                    str(model), "--drafter", str(drafter), "--strategy", "s2", "--batch", "1,2",
                    "--context", "20", "--tokens", "4", "--reps", "1", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"], r["plan"]) for r in rows] == [
        (1, 20, "plain"), (1, 20, "sampled(2)"), (2, 20, "plain"), (2, 20, "sampled(2)")]
    for row in rows:
        assert row["ms_per_token_float32"] > 0 and row["ms_per_token_bfloat16"] > 0
        assert row["speedup_bf16_cache"] == (row["ms_per_token_float32"]
                                             / row["ms_per_token_bfloat16"])
        assert ("sd_speedup_float32" in row) == (row["plan"] != "plain")
