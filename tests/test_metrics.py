"""Metrics: the documented table is exactly what the RL driver emits, docs/metrics.md is the
table, metrics.jsonl is always written (fresh, resumed, rank 0 only) and only ever holds whole
records, TensorBoard scalars carry the same names when the tensorboard package is installed,
and `tlt train` writes both."""

import errno
import json
import math
import os
import re
from pathlib import Path

import pytest

from tests.speculative_fixtures import PROMPTS, tiny_target, train_drafter
from tlt_core.outputs.metrics import METRICS, RECORD_FIELDS, MetricsWriter, render_markdown
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.inputs import Prompt

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def step_records(tlt: bool) -> list[dict]:
    """Two steps of the RL driver on the tiny target (with its drafter when tlt)."""
    target = tiny_target(sharpen=2.0)
    drafter = train_drafter(target, steps=20) if tlt else None
    prompts = [Prompt(str(p), tuple(p), "7") for p in PROMPTS[:4]]
    config = TrainConfig(steps=2, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=6,
                         minibatch_size=4, max_batch=4, tlt=tlt)
    trainer = RLDriver(target, prompts, lambda p, r, ref: float(len(r) % 2), str, (), config,
                        drafter=drafter)
    return [trainer.step() for _ in range(2)]


@pytest.fixture(scope="module")
def records():
    return {"tlt": step_records(True), "baseline": step_records(False)}


def test_every_emitted_key_is_documented_and_every_documented_key_emitted(records):
    assert not set(METRICS) & set(RECORD_FIELDS)
    for run in records.values():
        for metrics in run:
            assert set(metrics) == set(METRICS) | set(RECORD_FIELDS), \
                set(metrics) ^ (set(METRICS) | set(RECORD_FIELDS))
            for name in METRICS:  # scalars, or null where the table says so
                value = metrics[name]
                assert value is None and "null" in METRICS[name][1] or \
                    isinstance(value, (int, float)) and not isinstance(value, bool) and \
                    math.isfinite(value), (name, value)
    assert records["tlt"][0]["drafter/version"] == 0  # (whether SD ran is the bandit's call)
    assert records["baseline"][0]["drafter/version"] is None


def test_docs_metrics_md_is_the_table():
    assert DOC.read_text() == render_markdown(), \
        "regenerate it with tlt_core.outputs.metrics.render_markdown() (see its module docstring)"
    for name in list(METRICS) + list(RECORD_FIELDS):
        assert f"| `{name}` |" in DOC.read_text()


def test_jsonl_fresh_resumed_and_rank_zero_only(tmp_path, records):
    run = records["tlt"]
    with MetricsWriter(tmp_path) as writer:
        for metrics in run:
            writer.write(metrics)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(run))
    MetricsWriter(tmp_path, history=run[:1]).close()  # resumed after step 0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    MetricsWriter(tmp_path / "other", enabled=False).write(run[0])  # not rank 0
    assert not (tmp_path / "other").exists()
    MetricsWriter(tmp_path).close()  # a fresh run starts empty
    assert not (tmp_path / "metrics.jsonl").exists()


