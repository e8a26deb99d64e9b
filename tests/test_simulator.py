"""Trace harness (length families, files, forced-length replay), the scale simulator, and the
simulator checked against a `tlt bench rollout` file's runs."""

import json

import pytest

from tests.speculative_fixtures import PROMPTS, tiny_target
from tlt_core.adaptive.cost_model import SD_OFF, CostModel
from tlt_core.adaptive.policy import DEFAULT_PLANS, SAMPLED_PLANS
from tlt_core.bench.rollout_file import TRACE_COLUMNS, TraceStep, load_rollout, run_record
from tlt_core.bench.simulate_rollout import ReplayedArms, arm_by_batch, validate_rollout
from tlt_core.cli import main
from tlt_core.drafting.plan_keys import plan_from_key
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, RolloutEngine
from tlt_core.sim.simulator import (AcceptanceByContext, calibration_dict, load_calibration,
                                    save_calibration, simulate, step_seconds)
from tlt_core.sim.traces import load_lengths, replay_requests, sample_lengths, tail_stats


def test_length_families_are_deterministic_grouped_and_clipped():
    a = sample_lengths("lognormal", 64, seed=3, median=40, sigma=1.2, max_length=300)
    assert a == sample_lengths("lognormal", 64, seed=3, median=40, sigma=1.2, max_length=300)
    assert a != sample_lengths("lognormal", 64, seed=4, median=40, sigma=1.2, max_length=300)
    assert 1 <= min(a) and max(a) <= 300
    groups = [a[i:i + 8] for i in range(0, 64, 8)]  # siblings share a scale
    spread_within = max(max(g) / min(g) for g in groups)
    spread_between = max(max(g) for g in groups) / min(min(g) for g in groups)
    assert spread_within < spread_between
    assert tail_stats(sample_lengths("uniform", 64, low=32, high=64))["max_over_median"] < 2.1
    heavy = tail_stats(sample_lengths("pareto", 512, minimum=10, alpha=1.1, max_length=10**6))
    assert heavy["max_over_median"] > 10
    with pytest.raises(ValueError, match="family"):
        sample_lengths("gaussian", 8)
    with pytest.raises(ValueError, match="count"):
        sample_lengths("uniform", 10, group_size=8)


def test_user_length_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([5, 7, 9]))
    (tmp_path / "b.txt").write_text("5\n\n7\n")
    assert load_lengths(tmp_path / "a.json") == [5, 7, 9]
    assert load_lengths(tmp_path / "b.txt") == [5, 7]
    (tmp_path / "c.txt").write_text("5\nseven\n")
    with pytest.raises(ValueError, match="entry 2"):
        load_lengths(tmp_path / "c.txt")
    (tmp_path / "d.txt").write_text("0\n")
    with pytest.raises(ValueError, match=">= 1"):
        load_lengths(tmp_path / "d.txt")


def test_replay_forces_every_length():
    lengths = [3, 9, 5, 1, 12, 7]
    requests = replay_requests(lengths, PROMPTS[:2], group_size=3)
    assert [r.prompt_ids for r in requests] == [tuple(PROMPTS[0])] * 3 + [tuple(PROMPTS[1])] * 3
    engine = RolloutEngine(tiny_target(), EngineConfig(max_batch=4, max_len=32))
    out = engine.generate(requests).rollouts
    assert [len(r.tokens) for r in out] == lengths


def _flat_cost(plain=100.0, sd=250.0, acceptance=5.0):
    """Context-independent, calibrated at batches 1 and 2: a plain step lasts 1 / plain s, an
    SD step (4,1,5) acceptance / sd s, at either batch."""
    rates = {(b, "plain"): plain * b for b in (1, 2)}
    rates.update({(b, "(4,1,5)"): sd * b for b in (1, 2)})
    return CostModel(rates, acceptance={"(4,1,5)": acceptance})


def test_simulated_plain_makespan_by_hand():
    cost = _flat_cost()
    # one worker, lengths 4 and 2 (the prefill samples each row's first token): 1 step at
    # batch 2 (1/100 s), 2 at batch 1
    prediction = simulate([4, 2], cost, workers=1, group_size=1)
    assert prediction.makespan_s == pytest.approx(3 / 100) and prediction.steps == 3
    # two workers (group_size 1: request i on worker i mod 2): 3 and 1 steps of 1/100 s
    two = simulate([4, 2], cost, workers=2, group_size=1)
    assert two.busy_s == pytest.approx((0.03, 0.01))
    assert two.idle_worker_s == pytest.approx(0.02)
    # continuous batching: max_batch 1 runs them back to back
    assert simulate([4, 2], cost, max_batch=1, group_size=1).makespan_s == pytest.approx(0.04)
    # a response of one token is done at its prefill
    assert simulate([1], cost).steps == 0
    # admitting rows costs the calibrated seconds of that many fresh rows, once per admission:
    # one wave of 2 rows here; back to back, two waves of 1
    cost.admission_s.update({(1, "plain"): 0.005, (2, "plain"): 0.008})
    assert simulate([4, 2], cost, group_size=1).makespan_s == pytest.approx(0.038)
    assert simulate([4, 2], cost, max_batch=1, group_size=1).makespan_s == pytest.approx(0.05)
    assert simulate([1], cost).makespan_s == pytest.approx(0.005)


