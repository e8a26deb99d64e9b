"""Calibration and the adaptive loop never fail on what a real model and workload give them: a
model whose first token ends its turn, one-token responses, prompts near or past max_len, ragged
prompts, batch sizes at which no step could be timed. Calibration times what it can, warns once
about the rest, and the policy built on it runs."""

import warnings

import pytest

from tests.speculative_fixtures import PROMPTS, VOCAB
from tlt_core.adaptive.cost_model import SD_OFF, calibrate
from tlt_core.adaptive.policy import AdaptivePolicy
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams, StepOutcome

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
    policy = _calibrate_warning_free(engine, calibration, batch_edges=(1, 2, 4))
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
    policy = _calibrate_warning_free(engine, calibration, batch_edges=(1, 2, 4))
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
                                                 batch_edges=(1, 2, 4, 8), max_tokens=4)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "at batch 4 for every plan and plain decoding; batch 8 for every plan" in message
    assert "timed sizes [1]" in message
    model = policy.cost_model
    assert model.batches == [1]  # every table covers the timed batch sizes only
    assert {batch for batch, _ in model.admission_s} == {1}
    assert model.rate(8, None) == model.rate(1, None)  # held at the nearest timed size
    _assert_policy_runs_losslessly(engine, policy, _greedy(PROMPTS[:8]))


def test_nothing_timed_leaves_the_loop_to_measure_from_plain(target, drafter):
    engine, calibration = _admitted_one_at_a_time(target, drafter, max_batch=4)
    with pytest.warns(RuntimeWarning, match="the adaptive loop starts from plain") as caught:
        policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration, batch_edges=(4,),
                                                 max_tokens=4)
    assert len(caught) == 1
    model = policy.cost_model
    assert model.batches == [] and model.threshold(PLANS) == 0
    assert policy.predict(4, 10, None) == policy.predict(4, 10, PLANS[0])  # no prediction
    with pytest.raises(LookupError, match="rate"):
        model.rate(4, None)
    result = _assert_policy_runs_losslessly(engine, policy, _greedy(PROMPTS[:4]))
    assert result.step_trace[0].plan is None  # no prediction: plain first, then measure
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
            recorder.observe(StepOutcome(index, batch, 8, plan, batch * emitted, step))
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


def test_a_slowed_larger_batch_is_held_at_the_smaller_one_and_slopes_never_fall(
        target, drafter, monkeypatch):
    """Scripted: plain decoding times 100 tokens/s at batch 1, 200 at 2 and, its sweep slowed
    by other work, 100 at 4; the plan's steps shorten as the context grows (noise): the model
    holds plain decoding at batch 4 at batch 2's rate, warns naming it, and fits no negative
    slope."""
    import tlt_core.adaptive.cost_model as cost_model

    step_s = {(1, "plain"): 0.01, (2, "plain"): 0.01, (4, "plain"): 0.04,
              (1, "(2,1,3)"): 0.01, (2, "(2,1,3)"): 0.01, (4, "(2,1,3)"): 0.01}

    def scripted(engine, requests, plan, batch):
        recorder = cost_model._Recorder(plan, batch)
        key = (batch, cost_model._table_key(plan))
        for index in range(6):  # the plan's steps shorten as the context grows
            falling = 1e-4 * index if plan is not None else 0.0
            recorder.observe(StepOutcome(index, batch, 8 + index, plan, batch,
                                         step_s[key] - falling))
        recorder.wall_s = recorder.all_steps_s
        return recorder

    monkeypatch.setattr(cost_model, "_measure", scripted)
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), drafter)
    calibration = [Request(PROMPTS[0], SamplingParams(max_tokens=8))]
    with pytest.warns(RuntimeWarning, match=r"plain at batch 4 timed 100 tokens/s, held at "
                                            r"batch 2's 200"):
        model = calibrate(engine, [Strategy(2, 1, 3)], (1, 2, 4), calibration)
    assert model.rates[(4, "plain")] == pytest.approx(200)
    assert model.rates[(1, "plain")] == pytest.approx(100)  # a smaller batch stays as timed
    assert min(model.context_slope.values()) == 0.0


