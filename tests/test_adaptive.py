"""The adaptive rollout loop: one decision over measured truth (plain is an arm), conservative
exploration, per-call state, no drafter work while off, outputs unchanged, state through a
checkpoint. The decision is tested on a synthetic cost model (`_drive`), where the truth is
known; the engine-level properties on the tiny model."""

import math
import random

import pytest

from tests.speculative_fixtures import PROMPTS
from tlt_core.adaptive.arm_table import ArmTable, Estimate
from tlt_core.adaptive.buckets import StepBuckets
from tlt_core.adaptive.policy import PLAIN, AdaptivePolicy
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams, StepOutcome

PLANS = (Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 6), SuffixMatch(6))
SYNTHETIC_PLANS = (Strategy(2, 1, 3), Strategy(4, 1, 5))
BUCKETS = StepBuckets((1, 2, 4, 8, 16, 32, 64), (1024,))


# ---- a synthetic cost model ---------------------------------------------------------------

def plain_step_s(batch: int) -> float:
    return 0.010 + 0.001 * batch


class Truth:
    """A step's true cost: plain steps cost plain_step_s(B); an SD plan's step costs `cost`
    plain steps and commits accept(B) tokens per row (a number: the same at every batch)."""

    def __init__(self, accept, cost: float = 1.6, noise: float = 0.0, seed: int = 0):
        self.accept = accept if callable(accept) else (lambda batch, value=accept: value)
        self.cost, self.noise = cost, noise
        self.random = random.Random(seed)

    def tokens_per_row(self, plan, batch: int) -> float:
        return 1.0 if plan is None else self.accept(batch)

    def seconds(self, plan, batch: int) -> float:
        base = plain_step_s(batch) * (1.0 if plan is None else self.cost)
        return base * (1.0 + self.noise * self.random.uniform(-1, 1))

    def rate(self, plan, batch: int) -> float:
        return batch * self.tokens_per_row(plan, batch) / (
            plain_step_s(batch) * (1.0 if plan is None else self.cost))


def shrinking(batch: int) -> float:
    """Acceptance whose SD speed-up falls with the batch as measured on SmolLM2 (1.5x at one
    row, 0.15x less per doubling: 1.2x at 4, 0.9x at 16, 0.6x at 64)."""
    return 1.6 * (1.5 - 0.15 * math.log2(batch))


def primed(truth: Truth | None = None, prior=None, **kwargs) -> AdaptivePolicy:
    """A policy over SYNTHETIC_PLANS predicting prior(plan, batch) (default: the truth's
    rates, a perfect calibration)."""
    prior = prior or truth.rate
    return AdaptivePolicy(SYNTHETIC_PLANS, BUCKETS,
                          predict=lambda batch, context, plan: prior(plan, batch), **kwargs)


def tail_lengths(rows: int = 64, seed: int = 0) -> list[int]:
    """A long tail: lognormal lengths, median 40, a few rows past 400."""
    g = random.Random(seed)
    return [max(1, min(600, int(40 * g.lognormvariate(0, 1.0)))) for _ in range(rows)]


def _drive(policy, truth: Truth, lengths: list[int], choose=None) -> dict:
    """One call of the loop over rows of these lengths (tokens), each step's cost from truth:
    returns seconds, steps, and the (batch, arm) of every step. choose: a fixed choice
    batch -> plan instead of the policy's."""
    remaining = list(lengths)
    seconds, trace = 0.0, []
    if choose is None:
        policy.start_call()
    step = 0
    while any(remaining):
        running = [i for i, r in enumerate(remaining) if r]
        batch = len(running)
        plan = choose(batch) if choose is not None else policy.choose(batch, 100)
        per_row = truth.tokens_per_row(plan, batch)
        emitted = 0
        for index in running:  # whole tokens: the fraction goes to the first rows
            take = min(remaining[index], int(per_row) + (index % 10 < 10 * (per_row % 1)))
            remaining[index] -= take
            emitted += take
        took = truth.seconds(plan, batch)
        seconds += took
        trace.append((batch, PLAIN if plan is None else plan.key))
        if choose is None:
            policy.observe(StepOutcome(step, batch, 100, plan, emitted, took))
        step += 1
    return {"seconds": seconds, "trace": trace}