def test_sd_off_runs_cost_what_the_calibration_timed_without_a_drafter():
    cost = _flat_cost()
    # without an SD-off measurement, SD off costs what the adaptive loop's plain steps cost
    assert simulate([5, 3], cost, group_size=1).makespan_s == pytest.approx(0.04)
    assert cost.key(SD_OFF) == "plain"
    # measured: a plain step with no drafter to keep up to date is cheaper (here 2x)
    cost.rates.update({(b, "off"): 200.0 * b for b in (1, 2)})
    assert cost.key(SD_OFF) == "off"
    assert simulate([5, 3], cost, group_size=1).makespan_s == pytest.approx(0.02)
    # a policy's plain steps (None) still pay for keeping the drafter up to date
    policy = simulate([5, 3], cost, group_size=1, plan=lambda batch: None)
    assert policy.makespan_s == pytest.approx(0.04)


def test_simulated_sd_with_certain_acceptance():
    cost = _flat_cost(acceptance=5.0)  # depth 4 accepted in full: 5 tokens every step
    plan = Strategy(4, 1, 5)
    prediction = simulate([11, 11], cost, group_size=2, plan=lambda batch: plan)
    # 10 tokens after the prefill's: 2 steps; a step at batch 2 lasts 2 x 5 / (250 x 2) = 0.02 s
    assert prediction.steps == 2 and prediction.makespan_s == pytest.approx(0.04)
    # a workload that accepts less takes more steps of the same duration
    slower = simulate([11, 11], cost, group_size=2, plan=lambda batch: plan,
                      acceptance={"(4,1,5)": 1.0})
    assert slower.steps == 10 and slower.makespan_s == pytest.approx(0.2)


def test_calibration_files_round_trip(tmp_path):
    cost = _flat_cost()
    cost.context_slope[(1, "plain")] = 1e-4
    cost.context_mean[(1, "plain")] = 20.0
    cost.admission_s[(2, "plain")] = 0.01
    save_calibration(cost, tmp_path / "c.json", "cpu")
    back = load_calibration(tmp_path / "c.json")
    assert back.rates == cost.rates and back.acceptance == cost.acceptance
    assert back.admission_s == cost.admission_s and back.admission(3, None) == 0.01
    assert back.rate(1, None, context=30.0) == pytest.approx(cost.rate(1, None, context=30.0))
    assert back.rate(1, None, context=30.0) < back.rate(1, None, context=20.0)
    (tmp_path / "bad.json").write_text(json.dumps({"rates": {"x": 1}}))
    with pytest.raises(ValueError, match="calibration"):
        load_calibration(tmp_path / "bad.json")


def test_acceptance_per_row_context():
    cost = _flat_cost()
    plan = Strategy(4, 1, 5)
    # nothing accepted at contexts 8-9 (bucket 12: 2^3 up to 2^3.25), every draft from 10 on:
    # lengths 11 and 3 on 8-token prompts decode 10 and 2 tokens; 2 steps at batch 2 (1 token a
    # row), then the 8 left at 5 a step, 2 steps; each step lasts 0.02 s (_flat_cost)
    by_context = AcceptanceByContext({plan.key: {12: 1.0, 13: 5.0}})
    assert by_context.bucket(8) == by_context.bucket(9) == 12 and by_context.bucket(10) == 13
    prediction = simulate([11, 3], cost, group_size=2, plan=lambda batch: plan,
                          acceptance=by_context, prompt_lengths=8)
    assert prediction.steps == 4 and prediction.makespan_s == pytest.approx(4 * 0.02)
    # measured from steps (key, mean context, rows, tokens): pooled per bucket; a context with
    # no bucket of its own takes the nearest one
    measured = AcceptanceByContext.measured([("k", 8, 2, 2), ("k", 9, 2, 6), ("k", 100, 1, 5)])
    assert measured.at("k", 8.5) == 2.0 and measured.at("k", 90) == 5.0
    assert measured.at("k", 1) == 2.0 and measured.at("other", 8) is None


