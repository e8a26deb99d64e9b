"""Calibration and the adaptive loop never fail on what a real model and workload give them: a
model whose first token ends its turn, one-token responses, prompts near or past max_len, ragged
prompts, batch sizes at which no step could be timed. Calibration times what it can, warns once
about the rest, and the policy built on it runs."""

import warnings

import pytest

from tests.speculative_fixtures import PROMPTS, VOCAB
from tlt_core.adaptive.cost_model import calibrate
from tlt_core.adaptive.policy import AdaptivePolicy
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams

PLANS = (Strategy(2, 1, 3), SuffixMatch(4))
KEYS = ("plain",) + tuple(plan.key for plan in PLANS)


@pytest.fixture(scope="module")
def drafter(target):
    """Untrained: these tests check what calibration times, not how much a drafter accepts."""
    return Drafter(target, DrafterConfig()).eval()


def _greedy(prompts, max_tokens=8):
    return [Request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens)) for p in prompts]


def _calibrate_warning_free(engine, requests, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here fails the test
        return AdaptivePolicy.from_calibration(engine, PLANS, requests, **options)


def _assert_policy_runs_losslessly(engine, policy, requests):
    plain = [r.tokens.tolist() for r in engine.generate(requests).rollouts]
    adaptive = engine.generate(requests, policy)
    assert [r.tokens.tolist() for r in adaptive.rollouts] == plain
    return adaptive


def test_calibration_times_steps_when_every_first_token_is_a_stop_id(target, drafter):
    """The workload's responses are one token long (every id a stop id, max_tokens 1); the
    calibration runs its own length without stop ids, so every batch size is timed."""
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), drafter)
    stop_everywhere = SamplingParams(temperature=1.0, max_tokens=1, stop_ids=tuple(range(VOCAB)))
    calibration = [Request(p, stop_everywhere) for p in PROMPTS[:2]]
    policy = _calibrate_warning_free(engine, calibration, bucket_edges=(1, 2, 4))
    model = policy.cost_model
    assert set(model.rates) == {(batch, key) for batch in (1, 4) for key in KEYS}
    assert all(rate > 0 for rate in model.rates.values())
    result = engine.generate(calibration, policy)
    assert [(len(r.tokens), r.finish_reason) for r in result.rollouts] == [(1, "stop")] * 2
    _assert_policy_runs_losslessly(engine, policy, _greedy(PROMPTS[:4]))


def test_calibration_cuts_prompts_near_and_past_max_len(target, drafter):
    """Ragged prompts of 3 tokens, max_len - 1, max_len and past it keep their last tokens:
    every row runs the calibration's full length, and no step reads past max_len."""
    max_len = 32
    long_prompts = [[i % VOCAB for i in range(n)] for n in (3, max_len - 1, max_len, 50)]
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=max_len), drafter)
    calibration = [Request(p, SamplingParams(temperature=1.0, max_tokens=16))
                   for p in long_prompts]
    policy = _calibrate_warning_free(engine, calibration, bucket_edges=(1, 2, 4))
    model = policy.cost_model
    assert set(model.rates) == {(batch, key) for batch in (1, 4) for key in KEYS}
    assert max(model.context_max.values()) <= max_len
    _assert_policy_runs_losslessly(engine, policy, _greedy(long_prompts[:2], max_tokens=1)
                                   + _greedy(PROMPTS[:2]))


def _admitted_one_at_a_time(target, drafter, max_batch):
    """Prompts as long as the prefill budget: one row is admitted per step, so at calibration's
    4 tokens a row the first row finishes before a fourth arrives."""
    config = EngineConfig(max_batch=max_batch, max_len=64, prefill_tokens=30)
    prompt = [i % VOCAB for i in range(30)]
    return RolloutEngine(target, config, drafter), [Request(prompt, SamplingParams())]


def test_batch_sizes_no_step_could_time_are_left_out_with_one_warning(target, drafter):
    engine, calibration = _admitted_one_at_a_time(target, drafter, max_batch=8)
    with pytest.warns(RuntimeWarning) as caught:
        policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration,
                                                 bucket_edges=(1, 2, 4, 8), max_tokens=4)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "at batch 4 for every plan and plain decoding; batch 8 for every plan" in message
    assert "timed sizes [1]" in message
    model = policy.cost_model
    assert model.batches == [1]  # every table covers the timed batch sizes only
    assert {batch for batch, _ in model.admission_s} == {1}
    assert policy.switch.on_at <= 1
    assert model.rate(8, None) == model.rate(1, None)  # held at the nearest timed size
    _assert_policy_runs_losslessly(engine, policy, _greedy(PROMPTS[:8]))


def test_nothing_timed_leaves_sd_off(target, drafter):
    engine, calibration = _admitted_one_at_a_time(target, drafter, max_batch=4)
    with pytest.warns(RuntimeWarning, match="SD stays off at every batch size") as caught:
        policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration, bucket_edges=(4,),
                                                 max_tokens=4)
    assert len(caught) == 1
    model = policy.cost_model
    assert model.batches == [] and model.threshold(PLANS) == 0 and policy.switch.on_at == 0
    with pytest.raises(LookupError, match="rate"):
        model.rate(4, None)
    result = _assert_policy_runs_losslessly(engine, policy, _greedy(PROMPTS[:4]))
    assert not result.spec_steps and policy.stats.plain_steps == result.decode_steps > 0
    # a max_len that leaves a row one token: no step at all, the same fallback
    tiny = RolloutEngine(target, EngineConfig(max_batch=2, max_len=2), drafter)
    with pytest.warns(RuntimeWarning, match="nothing was timed"):
        assert calibrate(tiny, PLANS, (1, 2), _greedy(PROMPTS[:2])).rates == {}


def test_bad_calibration_arguments_are_named(target, drafter):
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=64), drafter)
    requests = _greedy(PROMPTS[:1])
    with pytest.raises(ValueError, match="plans"):
        AdaptivePolicy.from_calibration(engine, (), requests)
    with pytest.raises(ValueError, match="calibration_requests"):
        calibrate(engine, PLANS, (1,), [])
    with pytest.raises(ValueError, match="max_tokens"):
        calibrate(engine, PLANS, (1,), requests, max_tokens=1)