def oracle_s(truth: Truth, lengths: list[int]) -> float:
    """The best arm at every batch, with perfect knowledge."""
    def best(batch):
        return max((None,) + SYNTHETIC_PLANS, key=lambda plan: truth.rate(plan, batch))
    return _drive(None, truth, lengths, choose=best)["seconds"]


def plain_s(truth: Truth, lengths: list[int]) -> float:
    return _drive(None, truth, lengths, choose=lambda batch: None)["seconds"]


# ---- the decision -----------------------------------------------------------------------------

def test_plain_wins_where_it_is_faster_and_the_loop_stays_within_3_percent():
    truth = Truth(accept=1.3)  # SD at 1.3 tokens for 1.6 plain steps: 0.81x at every batch
    policy = primed(truth)
    lengths = tail_lengths()
    for call in range(3):
        run = _drive(policy, truth, lengths)
        assert run["seconds"] <= 1.03 * plain_s(truth, lengths)
    assert all(arm == PLAIN for _, arm in run["trace"][-100:])


def test_sd_wins_where_it_is_faster():
    truth = Truth(accept=shrinking)
    policy = primed(truth)
    lengths = tail_lengths()
    for _ in range(2):
        run = _drive(policy, truth, lengths)
    assert run["seconds"] <= 1.03 * oracle_s(truth, lengths)
    assert oracle_s(truth, lengths) < 0.95 * plain_s(truth, lengths)
    assert all(arm != PLAIN for batch, arm in run["trace"][-50:] if batch <= 2)
    large = [arm for batch, arm in run["trace"] if batch > 16]
    assert sum(arm != PLAIN for arm in large) <= 0.15 * len(large)  # explorations only