def test_nothing_a_user_gave_is_lost_when_a_metrics_write_fails(tmp_path, records,
                                                                 monkeypatch):
    """Disk full mid-line (or at the fsync): the OSError names metrics.jsonl, the file keeps the
    earlier records and no torn line; a resumed run's rewrite that fails leaves it too."""
    run = records["tlt"]
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(tmp_path)
    writer.write(run[0])
    before = path.read_bytes()
    real_write, real_fsync = os.write, os.fsync

    def ours(descriptor):
        return os.readlink(f"/proc/self/fd/{descriptor}") == str(path)

    def half_then_full(descriptor, data):
        if not ours(descriptor):
            return real_write(descriptor, data)
        real_write(descriptor, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failing_fsync(descriptor):
        if ours(descriptor):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(descriptor)

    for name, failure in (("write", half_then_full), ("fsync", failing_fsync)):
        with monkeypatch.context() as patch:
            patch.setattr(os, name, failure)
            with pytest.raises(OSError, match=f"cannot write {re.escape(str(path))}"):
                writer.write(run[1])
        assert path.read_bytes() == before
    writer.write(run[1])
    assert [json.loads(line) for line in path.read_text().splitlines()] == \
        json.loads(json.dumps(run))
    before = path.read_bytes()
    def no_permission(*paths):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", no_permission)
        with pytest.raises(PermissionError, match=f"cannot write {re.escape(str(path))}"):
            MetricsWriter(tmp_path, history=run[:1])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_have_the_stable_names(tmp_path, records):
    pytest.importorskip("tensorboard")
    run = records["tlt"]
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        for metrics in run:
            writer.write(metrics)
    scalars = read_scalars(tmp_path)
    written = {name for name in METRICS if any(m[name] is not None for m in run)}
    assert set(scalars) == written
    for name in written:  # float32 values at the steps where the record has one
        assert scalars[name] == [(m["step"], pytest.approx(m[name], rel=1e-5, abs=1e-30))
                                 for m in run if m[name] is not None], name


def test_tlt_train_writes_jsonl_and_tensorboard(tmp_path, capsys):
    """`tlt train` on a tiny checkpoint: metrics.jsonl always, event files with --tensorboard
    on (skipped without the package), an error naming the package when it is missing."""
    from tests.cli_fixtures import tiny_checkpoint, word
    from tlt_core.cli import main
    from tlt_core.outputs.metrics import tensorboard_available

    model, _ = tiny_checkpoint(tmp_path, with_drafter=False)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{word(i)} {word(i + 1)}", "answer": "7"})
                            + "\n" for i in range(1, 9)))
    out = tmp_path / "run"
    argv = ["train", "--model", str(model), "--data", str(data), "--out", str(out), "--no-tlt",
            "--steps", "2", "--prompts-per-step", "2", "--samples-per-prompt", "2",
            "--max-new-tokens", "6", "--minibatch-size", "4", "--max-batch", "4",
            "--no-progress"]
    if not tensorboard_available():
        with pytest.raises(SystemExit, match="pip install tensorboard"):
            main(argv + ["--tensorboard", "on"])
        assert main(argv) == 0
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
        pytest.skip("tensorboard is not installed: metrics.jsonl checked only")
    assert main(argv + ["--tensorboard", "on"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert [step for step, _ in read_scalars(out)["train/reward"]] == [0, 1]
    assert main(argv + ["--tensorboard", "off", "--overwrite"]) == 0  # old event files go
    assert not list(out.glob("events.out.tfevents.*"))


def test_the_trace_says_which_steps_were_speculative_and_the_report_plots_it(tmp_path, records):
    from tlt_core.outputs.report import write_report

    for name, history in records.items():
        for m in history:
            assert len(m["trace_speculative"]) == len(m["trace_running"])
            on = [b for b, sd in zip(m["trace_running"], m["trace_speculative"]) if sd]
            assert m["spec/batch_max"] == (max(on) if on else None)
            assert m["spec/sd_step_share"] == pytest.approx(len(on) / len(m["trace_running"]))
            # the step trace is the same rollout, step by step
            trace = m["step_trace"]
            assert [row["batch"] for row in trace] == m["trace_running"]
            assert [row["arm"] != "plain" for row in trace] == m["trace_speculative"]
            # every sample's first token comes from its prefill, the rest from decode steps
            assert sum(row["emitted"] for row in trace) + len(m["response_lengths"]) == \
                sum(m["response_lengths"])
            if name == "baseline":
                assert not on
    # SD at the smallest batches, as the adaptive switch runs it (the tiny run's own choices
    # are timing-driven)
    switched = [{**m, "trace_speculative": [b <= min(m["trace_running"])
                                            for b in m["trace_running"]]}
                for m in records["tlt"]]
    report = write_report(tmp_path, {"tlt": switched, "baseline": records["baseline"]})
    assert (tmp_path / "sd_by_batch.png").is_file() and "sd_by_batch.png" in report.read_text()
    write_report(tmp_path / "off", {"baseline": records["baseline"]})
    assert not (tmp_path / "off" / "sd_by_batch.png").exists()
