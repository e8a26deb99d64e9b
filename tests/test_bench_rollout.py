"""`tlt bench rollout`'s parts that decide what a ratio means: the trace workload's lengths,
the hindsight oracle, and bad input named (the whole benchmark runs on a checkpoint in
tests/test_bench_checkpoint.py)."""

import dataclasses
import json

import pytest
import torch

from tlt_core.adaptive.buckets import StepBuckets
from tlt_core.bench.length_trace import lognormal_lengths, load_lengths, tail_shape
from tlt_core.bench.rollout import hindsight_oracle, parse_workloads
from tlt_core.cli.main import main
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import RolloutResult, StepOutcome

PLAN = Strategy(2, 1, 3)


def test_lognormal_lengths_have_a_long_tail_and_stay_in_range():
    lengths = lognormal_lengths(4096, median=64, sigma=1.0, cap=1024, seed=3)
    shape = tail_shape(lengths)
    assert 60 <= shape["median"] <= 68
    assert shape["p99_over_median"] >= 8  # the bar for a long tail
    assert min(lengths) >= 1 and max(lengths) <= 1024
    assert lognormal_lengths(8, seed=1) == lognormal_lengths(8, seed=1)
    assert tail_shape([1, 2, 3, 100]) == {"median": 2, "p99": 100, "max": 100,
                                          "p99_over_median": 50.0}


def test_trace_files_are_read_and_bad_lengths_named(tmp_path):
    (tmp_path / "a.json").write_text("[3, 40, 7]")
    (tmp_path / "b.txt").write_text("3\n\n40\n")
    assert load_lengths(tmp_path / "a.json") == [3, 40, 7]
    assert load_lengths(tmp_path / "b.txt") == [3, 40]
    (tmp_path / "bad.json").write_text("[3, -2]")
    with pytest.raises(ValueError, match=r"bad.json\[1\]: a length must be >= 1 token, got -2"):
        load_lengths(tmp_path / "bad.json")
    (tmp_path / "bad.txt").write_text("3\nten\n")
    with pytest.raises(ValueError, match="bad.txt, line 2"):
        load_lengths(tmp_path / "bad.txt")
    with pytest.raises(FileNotFoundError, match="trace file"):
        load_lengths(tmp_path / "missing")


def test_rollout_and_train_share_the_trace_options(tmp_path):
    from tlt_core.bench.length_trace import TraceOptions
    from tlt_core.bench.rollout import RolloutOptions
    from tlt_core.bench.train import TrainOptions

    trace_fields = {f.name for f in dataclasses.fields(TraceOptions)}
    for options in (RolloutOptions, TrainOptions):
        assert issubclass(options, TraceOptions)
        for bad, name in ((dict(trace_median=0), "trace_median"), (dict(trace_sigma=-1.0),
                                                                   "trace_sigma")):
            with pytest.raises(ValueError, match=f"^{name}: must be"):
                options(workload="trace", **bad)
    assert trace_fields == {"trace_file", "trace_median", "trace_sigma"}
    lengths, source = TraceOptions(trace_median=5).trace_lengths(200, cap=30, seed=0)
    assert lengths == [min(n, 30) for n in lognormal_lengths(200, median=5, seed=0, cap=1024)]
    assert source == "lognormal (median 5, sigma 1.0), capped at 30"
    assert TraceOptions().trace_lengths(3, cap=99, seed=0, default_median=7)[0] == \
        lognormal_lengths(3, median=7, seed=0, cap=99)
    (tmp_path / "a.json").write_text("[3, 40, 7]")
    assert TraceOptions(trace_file=tmp_path / "a.json").trace_lengths(1, cap=10, seed=0) == \
        ([3, 10, 7], f"file {tmp_path / 'a.json'}, capped at 10")


def test_unknown_workloads_and_bad_trace_files_are_named_on_the_command_line(tmp_path, capsys):
    assert parse_workloads("trace, natural") == ("trace", "natural")
    with pytest.raises(ValueError, match="workload: unknown \\['long'\\]"):
        parse_workloads("trace,long")
    with pytest.raises(SystemExit, match="--workload: unknown"):
        main(["bench", "rollout", "--workload", "nope", "--no-progress"])
    bad = tmp_path / "lengths.json"
    bad.write_text("[5, -1]")
    with pytest.raises(SystemExit, match="--trace-file: .*got -1"):
        main(["bench", "rollout", "--trace-file", str(bad), "--no-progress"])
    with pytest.raises(SystemExit, match="--calibration-cache: .* is a file"):
        main(["bench", "rollout", "--calibration-cache", str(bad), "--no-progress"])


def _result(steps, total_s, tokens):
    """A RolloutResult of one row per generated token (its rollouts only carry lengths)."""
    from tlt_core.engine import Rollout, RequestTiming

    rollout = Rollout(0, 0, (1,), torch.zeros(tokens, dtype=torch.int64),
                      torch.zeros(tokens), "length", RequestTiming(0, 0, 0))
    return RolloutResult([rollout], total_s, len(steps), step_trace=tuple(steps))