def test_a_wrong_calibration_is_reversed_online():
    truth = Truth(accept=1.3, noise=0.1)  # SD loses everywhere...
    # ...but calibration said it wins 1.5x everywhere
    policy = primed(truth, prior=lambda plan, batch: plain_step_s(batch) and
                    batch / plain_step_s(batch) * (1.0 if plan is None else 1.5))
    lengths = tail_lengths(seed=1)
    first = _drive(policy, truth, lengths)
    late = first["trace"][len(first["trace"]) // 2:]
    assert sum(arm != PLAIN for _, arm in late) <= 0.05 * len(late)
    second = _drive(policy, truth, lengths)  # the table carries over: no relearning
    assert second["seconds"] <= 1.03 * plain_s(Truth(accept=1.3), lengths)

    # the other way: calibration underestimated acceptance by 45%, so SD seemed to lose at
    # every batch; it wins below 8 rows
    truth = Truth(accept=shrinking, noise=0.1)
    policy = primed(truth, prior=lambda plan, batch:
                    truth.rate(plan, batch) * (1.0 if plan is None else 0.55))
    runs = [_drive(policy, truth, lengths) for _ in range(4)]  # SD proves itself first
    assert runs[-1]["seconds"] <= 1.03 * oracle_s(Truth(accept=shrinking), lengths)
    tail = [arm for batch, arm in runs[-1]["trace"] if batch <= 2]
    assert sum(arm != PLAIN for arm in tail) >= 0.8 * len(tail)


def test_a_favourable_prediction_alone_never_turns_sd_on():
    """Calibration said every plan wins 1.5x; truth says each loses (0.63x). Unmeasured, an
    SD plan runs only as a budgeted exploration, never as the call's mode: already the first
    call stays within 3% of plain decoding, however many plans there are to try."""
    plans = tuple(Strategy(depth, 1, depth + 1) for depth in range(2, 9))
    truth = Truth(accept=1.1, cost=1.75, noise=0.1)
    policy = AdaptivePolicy(plans, BUCKETS, predict=lambda batch, context, plan:
                            batch / plain_step_s(batch) * (1.0 if plan is None else 1.5))
    lengths = tail_lengths(seed=3)
    run = _drive(policy, truth, lengths)
    assert run["seconds"] <= 1.03 * plain_s(Truth(accept=1.1), lengths)
    assert policy.stats.switches == 0


def test_sd_as_the_mode_measures_plain_first_in_each_cell():
    """Where SD is the mode, each cell measures BASELINE_STEPS plain steps before speculating,
    once (the table keeps them across calls): turning back to plain then compares two
    measurements, not SD's against a borrowed guess."""
    truth = Truth(accept=lambda batch: 4.0)  # SD 2.5x at every batch
    policy = primed(truth)
    chosen = []
    for call in range(2):
        policy.start_call()
        for step, batch in enumerate((8, 8, 8, 8, 1, 1, 1)):
            plan = policy.choose(batch, 100)
            chosen.append(plan)
            policy.observe(StepOutcome(step, batch, 100, plan,
                                       round(batch * truth.tokens_per_row(plan, batch)),
                                       truth.seconds(plan, batch)))
    first, second = chosen[:7], chosen[7:]
    assert [plan is None for plan in first] == [True, True, False, False, True, True, False]
    assert all(plan is not None for plan in second)


def test_the_first_speculative_step_is_charged_but_not_measured():
    """The process's first speculative step pays one-time costs (5x a steady step here): the
    budget pays them, the table never sees them, so no cell borrows that rate."""
    truth = Truth(accept=lambda batch: 4.0)  # SD 2.5x at every batch
    policy = primed(truth)
    policy.start_call()
    cell, arms = BUCKETS.cell(8, 100), []
    for step in range(12):
        plan = policy.choose(8, 100)
        arm = PLAIN if plan is None else 1 + SYNTHETIC_PLANS.index(plan)
        first = plan is not None and all(a == PLAIN for a in arms)
        seconds = truth.seconds(plan, 8) * (5.0 if first else 1.0)
        arms.append(arm)
        policy.observe(StepOutcome(step, 8, 100, plan, round(8 * truth.tokens_per_row(plan, 8)),
                                   seconds))
    speculative = [a for a in arms if a != PLAIN]
    assert len(speculative) >= 2
    assert sum(policy.table.steps(cell, a) for a in range(1, len(SYNTHETIC_PLANS) + 1)) == \
        len(speculative) - 1
    assert policy.table.steps(cell, PLAIN) == arms.count(PLAIN)
    ratio = policy.table.group_ratio(cell, speculative[0])
    assert ratio == pytest.approx(1.0, rel=0.01)  # the steady steps: as predicted


def test_no_latch_when_the_off_point_is_at_max_batch():
    """Calibration overestimated acceptance by 70%, so SD seemed to pay at every batch up to
    max_batch (an off point there); truth says only below 8 rows. The loop turns SD off at
    large batches once measured, and keeps it where it pays."""
    truth = Truth(accept=shrinking)
    policy = primed(truth, prior=lambda plan, batch:
                    truth.rate(plan, batch) * (1.0 if plan is None else 1.7))
    assert all(policy.best(batch, 100) is not None for batch in (1, 8, 64))
    lengths = tail_lengths(seed=2)
    _drive(policy, truth, lengths)
    run = _drive(policy, truth, lengths)
    large = [arm for batch, arm in run["trace"] if batch > 16]  # SD loses there by >= 10%
    assert sum(arm != PLAIN for arm in large) <= 0.1 * len(large)  # single explorations
    assert run["seconds"] <= 1.03 * oracle_s(truth, lengths)


def test_the_mode_resets_per_call_and_hysteresis_holds_within_one():
    truth = Truth(accept=shrinking)
    policy = primed(truth)
    run = _drive(policy, truth, tail_lengths())
    assert run["trace"][-1][1] != PLAIN  # the call ended speculating, in the tail
    policy.start_call()
    assert policy.choose(64, 100) is None  # a new call at 64 rows: plain at once
    # within a call, SD turns off at once when measured confidently slower...
    policy.start_call()
    assert policy.choose(1, 100) is not None  # the call's first step: no wait
    switches, chosen = policy.stats.switches, []
    for step in range(3):  # SD steps at 64 rows: one token per row at twice the cost
        chosen.append(policy.choose(64, 100))
        policy.observe(StepOutcome(step, 64, 100, chosen[-1], 64,
                                   plain_step_s(64) * (1 if chosen[-1] is None else 2)))
    assert chosen[-1] is None
    assert policy.stats.switches == switches + 1
    # ...and back on only after `hysteresis` steps whose evidence prefers it
    for _ in range(policy.hysteresis - 1):  # (explorations may run SD meanwhile)
        policy.choose(1, 100)
    assert policy.stats.switches == switches + 1
    assert policy.choose(1, 100) is not None
    assert policy.stats.switches == switches + 2


def test_bad_bucket_specs_and_tables_are_refused_by_name():
    with pytest.raises(ValueError, match="batch_edges.*max_batch 64"):
        StepBuckets.covering(64, (1, 2, 4, 8, 16, 32))
    with pytest.raises(ValueError, match="batch_edges: edges must be strictly increasing"):
        StepBuckets((1, 4, 4))
    with pytest.raises(ValueError, match="context_edges"):
        StepBuckets((1, 2), (0,))
    with pytest.raises(ValueError, match="hysteresis"):
        AdaptivePolicy(SYNTHETIC_PLANS, BUCKETS, hysteresis=0)
    with pytest.raises(ValueError, match="table"):
        AdaptivePolicy(SYNTHETIC_PLANS, BUCKETS, ArmTable(7, 2, 2))
    with pytest.raises(ValueError, match="plans: duplicate"):
        AdaptivePolicy(SYNTHETIC_PLANS * 2, BUCKETS)
    with pytest.raises(ValueError, match="plans: need at least one"):
        AdaptivePolicy((), BUCKETS)
    assert StepBuckets.covering(6, (1, 2, 4, 8, 16)).batch_edges == (1, 2, 4, 8)


def test_the_table_learns_a_ratio_to_the_prediction_and_lends_it_to_nearby_buckets():
    table = ArmTable(3, 2, 1, window=4, prior_weight=2.0)  # 3 batch buckets x 2 contexts
    assert table.estimate(0, 0, 100.0) == Estimate(100.0, 50.0, 0)  # spread: half
    for tokens in (10, 30):  # bucket 1, context 0: 20 tokens / s where 100 was predicted
        table.add(2, 0, tokens, 1.0, 100.0)
    assert table.group_ratio(2, 0) == table.group_ratio(3, 0) == pytest.approx(0.2)
    # the ratio, its prior (the group's) as 2 steps: (0.2 x 200 + 40) / (200 + 200)
    assert table.estimate(2, 0, 100.0).rate == pytest.approx(20.0)
    # at a step where the prediction is 50 (a smaller batch in the same bucket): half
    assert table.estimate(2, 0, 50.0).rate == pytest.approx(10.0)
    # unmeasured cells borrow the nearest group's ratio
    assert table.estimate(3, 0, 100.0).rate == table.estimate(0, 0, 100.0).rate == \
        pytest.approx(20.0)
    table.add(4, 0, 60, 1.0, 100.0)  # bucket 2 measured 0.6: bucket 0's nearest is still 1
    assert table.group_ratio(4, 0) == pytest.approx(0.6)
    assert table.group_ratio(0, 0) == pytest.approx(0.2)
    for _ in range(4):  # the window forgets the first two steps
        table.add(2, 0, 50, 1.0, 100.0)
    assert table.group_ratio(2, 0) == pytest.approx(0.5)
    assert table.mean_step_s(2, 0) == 1.0 and table.mean_step_s(1, 0) is None
    with pytest.raises(ValueError, match="seconds"):
        table.add(0, 0, 1, 0.0, 100.0)
    with pytest.raises(ValueError, match="predicted_rate"):
        table.add(0, 0, 1, 1.0, 0.0)


# ---- on the engine ----------------------------------------------------------------------------

def _requests(n=6, temperature=0.0):
    """n samples of 4 prompts, of ragged lengths (6 to 36 tokens), so the batch drains."""
    return [Request(p, SamplingParams(temperature=temperature, max_tokens=6 + 5 * ((i + k) % 7)))
            for i, p in enumerate(PROMPTS[:4]) for k in range(n)]


def test_greedy_outputs_identical_with_the_adaptive_loop_on_and_off(target, drafter):
    """Continuous batching (32 samples through 8 rows); a policy that believes every arm
    equal explores them all, switching plans and modes mid-sequence."""
    requests = _requests(8)
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    plain = [r.tokens.tolist() for r in engine.generate(requests).rollouts]
    buckets = StepBuckets((1, 2, 4, 8), ())
    policy = AdaptivePolicy(PLANS, buckets, hysteresis=1, tolerance=0.9)  # no prediction
    arms = set()
    for _ in range(2):
        result = engine.generate(requests, policy)
        assert [r.tokens.tolist() for r in result.rollouts] == plain
        arms |= {o.arm for o in result.step_trace}
    assert policy.stats.explorations > 0
    assert "plain" in arms and len(arms) >= 3


def test_no_drafter_work_while_sd_is_off(target, drafter):
    """Plain steps above 2 rows, SD at <= 2: the drafter runs no pass until the first SD step,
    which pays the catch-up of every position before it (prompts included)."""
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    plan, steps, passes = Strategy(4, 1, 5), [], []
    run = engine.drafter_rows.run

    def counted(*args, **kwargs):
        passes.append(len(steps))
        return run(*args, **kwargs)

    engine.drafter_rows.run = counted
    requests = _requests(2)
    result = engine.generate(requests, lambda batch: steps.append(batch) or
                             (plan if batch <= 2 else None))
    first_sd = next(o.step for o in result.step_trace if o.plan is not None)
    assert passes and min(passes) == first_sd + 1  # no pass before the first SD step's choice
    sd_outcome = result.step_trace[first_sd]
    assert sd_outcome.catch_up_s > 0
    assert all(o.catch_up_s == 0 for o in result.step_trace if o.step != first_sd)
    plain = engine.generate(requests)
    assert [r.tokens.tolist() for r in result.rollouts] == \
        [r.tokens.tolist() for r in plain.rollouts]


def test_calibration_seeds_every_cell_and_arm(target, drafter):
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    calibration = [Request(p, SamplingParams(temperature=1.0, max_tokens=16)) for p in PROMPTS[:2]]
    policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration,
                                             batch_edges=(1, 2, 4, 8), context_edges=(32,))
    model = policy.cost_model
    assert model.batches == [1, 4, 8]  # every other edge and the largest
    assert policy.buckets.cells == 8
    for batch in range(1, 9):
        for context in (3, 40):  # before any step, the loop believes the cost model
            rates = {plan: model.rate(batch, plan, context) for plan in policy.arms}
            assert all(policy.predict(batch, context, plan) == pytest.approx(rate)
                       for plan, rate in rates.items())
            assert policy.best(batch, context) is max(rates, key=rates.get)
    assert len(engine.suffix_index) == 0  # calibration ran on its own suffix index
    with pytest.raises(ValueError, match="calibration_requests"):
        AdaptivePolicy.from_calibration(engine, PLANS, [])
    with pytest.raises(ValueError, match="batch_edges"):
        AdaptivePolicy.from_calibration(engine, PLANS, calibration, batch_edges=(1, 2, 4))