def test_shipped_plans_round_trip_through_their_keys():
    for plan in DEFAULT_PLANS + SAMPLED_PLANS + (SuffixMatch(3),):
        assert plan_from_key(plan.key) == plan
    with pytest.raises(ValueError, match=r"key: '\(6,1\)' is no shipped plan's key"):
        plan_from_key("(6,1)")


# ---- `tlt bench simulate --rollout`: the simulator against a rollout file's runs ----------------

SYNTHETIC_PLAN = Strategy(4, 1, 5)


def _synthetic_cost() -> CostModel:
    """Calibrated at batches 1, 2 and 4; a plain step's time grows with the rows' context, so a
    context off by a token shows."""
    rates = {}
    for batch in (1, 2, 4):
        rates[(batch, "off")] = 300.0 * batch ** 0.8
        rates[(batch, "plain")] = 250.0 * batch ** 0.8
        rates[(batch, SYNTHETIC_PLAN.key)] = 600.0 * batch ** 0.6
    cost = CostModel(rates, acceptance={SYNTHETIC_PLAN.key: 4.0},
                     admission_s={(4, "off"): 0.004, (4, "plain"): 0.005,
                                  (4, SYNTHETIC_PLAN.key): 0.006})
    for batch in (1, 2, 4):
        for key in ("off", "plain"):
            cost.context_slope[(batch, key)] = 2e-5
            cost.context_mean[(batch, key)] = 10.0
            cost.context_max[(batch, key)] = 100.0
    return cost


def _synthetic_run(cost: CostModel, lengths, prompts, choose) -> dict:
    """A run record whose every step lasts what the cost model prices it at and whose drafts
    are accepted in full (all rows admitted at once): what the simulator must reproduce
    exactly. choose(batch) -> SD_OFF, None (plain) or a plan."""
    rows = [[length - 1, prompt] for length, prompt in zip(lengths, prompts)]  # left, in cache
    total = cost.admission(len(rows), choose(len(rows)))
    rows = [row for row in rows if row[0] > 0]
    trace = []
    while rows:
        batch, plan = len(rows), choose(len(rows))
        context = sum(cached for _, cached in rows) / batch
        seconds = step_seconds(cost, batch, plan, context)
        each = 1 if plan is None or plan is SD_OFF else 1 + plan.depth
        trace.append([len(trace), batch, context, "plain" if plan is None or plan is SD_OFF
                      else plan.key, each * batch, seconds, 0.0])
        total += seconds
        rows = [[left - each, cached + each] for left, cached in rows if left > each]
    return {"total_s": total, "tokens": sum(lengths), "prompt_lengths": list(prompts),
            "response_lengths": list(lengths),
            "step_trace": {"columns": list(TRACE_COLUMNS), "rows": trace}}


def _synthetic_rollout(path) -> None:
    cost = _synthetic_cost()
    lengths, prompts = [12, 3, 30, 1, 7, 18], [5, 9, 6, 5, 7, 8]
    choose = {"off": lambda batch: SD_OFF, "off_reseeded": lambda batch: SD_OFF,
              "always": lambda batch: SYNTHETIC_PLAN,
              "adaptive": lambda batch: SYNTHETIC_PLAN if batch <= 2 else None}
    runs = {mode: [_synthetic_run(cost, lengths, prompts, pick)] for mode, pick in choose.items()}
    workload = {"max_batch": 8, "always": SYNTHETIC_PLAN.key,
                "calibration": calibration_dict(cost, "cpu"), "runs": runs}
    path.write_text(json.dumps({"model": "synthetic", "workloads": {"trace": workload}}))


def test_a_rollout_that_follows_the_cost_model_is_predicted_exactly(tmp_path):
    _synthetic_rollout(tmp_path / "rollout.json")
    result = validate_rollout(load_rollout(tmp_path / "rollout.json"), simulations=2)
    assert {r["mode"] for r in result["rows"]} == {"off", "always", "adaptive", "off_reseeded"}
    for row in result["rows"]:
        assert row["predicted_steps"] == row["measured_steps"], row["mode"]
        for part in ("error", "error_admission", "error_step_cost", "error_schedule"):
            assert abs(row[part]) < 1e-9, (row["mode"], part, row[part])
    assert result["max_abs_error"] < 1e-9 and result["noise_floor"]["trace"] < 1e-9
    # the adaptive run's plan comes from its trace: SD only at the batches that ran it
    adaptive = load_rollout(tmp_path / "rollout.json")["trace"].runs["adaptive"][0]
    assert arm_by_batch(adaptive.steps) == {5: "plain", 4: "plain", 3: "plain",
                                           2: SYNTHETIC_PLAN.key, 1: SYNTHETIC_PLAN.key}


