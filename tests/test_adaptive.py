"""The adaptive rollout loop: SD switch hysteresis, calibrated cost model, bandit-driven plans,
outputs unchanged, state through a checkpoint."""

import pytest
import torch

from tests.speculative_fixtures import PROMPTS
from tlt_core.adaptive.policy import AdaptivePolicy
from tlt_core.adaptive.bandit import PlanBandit
from tlt_core.adaptive.cost_model import SD_OFF, calibrate
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams, StepOutcome
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.adaptive.sd_switch import SDSwitch
from tlt_core.drafting.tree import Strategy

PLANS = (Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 6), SuffixMatch(6))


def test_switch_does_not_flap_on_an_oscillating_batch():
    switch = SDSwitch(on_at=16)
    assert switch.off_above == 32
    states = [switch.update(b) for b in (40, 20, 17, 16, 17, 15, 18, 16, 30, 17, 32, 20)]
    assert states == [False, False, False] + [True] * 9
    assert switch.transitions == 1
    states = [switch.update(b) for b in (33, 31, 33, 30, 20, 17, 16)]
    assert states == [False] * 6 + [True]  # off above 32; back on only at <= 16
    assert switch.transitions == 3
    never = SDSwitch(on_at=0)
    assert not any(never.update(b) for b in (1, 2, 1))
    with pytest.raises(ValueError, match="off_above"):
        SDSwitch(on_at=8, off_above=4)
    with pytest.raises(ValueError, match="batch"):
        switch.update(0)


def _requests(n=6, temperature=0.0):
    """n samples of 4 prompts, of ragged lengths (6 to 36 tokens), so the batch drains."""
    return [Request(p, SamplingParams(temperature=temperature, max_tokens=6 + 5 * ((i + k) % 7)))
            for i, p in enumerate(PROMPTS[:4]) for k in range(n)]


def test_greedy_outputs_identical_with_the_adaptive_loop_on_and_off(target, drafter):
    """Continuous batching (32 samples through 8 rows) turns SD on in the drain; an exploring
    bandit changes the plan from step to step, mid-sequence; a switch that is on at every batch
    size runs every plan on full batches too."""
    requests = _requests(8)
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    plain = [r.tokens.tolist() for r in engine.generate(requests).rollouts]
    for switch in (SDSwitch(on_at=6, off_above=7), SDSwitch(on_at=8)):
        policy = AdaptivePolicy(PLANS, switch, PlanBandit(PLANS, epsilon=1.0, seed=3))
        result = engine.generate(requests, policy)
        assert [r.tokens.tolist() for r in result.rollouts] == plain
        assert policy.stats.spec_steps == len(result.spec_steps) > 0
        assert switch.transitions == 1  # on once; never back off while draining
    assert policy.stats.plain_steps == 0
    assert {s.plan_key for s in result.spec_steps} == {p.key for p in PLANS}


def test_calibration_seeds_the_switch_and_the_bandit(target, drafter):
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    calibration = [Request(p, SamplingParams(temperature=1.0, max_tokens=16)) for p in PROMPTS[:2]]
    policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration, bucket_edges=(1, 2, 4, 8))
    model = policy.cost_model
    assert model.batches == [1, 4, 8]  # every other edge and the largest
    assert policy.switch.on_at == model.threshold(PLANS)
    for batch in (1, 2, 4, 8):
        for arm, plan in enumerate(PLANS):  # priors, before any reward
            assert policy.bandit.estimate(batch, arm) == pytest.approx(model.rate(batch, plan))
    # interpolation in log2(batch) between calibrated sizes
    assert model.rate(2, None) == pytest.approx((model.rate(1, None) + model.rate(4, None)) / 2)
    assert all(rate > 0 for rate in model.rates.values())
    # every calibration run's time outside its decode steps (prefill, scheduling) is measured
    assert set(model.admission_s) == set(model.rates)
    assert all(seconds > 0 for seconds in model.admission_s.values())
    # calibration ran on its own suffix index: the engine's history is untouched; the engine
    # is usable
    assert len(engine.suffix_index) == 0
    assert engine.generate(_requests(1)).rollouts
    with pytest.raises(ValueError, match="calibration_requests"):
        AdaptivePolicy.from_calibration(engine, PLANS, [])