def test_policy_state_round_trips_through_a_checkpoint(target, drafter, tmp_path):
    from tlt_core.persistence.checkpoint_io import read_state, write_state

    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64), drafter)
    policy = AdaptivePolicy(PLANS, StepBuckets((1, 2, 4, 8), ()))
    engine.generate(_requests(2, temperature=1.0), policy)
    write_state(policy.state_dict(), tmp_path / "policy")
    resumed = AdaptivePolicy(PLANS, StepBuckets((1, 2, 4, 8), ()))
    resumed.load_state_dict(read_state(tmp_path / "policy"))
    for cell in range(policy.buckets.cells):
        for arm in range(len(policy.arms)):
            assert resumed.table.estimate(cell, arm, 100.0) == \
                policy.table.estimate(cell, arm, 100.0)
    assert resumed.state_dict() == policy.state_dict()
    other = AdaptivePolicy(PLANS[:2], StepBuckets((1, 2, 4, 8), ()))
    with pytest.raises(ValueError, match="arms"):
        other.load_state_dict(policy.state_dict())


def test_a_drafterless_engine_adapts_over_suffix_match_plans_only(target):
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64))
    calibration = [Request(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=12))]
    policy = AdaptivePolicy.from_calibration(engine, PLANS, calibration, batch_edges=(1, 4))
    assert policy.plans == (SuffixMatch(6),)
    with pytest.raises(ValueError, match="drafter"):
        engine.generate(_requests(1), Strategy(2, 1, 3))
    assert engine.generate(_requests(1), policy).rollouts
