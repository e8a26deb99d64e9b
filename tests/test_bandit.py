"""BEG-MAB plan bandit (csrc/bandit.cpp): convergence, epsilon, window, priors, state."""

import math
import random
import struct

import pytest

from tlt_core import _C
from tlt_core.adaptive.bandit import MAX_WINDOW, STATE_MAGIC, PlanBandit
from tlt_core.drafting.tree import Strategy

ARMS = (Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(6, 1, 7), Strategy(4, 2, 8))


def _play(bandit, means, steps, batch, rng, noise=0.3):
    picks = []
    for _ in range(steps):
        arm = bandit.select(batch)
        bandit.update(batch, arm, rng.gauss(means[arm], noise))
        picks.append(arm)
    return picks


def test_converges_to_the_best_arm_of_each_bucket():
    bandit = PlanBandit(ARMS, bucket_edges=(1, 4, 16), epsilon=0.1, window=32, seed=1)
    rng = random.Random(0)
    small = _play(bandit, [1.0, 2.0, 3.0, 1.5], 400, batch=1, rng=rng)
    large = _play(bandit, [3.0, 1.0, 1.0, 2.0], 400, batch=12, rng=rng)
    assert bandit.best(1) == ARMS[2] and bandit.best(12) == ARMS[0]
    # after convergence the best arm takes about 1 - epsilon + epsilon / arms of the steps
    assert small[200:].count(2) / 200 > 0.85 and large[200:].count(0) / 200 > 0.85


def test_epsilon_zero_never_explores_and_one_is_uniform():
    greedy = PlanBandit(ARMS, epsilon=0.0)
    for arm in range(len(ARMS)):
        greedy.update(3, arm, float(arm))  # every arm seen once; the last is best
    assert {greedy.select(3) for _ in range(200)} == {len(ARMS) - 1}
    assert greedy.explorations == 0
    uniform = PlanBandit(ARMS, epsilon=1.0, seed=5)
    counts = [0] * len(ARMS)
    for _ in range(4000):
        counts[uniform.select(3)] += 1
    expected = 4000 / len(ARMS)
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
    assert uniform.explorations == 4000


def test_explores_at_rate_epsilon():
    bandit = PlanBandit(ARMS, epsilon=0.2, seed=3)
    for _ in range(5000):
        bandit.select(2)
    assert bandit.explorations / 5000 == pytest.approx(0.2, abs=0.02)


def test_untried_arms_are_tried_before_exploiting():
    bandit = PlanBandit(ARMS, epsilon=0.0)
    seen = []
    for _ in range(len(ARMS)):
        arm = bandit.select(1)
        bandit.update(1, arm, 1.0)
        seen.append(arm)
    assert sorted(seen) == list(range(len(ARMS)))


def test_priors_count_as_prior_weight_observations_and_the_window_forgets():
    bandit = PlanBandit(ARMS[:2], bucket_edges=(8,), epsilon=0.0, window=4, prior_weight=2.0)
    bandit.seed_priors(lambda edge, arm: 10.0 if arm == ARMS[1] else 5.0)
    assert bandit.select(8) == 1  # the prior's optimum, before any reward
    assert bandit.estimate(8, 1) == 10.0
    bandit.update(8, 1, 4.0)
    assert bandit.estimate(8, 1) == pytest.approx((2 * 10.0 + 4.0) / 3)
    for reward in (1.0, 1.0, 1.0, 1.0, 1.0):  # the window holds the last 4 only
        bandit.update(8, 1, reward)
    assert bandit.observations(8, 1) == 4
    assert bandit.estimate(8, 1) == pytest.approx((2 * 10.0 + 4 * 1.0) / 6)
    assert bandit.select(8) == 0  # the arm went bad: the bandit moves off it


def test_a_drifting_reward_is_followed_within_a_window():
    bandit = PlanBandit(ARMS[:2], epsilon=0.1, window=16, prior_weight=0.0, seed=2)
    rng = random.Random(1)
    _play(bandit, [2.0, 1.0], 300, batch=1, rng=rng)
    assert bandit.best(1) == ARMS[0]
    picks = _play(bandit, [0.5, 1.0], 300, batch=1, rng=rng)
    assert bandit.best(1) == ARMS[1] and picks[-100:].count(1) > 85


