"""`tlt bench speculative / rollout / train --model DIR --drafter DIR`: the benchmarks on a
local checkpoint (here the tiny one of tests/cli_fixtures.py), end to end through the command
line, with every row naming the model it ran on."""

import json

import pytest

from tlt_core.bench.model_workload import EMBEDDED_LABEL, load_model_workload, model_label
from tlt_core.cli.main import main
from tlt_core.engine.records import SamplingParams
from tlt_core.model.placement import resolve_placement

from tests.cli_fixtures import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_checkpoint")
    model, drafter = tiny_checkpoint(root)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"t{i} t{i + 1} t{i + 2}",
                                        "answer": str(i)}) + "\n" for i in range(1, 20)))
    return model, drafter, data


def flags(checkpoint):
    model, drafter, data = checkpoint
    return ["--model", str(model), "--drafter", str(drafter), "--data", str(data),
            "--dtype", "float32", "--device", "cpu", "--no-progress"]


def test_model_workload_reads_prompts_and_labels_the_model(checkpoint):
    model, drafter, data = checkpoint
    workload = load_model_workload(model, resolve_placement("cpu", "float32"), drafter=drafter,
                                   data=data, prompts=5)
    assert len(workload.prompts) == 5 and workload.drafter is not None
    assert workload.label == model_label(model, workload.target.lm_head.weight.dtype)
    assert workload.label != EMBEDDED_LABEL and "float32" in workload.label
    requests = workload.requests(7, SamplingParams(max_tokens=4), first=3)
    assert [r.prompt_ids for r in requests][:2] == workload.prompts[3:5]
    assert requests[2].prompt_ids == workload.prompts[0]  # wraps around


def test_bench_speculative_on_a_checkpoint(checkpoint, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", *flags(checkpoint), "--batch", "1,2",
                 "--strategy", "3,1,4", "--strategy", "3,2,5", "--temperature", "0",
                 "--reps", "1", "--requests", "3", "--max-tokens", "8",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for row in rows:
        assert "float32" in row["model"] and row["model"] != EMBEDDED_LABEL
        assert row["greedy_equal"] == 1.0 and row["first_divergence"] is None
        assert set(row["acceptance_by_position"]) == {"0-256", "256-1k", "1k+"}
        assert row["draft_ms"] > 0 and row["verify_ms"] > 0 and row["plain_step_ms"] > 0


def test_bench_speculative_needs_a_drafter_for_a_checkpoint(checkpoint):
    model, _, _ = checkpoint
    with pytest.raises(SystemExit, match="--drafter"):
        main(["bench", "speculative", "--model", str(model), "--no-progress"])


def test_bench_rollout_on_a_checkpoint(checkpoint, tmp_path):
    from tlt_core.bench.length_trace import lognormal_lengths

    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", *flags(checkpoint), "--rounds", "1", "--always", "3,1,4",
                 "--max-tokens", "12", "--trace-median", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {(r["workload"], r["mode"]) for r in result["rows"]} == {
        (w, m) for w in ("natural", "trace", "no_tail")
        for m in ("off", "always", "adaptive", "off_reseeded", "oracle")}
    assert all(r["model"] == result["model"] != EMBEDDED_LABEL for r in result["rows"])
    drawn = lognormal_lengths(64, median=4, sigma=1.0, cap=12, seed=0)
    for workload, lengths in (("trace", drawn), ("no_tail", [4] * 64)):
        for mode, runs in result["workloads"][workload]["runs"].items():
            assert runs[0]["response_lengths"] == lengths, (workload, mode)  # forced lengths
    for detail in result["workloads"].values():
        for runs in detail["runs"].values():
            trace = runs[0]["step_trace"]
            emitted = trace["columns"].index("emitted")
            assert sum(row[emitted] for row in trace["rows"]) == runs[0]["tokens"] - 64
    oracle = {r["workload"]: r["speedup_vs_off"] for r in result["rows"] if r["mode"] == "oracle"}
    assert all(speedup >= 1.0 for speedup in oracle.values())  # plain is an arm
    assert result["workloads"]["trace"]["trace_shape"]["max"] == max(drawn)


def test_bench_train_on_a_checkpoint(checkpoint, tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *flags(checkpoint), "--steps", "1", "--prompts-per-step",
                 "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["run"] for r in result["rows"]} == {"tlt", "off", "off_seed2"}
    assert result["config"]["max_new_tokens"] == 6
    assert all(r["model"] == result["model"] != EMBEDDED_LABEL for r in result["rows"])
    assert result["summary"]["speedup"] > 0