def test_the_oracle_replays_sd_off_with_the_best_ratio_per_cell():
    buckets = StepBuckets((1, 2, 4), ())
    # SD off: 4 steps at batch 4 (1 s each, 4 tokens), 4 at batch 1 (1 s, 1 token); 2 s outside
    off = [StepOutcome(i, 4, 10, None, 4, 1.0) for i in range(4)] + \
        [StepOutcome(4 + i, 1, 10, None, 1, 1.0) for i in range(4)]
    # SD always: at batch 4 it loses (0.5x), at batch 1 it wins 2x (2 tokens a 1 s step)
    always = [StepOutcome(i, 4, 10, PLAN, 4, 2.0) for i in range(3)] + \
        [StepOutcome(3 + i, 1, 10, PLAN, 2, 1.0) for i in range(3)]
    runs = {"off": [_result(off, 10.0, 21)], "always": [_result(always, 11.0, 21)],
            "adaptive": [_result(off[:4], 6.0, 21)], "off_reseeded": [_result(off, 10.0, 21)]}
    oracle = hindsight_oracle(runs, buckets)
    # batch 4 stays at SD off's 4 s; batch 1's 4 s halve; 2 s outside steps: 21 / 8
    assert oracle["tok_s"] == [pytest.approx(21 / 8)]
    # 2 tokens a row-step at SD off's step cost: 2x
    assert oracle["cells"] == {"b<=1 ctx any": {"arm": PLAN.key, "ratio": 2.0, "steps": 3,
                                                "accept": 2.0, "step_cost": 1.0}}
    # an arm seen in fewer than 3 steps of a cell is not trusted there
    runs["always"] = [_result(always[:3] + always[3:5], 11.0, 21)]
    assert hindsight_oracle(runs, buckets)["tok_s"] == [pytest.approx(21 / 10)]


def test_the_rollout_json_round_trips_through_json(tmp_path):
    """Every value the benchmark writes is plain JSON (no tensors or plan objects)."""
    runs = {mode: [_result([StepOutcome(0, 1, 3, None if mode.startswith("off") else PLAN,
                                        2, 0.5, 0.1)], 1.0, 3)]
            for mode in ("off", "always", "adaptive", "off_reseeded")}
    from tlt_core.bench.rollout import _rows
    from tlt_core.bench.rollout_file import run_record

    record = run_record(runs["always"][0])
    assert record["step_trace"]["rows"] == [[0, 1, 3, PLAN.key, 2, 0.5, 0.1]]
    rows = _rows("m", "trace", runs, hindsight_oracle(runs, StepBuckets((1,), ())), PLAN)
    assert json.loads(json.dumps(rows)) == rows
    assert [r["mode"] for r in rows] == ["off", "always", "adaptive", "off_reseeded", "oracle"]


def test_each_round_starts_with_the_next_mode(monkeypatch):
    """Modes interleave round by round with the order rotating, so what running first (or
    right after SD) costs falls on every mode in turn."""
    import tlt_core.bench.rollout as rollout
    from tlt_core.adaptive.cost_model import CostModel
    from tlt_core.bench.rollout_file import RUN_MODES
    from tlt_core.engine import EngineConfig

    order: list[int] = []

    class RecordingEngine:
        made = 0

        def __init__(self, target, config, drafter):
            self.index, RecordingEngine.made = RecordingEngine.made, RecordingEngine.made + 1

        def generate(self, requests, strategy):
            order.append(self.index)
            return self.index

    monkeypatch.setattr(rollout, "RolloutEngine", RecordingEngine)
    results = rollout._run_modes(None, None, EngineConfig(max_batch=4, max_len=8), [],
                                 CostModel({}), (PLAN,), PLAN, rounds=3, progress=False,
                                 desc="")
    modes = len(RUN_MODES)
    assert [order[r * modes] for r in range(4)] == [0, 1, 2, 3]  # engines in RUN_MODES order
    assert all(sorted(order[r * modes:(r + 1) * modes]) == list(range(modes))
               for r in range(4))
    assert results == \
        {mode: [index] * 3 for index, mode in enumerate(RUN_MODES)}  # round 0 unmeasured


def test_forced_workloads_mask_the_stops_up_to_each_length():
    """trace and no_tail rows decode exactly their length with the model's stop ids masked
    (so the text stays a response); natural rows stop at them."""
    from tlt_core.bench.rollout import build_workloads

    workloads = build_workloads([(1, 2), (3,)], (7,), [], ("natural", "trace", "no_tail"),
                                samples=2, max_tokens=20, trace_lengths=[5, 30, 2, 9])
    trace = [r.params for r in workloads.requests["trace"]]
    assert [(p.max_tokens, p.min_tokens, p.stop_ids) for p in trace] == [
        (5, 5, (7,)), (20, 20, (7,)), (2, 2, (7,)), (9, 9, (7,))]
    median = workloads.trace_shape["median"]
    assert {(r.params.max_tokens, r.params.min_tokens, r.params.stop_ids)
            for r in workloads.requests["no_tail"]} == {(median, median, (7,))}
    assert {(r.params.min_tokens, r.params.stop_ids)
            for r in workloads.requests["natural"]} == {(0, (7,))}
