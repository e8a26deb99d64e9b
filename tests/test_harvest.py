"""Harvest: what a rollout hands the drafter's trainer is exactly what the drafter consumes —
tokens paired with the target's own features at the same positions — for plain and speculative
steps alike; the buffer is bounded and packs batches."""

import random

import pytest
import torch

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.training import collect_records
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.drafting.tree import Strategy

from tests.speculative_fixtures import PROMPTS, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("strategy", [None, Strategy(4, 1, 5), Strategy(3, 3, 7)],
                         ids=["plain", "chain", "tree"])
@pytest.mark.parametrize("feature_layers", [(-1,), (0, -1)], ids=["eagle", "eagle3"])
def test_harvested_records_equal_a_recomputation(target, strategy, feature_layers):
    """Each finished sequence's record equals collect_records on the same tokens (prompt plus
    all generated tokens but the last, which was never fed to the target): an off-by-one in
    tokens or features fails here."""
    torch.manual_seed(0)
    drafter = Drafter(target, DrafterConfig(feature_layers)).eval()
    harvest = HarvestBuffer(min_length=1)
    engine = RolloutEngine(target, EngineConfig(max_batch=3, max_len=48), drafter, harvest)
    params = SamplingParams(temperature=1.0, max_tokens=14, n=2)
    result = engine.generate([Request(p, params) for p in PROMPTS[:4]], strategy=strategy)
    assert harvest.collect() == len(harvest) == len(result.rollouts) == 8
    finished = sorted(result.rollouts, key=lambda r: r.timing.finished_s)
    for record, rollout in zip(harvest.records, finished):
        sequence = list(rollout.prompt_ids) + rollout.tokens.tolist()[:-1]
        truth = collect_records(target, [sequence], feature_layers)[0]
        assert record.tokens.tolist() == sequence
        assert (record.features - truth.features).abs().max() < 1e-4
        assert (record.last_hidden - truth.last_hidden).abs().max() < 1e-4


def test_buffer_keeps_the_newest_records_under_its_cap(target):
    drafter = Drafter(target).eval()
    harvest = HarvestBuffer(max_bytes=40_000, min_length=4)
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter, harvest)
    engine.generate([Request(p, SamplingParams(temperature=1.0, max_tokens=20)) for p in PROMPTS])
    assert len(harvest) == 0  # finished sequences become records only when collected
    assert harvest.collect() >= 1
    assert harvest.bytes <= 40_000 and harvest.evicted > 0
    assert not harvest._steps  # every step's tensors released once its sequences finished
    batches = harvest.batches(max_tokens=64, rng=random.Random(0))
    assert sum(b.tokens.shape[0] for b in batches) == len(harvest)
    assert all(b.tokens.numel() <= 64 or b.tokens.shape[0] == 1 for b in batches)


def test_harvest_needs_a_drafter(target):
    with pytest.raises(ValueError, match="harvest"):
        RolloutEngine(target, EngineConfig(max_batch=2, max_len=16), harvest=HarvestBuffer())
    with pytest.raises(ValueError, match="max_bytes"):
        HarvestBuffer(max_bytes=0)