def test_adaptive_plans_replay_the_runs_arms_per_batch_in_order():
    steps = tuple(TraceStep(batch, 20.0, arm, batch, 0.01, 0.0) for batch, arm in (
        (4, SYNTHETIC_PLAN.key), (4, "plain"), (4, "plain"), (2, SYNTHETIC_PLAN.key)))
    plan = ReplayedArms(steps)
    # at 4 rows: the run's arms there in order, then its last one; at 3 rows, where the run
    # never stepped, the most frequent at the nearest batch it did (4, nearer than 2 in log2)
    assert [plan(4) for _ in range(4)] == [SYNTHETIC_PLAN, None, None, None]
    assert plan(3) is None and plan(2) == SYNTHETIC_PLAN and plan(1) == SYNTHETIC_PLAN


def _edited(tmp_path, edit):
    _synthetic_rollout(tmp_path / "rollout.json")
    data = json.loads((tmp_path / "rollout.json").read_text())
    edit(data["workloads"]["trace"]["runs"])
    (tmp_path / "bad.json").write_text(json.dumps(data))
    return tmp_path / "bad.json"


def test_bad_rollout_files_are_refused_naming_the_file_and_run(tmp_path):
    save_calibration(_synthetic_cost(), tmp_path / "calibration.json", "cpu")
    with pytest.raises(ValueError, match=r"calibration.json is not a `tlt bench rollout"):
        load_rollout(tmp_path / "calibration.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot read .*text.json as JSON"):
        load_rollout(tmp_path / "text.json")

    def longer(runs):  # a response 2 tokens longer than the trace's steps committed
        runs["off"][0]["response_lengths"][2] += 2
        runs["off"][0]["tokens"] += 2
    with pytest.raises(ValueError, match=r"bad.json, run trace / off / round 0: its lengths and "
                                         r"its step trace disagree: the steps commit 65 tokens, "
                                         r"and the response lengths need exactly 67"):
        load_rollout(_edited(tmp_path, longer))

    def fewer_prompts(runs):
        runs["always"][0]["prompt_lengths"].pop()
    with pytest.raises(ValueError, match=r"trace / always / round 0: 5 prompt lengths for 6"):
        load_rollout(_edited(tmp_path, fewer_prompts))

    def overshoot(runs):  # more than a draft's depth past every row's end
        runs["always"][0]["step_trace"]["rows"][0][4] += 40
    with pytest.raises(ValueError, match=r"always / round 0: its lengths and its step trace "
                                         r"disagree.*between 65 and 89"):
        load_rollout(_edited(tmp_path, overshoot))

    def columns(runs):
        runs["adaptive"][0]["step_trace"]["columns"][0] = "index"
    with pytest.raises(ValueError, match=r"adaptive / round 0: not a run record.*columns"):
        load_rollout(_edited(tmp_path, columns))

    def another_arm(runs):
        runs["always"][0]["step_trace"]["rows"][0][3] = "(6,1,7)"
    with pytest.raises(ValueError, match=r"run trace / always / round 0 ran arms \['\(6,1,7\)'\] "
                                         r"besides the workload's SD-always plan \(4,1,5\)"):
        load_rollout(_edited(tmp_path, another_arm))
    with pytest.raises(SystemExit, match=r"tlt bench simulate: rollout: .*bad.json, run trace / "
                                         r"always"):
        main(["bench", "simulate", "--rollout", str(tmp_path / "bad.json")])


def test_a_real_engine_run_reads_back(tmp_path):
    """The file's writer (run_record) and reader agree on a real engine's runs, plain and
    speculative (whose drafts may run past a row's forced end)."""
    engine = RolloutEngine(tiny_target(), EngineConfig(max_batch=8, max_len=48))
    requests = replay_requests([9, 3, 17, 5, 12, 1, 7, 20], PROMPTS[:4], group_size=2)
    plan = SuffixMatch(3)
    runs = {"off": [run_record(engine.generate(requests))],
            "always": [run_record(engine.generate(requests, plan))]}
    cost = _synthetic_cost()
    workload = {"max_batch": 8, "always": plan.key, "calibration": calibration_dict(cost, "cpu"),
                "runs": runs}
    (tmp_path / "rollout.json").write_text(json.dumps({"workloads": {"trace": workload}}))
    read = load_rollout(tmp_path / "rollout.json")["trace"]
    for mode in ("off", "always"):
        run = read.runs[mode][0]
        assert run.response_lengths == (9, 3, 17, 5, 12, 1, 7, 20)
        assert run.prompt_lengths == tuple(len(PROMPTS[i // 2]) for i in range(8))
        assert 0 < run.steps_s <= run.total_s
        assert sum(s.emitted for s in run.steps) == sum(n - 1 for n in run.response_lengths)
    assert len(read.runs["off"][0].steps) == 19  # plain steps: the longest row's tokens but one