def test_long_context_runs_fit_the_context_slope_between_two_contexts(target, drafter,
                                                                        monkeypatch):
    """Scripted steps whose seconds grow by 1e-4 per context token: the short run spans a few
    tokens, the stretched run starts at long_context (or what prefill_tokens admits for all
    rows at once); the fit through the two runs finds the slope, and the model prices a long
    context by it."""
    import tlt_core.adaptive.cost_model as cost_model

    prompts_seen = {}

    def scripted(engine, requests, plan, batch):
        recorder = cost_model._Recorder(plan, batch)
        prompt = len(requests[0].prompt_ids)
        assert {len(r.prompt_ids) for r in requests} == {prompt}
        assert list(requests[0].prompt_ids[-len(PROMPTS[0]):]) == list(PROMPTS[0])  # last
        prompts_seen.setdefault((batch, cost_model._table_key(plan)), []).append(prompt)
        for index in range(6):
            recorder.observe(StepOutcome(index, batch, prompt + index, plan, batch,
                                         0.01 + 1e-4 * (prompt + index)))
        recorder.wall_s = recorder.all_steps_s
        return recorder

    monkeypatch.setattr(cost_model, "_measure", scripted)
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=512, prefill_tokens=640),
                           drafter)
    calibration = [Request(PROMPTS[0], SamplingParams(max_tokens=8))]
    plan = Strategy(2, 1, 3)
    model = calibrate(engine, [plan], (1, 4), calibration, max_tokens=8, long_context=300)
    short = len(PROMPTS[0])
    # batch 1: 300 tokens; batch 4: 640 // 4 = 160, what the prefill budget admits at once
    assert prompts_seen[(1, "plain")] == [short, 300]
    assert prompts_seen[(4, plan.key)] == [short, 160]
    for batch, long in ((1, 300), (4, 160)):
        key = (batch, "plain")
        assert model.context_slope[key] == pytest.approx(1e-4)
        assert model.context_mean[key] == pytest.approx(short + 2.5)
        assert model.context_max[key] == long + 5
    # a step at context 150 at one row: 0.01 + 0.015 s for one token
    assert model.rate(1, None, 150) == pytest.approx(1 / (0.01 + 1e-4 * 150))
    with pytest.raises(ValueError, match="long_context"):
        calibrate(engine, [plan], (1,), calibration, long_context=-1)


def test_long_context_calibration_runs_on_a_real_engine(target, drafter):
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=96), drafter)
    calibration = [Request(p, SamplingParams(temperature=1.0, max_tokens=8)) for p in PROMPTS[:2]]
    plan = Strategy(2, 1, 3)
    model = calibrate(engine, [plan], (1, 2), calibration, max_tokens=8, long_context=80)
    assert set(model.context_slope) == set(model.rates)
    # the stretched prompts: 80 tokens, max_len - max_tokens = 88 leaves them whole
    assert all(80 < model.context_max[key] <= 88 for key in model.rates)


def test_a_wide_context_fit_extrapolates_and_a_narrow_one_holds():
    """A line through a stretched run (longest context >= EXTRAPOLATE_SPAN x the mean the rate
    was measured at) prices longer contexts linearly, as attention reads them; one fitted
    within a short run's few tokens is held at its longest context."""
    from tlt_core.adaptive.cost_model import EXTRAPOLATE_SPAN, CostModel

    def model(longest: float) -> CostModel:  # 0.01 s a step at context 100, +1e-5 s a token
        return CostModel({(1, "plain"): 100.0}, context_slope={(1, "plain"): 1e-5},
                         context_mean={(1, "plain"): 100.0},
                         context_max={(1, "plain"): longest})

    wide, narrow = model(EXTRAPOLATE_SPAN * 100), model(120)
    assert wide.rate(1, None, 1100) == pytest.approx(1 / (0.01 + 1e-5 * 1000))
    assert narrow.rate(1, None, 1100) == pytest.approx(1 / (0.01 + 1e-5 * 20))
    assert wide.rate(1, None, 110) == narrow.rate(1, None, 110)  # within both fits: the line