def test_state_round_trips_and_continues_identically():
    rng = random.Random(4)
    bandit = PlanBandit(ARMS, epsilon=0.3, seed=9)
    bandit.seed_priors(lambda edge, arm: edge * arm.depth)
    _play(bandit, [1, 2, 3, 4], 50, batch=5, rng=rng)
    state = bandit.state_dict()
    twin = PlanBandit(ARMS, epsilon=0.3, seed=123)  # another seed: the state carries the stream
    twin.load_state_dict(state)
    rewards = [random.Random(7).random() for _ in range(100)]
    a, b = [], []
    for reward in rewards:
        for who, out in ((bandit, a), (twin, b)):
            arm = who.select(5)
            who.update(5, arm, reward)
            out.append(arm)
    assert a == b
    assert all(bandit.estimate(5, i) == twin.estimate(5, i) for i in range(len(ARMS)))


def test_bad_arguments_and_bad_state_are_named():
    with pytest.raises(ValueError, match="bucket_edges"):
        PlanBandit(ARMS, bucket_edges=(4, 2))
    with pytest.raises(ValueError, match="epsilon"):
        PlanBandit(ARMS, epsilon=1.5)
    with pytest.raises(ValueError, match="window"):
        PlanBandit(ARMS, window=0)
    with pytest.raises(ValueError, match="arms"):
        PlanBandit([])
    with pytest.raises(ValueError, match="arms"):
        PlanBandit([ARMS[0], ARMS[0]])
    bandit = PlanBandit(ARMS)
    with pytest.raises(ValueError, match="batch"):
        bandit.select(0)
    with pytest.raises(ValueError, match="arm"):
        bandit.update(1, len(ARMS), 1.0)
    with pytest.raises(ValueError, match="reward"):
        bandit.update(1, 0, math.nan)
    with pytest.raises(ValueError, match="state"):
        bandit.load_state_dict({"arms": [a.key for a in ARMS], "state": b"junk"})
    other = PlanBandit(ARMS, window=8)
    with pytest.raises(ValueError, match="window"):
        bandit.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="arms"):
        PlanBandit(ARMS[:2]).load_state_dict(bandit.state_dict())
    truncated = bandit.state_dict()
    truncated["state"] = truncated["state"][:-3]
    with pytest.raises(ValueError, match="truncated"):
        bandit.load_state_dict(truncated)


def test_bucket_edges():
    raw = _C.BucketBandit([1, 4, 16], 2, 0.0, 4, 0.0, 0)
    assert [raw.bucket(b) for b in (1, 2, 4, 5, 16, 17, 1000)] == [0, 1, 1, 2, 2, 2, 2]


def test_bad_input_gets_a_clear_error_window_is_bounded_and_integers_are_integers():
    with pytest.raises(ValueError, match="window"):
        PlanBandit(ARMS, window=10**9)
    PlanBandit(ARMS, window=MAX_WINDOW)
    for name, value in (("window", 2.5), ("window", True), ("seed", 1.0),
                        ("bucket_edges", (1, 2.0))):
        with pytest.raises(TypeError, match=name):
            PlanBandit(ARMS, **{name: value})
    with pytest.raises(TypeError, match="epsilon"):
        PlanBandit(ARMS, epsilon="0.1")
    bandit = PlanBandit(ARMS)
    with pytest.raises(TypeError, match="arm"):
        bandit.update(1, 1.0, 1.0)
    with pytest.raises(TypeError, match="batch"):
        bandit.update(True, 0, 1.0)


def _patched_state(bandit, offset, fmt, value):
    state = bandit.state_dict()
    data = bytearray(state["state"])
    struct.pack_into(fmt, data, offset, value)
    return {**state, "state": bytes(data)}


def test_bad_input_gets_a_clear_error_for_every_field_of_a_loaded_state():
    bandit = PlanBandit(ARMS, bucket_edges=(1, 8))
    _play(bandit, [1.0, 2.0, 3.0, 4.0], 20, 4, random.Random(0))
    before = bandit.state_dict()
    head = len(STATE_MAGIC) + 4 + 4 * 2 + 4 + 4  # magic, edges, num_arms, window
    cell = head + 8 + 8 + 8 + 8  # epsilon, prior_weight, stream, explorations
    for offset, fmt, value, field in (
            (head, "=d", 1.5, "epsilon"), (head, "=d", -0.1, "epsilon"),
            (head, "=d", math.nan, "epsilon"), (head + 8, "=d", math.inf, "prior_weight"),
            (head + 24, "=q", -1, "explorations"), (cell, "=B", 7, "has_prior"),
            (cell + 1, "=d", math.nan, "prior"), (cell + 17, "=d", math.inf, "rewards")):
        with pytest.raises(ValueError, match=field):
            bandit.load_state_dict(_patched_state(bandit, offset, fmt, value))
    assert bandit.state_dict() == before  # a refused state leaves the bandit as it was
    twin = PlanBandit(ARMS, bucket_edges=(1, 8))
    twin.load_state_dict(before)
    assert twin.state_dict() == before
