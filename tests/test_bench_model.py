"""`tlt bench drafter` and `tlt bench simulate` on a local checkpoint (`--model DIR --drafter
DIR`), end to end on the tiny checkpoint of tests/cli_fixtures.py with the smallest settings:
every row and the summary name the model, and the checkpoint's evolving target moves."""

import json
import math

import pytest
import torch

from tests.cli_fixtures import tiny_checkpoint
from tlt_core.bench import drafter as bench_drafter
from tlt_core.bench.model_workload import model_label
from tlt_core.cli.main import main
from tlt_core.model.checkpoint import load_checkpoint

ARM_KEYS = {f"{arm}_{key}" for arm in ("frozen", "spot_off", "spot_on")
            for key in ("acceptance_length", "makespan_s", "spot_steps", "tokens")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bench_model"))


def model_flags(checkpoint) -> list[str]:
    model, drafter = checkpoint
    return ["--model", str(model), "--drafter", str(drafter), "--dtype", "bfloat16",
            "--device", "cpu"]


def test_bench_drafter_on_a_checkpoint_names_the_model_in_every_row(checkpoint, tmp_path):
    out = tmp_path / "drafter.json"
    assert main(["bench", "drafter", *model_flags(checkpoint), "--rounds", "2", "--requests",
                 "8", "--group-size", "2", "--steps-per-round", "2", "--max-tokens", "8",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    label = model_label(checkpoint[0], torch.bfloat16)
    assert result["summary"]["model"] == label
    assert {(r["model"], r["round"], r["rank"]) for r in result["rows"]} == \
        {(label, k, rank) for k in range(2) for rank in range(2)}
    assert all(ARM_KEYS <= row.keys() for row in result["rows"])
    # every rank rolls out its 2 groups of 2 samples, 8 tokens each (no stop ids here)
    assert all(row["frozen_tokens"] == 32 for row in result["rows"])
    assert {"spot_vs_frozen_acceptance", "spot_training_overhead",
            "spot_steps_total"} <= result["summary"].keys()


def test_bench_simulate_on_a_checkpoint_names_the_model_in_every_row(checkpoint, tmp_path):
    out = tmp_path / "simulate.json"
    assert main(["bench", "simulate", *model_flags(checkpoint), "--reps", "1", "--requests",
                 "8", "--group-size", "2", "--max-length", "16", "--calibration-tokens", "8",
                 "--workers", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    label = model_label(checkpoint[0], torch.bfloat16)
    assert result["model"] == label
    rows = result["rows"]
    assert {(r["model"], r["mode"]) for r in rows} == {(label, "off"), (label, "sd")}
    assert len(rows) == 2 * 5  # (off, sd) per tail shape
    for row in rows:
        assert {"shape", "measured_s", "predicted_s", "error", "measured_steps",
                "predicted_steps", "max_over_median"} <= row.keys()
        assert row["measured_s"] > 0 and math.isfinite(row["error"])
        assert (row["acceptance_length"] is None) == (row["mode"] == "off")
        # the simulator's acceptance: per row context, from both ranks' SD steps; (6,1,7)
        # emits 1 to 7 tokens a row step
        by_context = row["acceptance_by_context"]
        assert bool(by_context) == (row["mode"] == "sd")
        assert all(1.0 <= mean <= 7.0 for mean in by_context.values())
        assert row["measured_steps"] <= 16  # no trace's response is longer than --max-length
    assert result["calibration"]["device"] == "cpu"
    assert result["projection"]["workers"] == 4


def test_checkpoint_drift_moves_a_bf16_policy_toward_the_worked_solutions(checkpoint, tmp_path):
    """The evolving target of a bf16 checkpoint: each round's checkpoint is bf16, differs from
    the last, and fits the drift text (the answers, never the prompts) better."""
    folder = checkpoint[0]
    target = load_checkpoint(folder, dtype=torch.bfloat16)
    probe = next(bench_drafter.gsm8k_drift_batches(folder, batch_size=4))
    assert probe.loss_mask.any(dim=1).all() and not probe.loss_mask[:, 0].any()

    def drift_loss(model) -> float:
        with torch.no_grad():
            positions = torch.arange(probe.input_ids.shape[1])[None].expand_as(probe.input_ids)
            logits = model(probe.input_ids[:, :-1], positions[:, :-1]).logits
            targets = probe.loss_mask[:, 1:]
            return torch.nn.functional.cross_entropy(
                logits[targets], probe.input_ids[:, 1:][targets]).item()

    folders = bench_drafter.evolving_checkpoints(
        target, bench_drafter.gsm8k_drift_batches(folder, batch_size=4), tmp_path, rounds=3,
        steps_per_round=3, lr=1e-2, max_grad_norm=1.0)
    rounds = [target] + [load_checkpoint(f, dtype=torch.bfloat16) for f in folders]
    assert all(m.lm_head.weight.dtype == torch.bfloat16 for m in rounds)
    assert json.loads((folders[0] / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for before, after in zip(rounds, rounds[1:]):
        assert not torch.equal(before.lm_head.weight, after.lm_head.weight)
    losses = [drift_loss(m) for m in rounds]
    assert losses[2] < losses[1] < losses[0], losses


def test_bench_drafter_and_simulate_errors_name_the_flag(checkpoint):
    with pytest.raises(SystemExit, match=r"tlt bench drafter: --requests: 30 must be a "
                                         r"multiple of group-size x world = 16"):
        main(["bench", "drafter", "--requests", "30"])
    with pytest.raises(SystemExit, match="tlt bench simulate: --group-size: must be an int"):
        main(["bench", "simulate", "--group-size", "0"])
    with pytest.raises(SystemExit, match="tlt bench simulate: --model needs --drafter DIR"):
        main(["bench", "simulate", "--model", str(checkpoint[0])])
    with pytest.raises(SystemExit, match="tlt bench drafter: --model needs --drafter DIR"):
        main(["bench", "drafter", "--model", str(checkpoint[0])])