def test_calibration_sweeps_keep_medians_and_can_time_sd_off(target, drafter):
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), drafter)
    calibration = [Request(p, SamplingParams(temperature=1.0, max_tokens=12)) for p in PROMPTS[:2]]
    plan = Strategy(2, 1, 3)
    model = calibrate(engine, [plan], (1, 4), calibration, max_tokens=12, sd_off=True, reps=3)
    # SD off for the whole call (no drafter in the loop) is measured beside the adaptive
    # loop's plain steps and the plan
    assert set(model.rates) == {(b, k) for b in (1, 4) for k in ("off", "plain", plan.key)}
    assert set(model.admission_s) == set(model.rates)
    assert model.key(SD_OFF) == "off" and model.key(None) == "plain"
    assert model.acceptance[plan.key] >= 1
    with pytest.raises(ValueError, match="reps"):
        calibrate(engine, [plan], (1,), calibration, reps=0)


def test_a_burst_in_one_calibration_sweep_is_ignored(target, drafter, monkeypatch):
    """Scripted measurements: the second of three sweeps is 5x slower (someone else's work on
    a shared machine); the model keeps every sweep's median."""
    import tlt_core.adaptive.cost_model as cost_model

    sweep = iter([1, 1, 5, 5, 1.2, 1.2])  # a step's seconds: (plain, plan) per sweep

    def scripted(engine, requests, plan, batch):
        recorder = cost_model._Recorder(plan, batch)
        step = next(sweep)
        emitted = 3 if plan is not None else 1  # a plan's rows emit 3 tokens a step
        for index in range(4):
            recorder.observe(StepOutcome(batch, plan, batch * emitted, step))
        recorder.wall_s = recorder.all_steps_s + step / 10  # admission: a tenth of a step
        return recorder

    monkeypatch.setattr(cost_model, "_measure", scripted)
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=64), drafter)
    calibration = [Request(PROMPTS[0], SamplingParams(max_tokens=8))]
    plan = Strategy(2, 1, 3)
    model = calibrate(engine, [plan], (2,), calibration, reps=3)
    assert model.acceptance == {plan.key: 3}
    assert model.rates == {(2, "plain"): pytest.approx(2 / 1.2),
                           (2, plan.key): pytest.approx(2 * 3 / 1.2)}
    assert model.admission_s[(2, "plain")] == pytest.approx(0.12)


def test_policy_state_round_trips_through_a_checkpoint(target, drafter, tmp_path):
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    make = lambda: AdaptivePolicy(PLANS, SDSwitch(on_at=8), PlanBandit(PLANS, seed=1))  # noqa: E731
    policy = make()
    engine.generate(_requests(2, temperature=1.0), policy)
    torch.save(policy.state_dict(), tmp_path / "policy.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "policy.pt", weights_only=True))
    assert resumed.switch.state_dict() == policy.switch.state_dict()
    picks = [[p.bandit.select(b) for b in (1, 3, 8, 2, 5)] for p in (policy, resumed)]
    assert picks[0] == picks[1]
    for arm in range(len(PLANS)):  # nan (never tried, no prior) compares as a string
        assert repr(resumed.bandit.estimate(3, arm)) == repr(policy.bandit.estimate(3, arm))


def test_a_drafterless_engine_adapts_over_suffix_match_plans_only(target):
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64))
    calibration = [Request(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=12))]
    policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration, bucket_edges=(1, 4))
    assert policy.plans == (SuffixMatch(6),)
    with pytest.raises(ValueError, match="drafter"):
        engine.generate(_requests(1), Strategy(2, 1, 3))


def test_rollout_benchmark_workloads_are_long_tailed_and_equal():
    from tlt_core.bench.rollout import workloads
    from tlt_core.engine import seconds_at_or_below

    loads = workloads()
    assert {k: len(v) for k, v in loads.items()} == {"long_tail": 64, "no_tail": 64}
    prompts = {name: list(dict.fromkeys(r.prompt_ids for r in reqs)) for name, reqs in loads.items()}
    assert len(prompts["long_tail"]) == len(prompts["no_tail"]) == 8
    # steps ending at 1, 2, 4 s with 64, 8, 4 rows: the tail at <= 8 rows is 1 s + 2 s
    assert seconds_at_or_below([1.0, 2.0, 4.0], [64, 8, 4], limit=8) == 3.0
