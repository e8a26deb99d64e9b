"""Invariant "nothing a user gave is lost", for `tlt train`'s run folder
(tlt_core.outputs.run_folder): a rerun never replaces an earlier run unasked, --resume never
starts afresh, two runs never share a folder, and a failed write stops the run with the path,
leaving the newest checkpoint and the metrics as they were."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

import tlt_core.persistence.checkpoint_io as checkpoint_io
from tests.cli_fixtures import tiny_checkpoint, word
from tlt_core.cli import main
from tlt_core.outputs.run_folder import resume_point
from tlt_core.persistence.checkpoint_io import latest_checkpoint, read_state
from tlt_core.persistence.folder_lock import LOCK_FILE, FolderLockedError, folder_lock

# The smallest `tlt train` that exercises every part of a run folder: a 32-token checkpoint,
# 2 prompts x 2 samples of at most 6 tokens per step (a fraction of a second a step, SD off).
TINY_RUN = ("--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
            "--minibatch-size", "4", "--max-batch", "4", "--no-progress", "--tensorboard", "off")


def tiny_train_inputs(root):
    """(model folder, prompt file) for TINY_RUN under root."""
    model, _ = tiny_checkpoint(root, with_drafter=False)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{word(i)} {word(i + 1)}", "answer": "7"})
                            + "\n" for i in range(1, 9)))
    return model, data


def tiny_train_argv(model, data, out, *flags, tlt=False):
    return ["train", "--model", str(model), "--data", str(data), "--out", str(out), *TINY_RUN,
            *(() if tlt else ("--no-tlt",)), *flags]


@pytest.fixture
def train(tmp_path):
    model, data = tiny_train_inputs(tmp_path)

    def run(out, *flags, tlt=False):
        return main(tiny_train_argv(model, data, out, *flags, tlt=tlt))

    return run


def snapshot(folder):
    """Every file under folder (the lock file aside) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def test_a_rerun_never_replaces_an_earlier_run_unasked(tmp_path, train):
    run = tmp_path / "run"
    assert train(run, "--steps", "2") == 0
    (run / "notes.txt").write_text("the user's own file")
    before = snapshot(run)
    with pytest.raises(SystemExit, match=rf"--out: {re.escape(str(run))} holds an earlier run "
                                         r"\(metrics.jsonl, checkpoints/, policy/, tokenizer/, "
                                         r"report.md, reward.png, step_time.png, "
                                         r"running_batch.png, response_lengths.png\); continue "
                                         r"it with --resume, replace it "
                                         r"with --overwrite"):
        train(run, "--steps", "2")
    assert snapshot(run) == before
    with pytest.raises(SystemExit, match="--resume and --overwrite: give one"):
        train(run, "--steps", "3", "--resume", "--overwrite")
    assert snapshot(run) == before

    assert train(run, "--steps", "1", "--overwrite") == 0  # the earlier run's parts go
    assert (run / "notes.txt").read_text() == "the user's own file"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (run / "policy").iterdir()] == ["step-000001"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000001"]


def test_resume_never_starts_afresh(tmp_path, train):
    empty = tmp_path / "typo"
    with pytest.raises(SystemExit, match=rf"--resume: {re.escape(str(empty))} has no checkpoint "
                                         r"to resume from .*without --resume"):
        train(empty, "--resume")
    run = tmp_path / "run"
    assert train(run, "--steps", "1") == 0
    for step in (run / "checkpoints").iterdir():  # a run whose checkpoints were deleted
        step.rename(tmp_path / step.name)
    before = snapshot(run)
    with pytest.raises(SystemExit, match=rf"--resume: {re.escape(str(run))} has no checkpoint .*"
                                         r"--overwrite \(which deletes metrics.jsonl"):
        train(run, "--steps", "2", "--resume")
    assert snapshot(run) == before
    # --compare's baseline folder, which the user never named, starts fresh while empty
    assert resume_point(run / "baseline", resume=True, overwrite=False, nested=True) is None
    with pytest.raises(ValueError, match="has no checkpoint"):
        resume_point(run, resume=True, overwrite=False, nested=True)


def test_compare_keeps_and_resumes_its_baseline(tmp_path, train, caplog):
    """--compare's baseline/ is part of the run in --out: a rerun is refused naming it,
    --overwrite clears it (its lock file stays), and --resume starts it afresh when no step of
    it had finished."""
    run = tmp_path / "run"
    assert train(run, "--steps", "2", "--compare", tlt=True) == 0
    assert len((run / "baseline" / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(SystemExit, match=r"holds an earlier run \(.*baseline/\)"):
        train(run, "--steps", "2", "--compare", tlt=True)
    for part in ("checkpoints", "policy"):  # interrupted before the baseline's first step
        shutil.rmtree(run / "baseline" / part)
    (run / "baseline" / "metrics.jsonl").unlink()
    caplog.clear()
    assert train(run, "--steps", "2", "--compare", "--resume", tlt=True) == 0
    assert "tlt: resumed at step 2" in caplog.text
    assert len((run / "baseline" / "metrics.jsonl").read_text().splitlines()) == 2
    assert train(run, "--steps", "1", "--overwrite") == 0  # SD off: no baseline of its own
    assert sorted(p.name for p in (run / "baseline").iterdir()) == [LOCK_FILE]


def test_two_runs_never_share_a_folder(tmp_path, train):
    run = tmp_path / "run"
    with folder_lock(run, wait=False):  # another run holds it (a flock per open file)
        with pytest.raises(SystemExit, match=rf"--out: {re.escape(str(run))} is in use by another "
                                             rf"tlt train run \(pid {os.getpid()}\)"):
            train(run, "--steps", "1")
    assert snapshot(run) == {}
    assert train(run, "--steps", "1") == 0  # released: the run goes ahead

    # A process that dies holding the lock (killed: no clean-up) leaves it free.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tlt_core.persistence.folder_lock import "
         "folder_lock\nwith folder_lock(sys.argv[1], wait=False):\n print('held', flush=True)\n"
         " time.sleep(600)", str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(FolderLockedError, match=f"pid {holder.pid}") as caught:
            with folder_lock(run, wait=False):
                pass
        assert caught.value.folder == run and caught.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(run, wait=False):
        pass


def test_a_waiting_holder_gets_the_folder_when_the_first_lets_go(tmp_path):
    order = []
    first_in = threading.Event()

    def first():
        with folder_lock(tmp_path, wait=True):
            first_in.set()
            time.sleep(0.3)
            order.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait()
    with folder_lock(tmp_path, wait=True, on_wait=order.append):  # told the holder's pid
        order.append("second in")
    thread.join()
    assert order == [os.getpid(), "first out", "second in"]


def test_a_failed_write_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, train,
                                                                    monkeypatch):
    """Disk full while writing step 2's checkpoint: the run stops with an error naming that
    folder; step 1's checkpoint and metrics are as they were; no temporary is left; --resume
    continues from step 1 once there is room."""
    run = tmp_path / "run"
    real_save, calls = checkpoint_io.save_file, []

    def full_at_the_second(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as handle:
                handle.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint_io, "save_file", full_at_the_second)
    step2 = re.escape(str(run / "checkpoints" / "step-000002"))
    with pytest.raises(SystemExit, match=rf"cannot write {step2}: No space left on device. .*"
                                         r"newest complete checkpoint is .*step-000001.*--resume"):
        train(run, "--steps", "3")
    monkeypatch.undo()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000001"]
    assert read_state(latest_checkpoint(run / "checkpoints"))["step"] == 1
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0]
    assert not [p for p in run.rglob("*") if ".tmp-" in p.name or p.suffix == ".partial"]
    assert train(run, "--steps", "3", "--resume") == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]


def test_nothing_loaded_runs_code_planted_pickles_are_refused(tmp_path, train):
    """A pickle with a live payload planted in a run folder (as checkpoint.pt, or as either file
    of its newest checkpoint) is refused by `tlt train --resume` and `tlt export drafter --run`
    with what was expected, and the payload never runs."""
    from tests.test_checkpoint_io import Payload
    from tests.test_export import _cli

    marker = tmp_path / "payload-ran"
    old = tmp_path / "old"
    old.mkdir()
    torch.save({"step": 1, "x": Payload(marker)}, old / "checkpoint.pt")
    with pytest.raises(SystemExit, match="--resume: .*checkpoint.pt was written by an older "
                                         "tlt_core.*start a new run"):
        train(old, "--resume")
    for run in (old, old / "checkpoint.pt"):
        with pytest.raises(SystemExit, match="--run: .*older tlt_core.*start a new run"):
            _cli(["drafter", "--to", "eagle", str(tmp_path / "export"), "--run", str(run)])
    run = tmp_path / "run"
    assert train(run, "--steps", "1") == 0
    newest = latest_checkpoint(run / "checkpoints")
    for name in ("state.json", "tensors.safetensors"):
        original = (newest / name).read_bytes()
        torch.save({"x": Payload(marker)}, newest / name)
        with pytest.raises(SystemExit, match=f"--resume: .*{name} is not .*not written by "
                                             "tlt_core"):
            train(run, "--steps", "2", "--resume")
        with pytest.raises(SystemExit, match=f"--run: .*{name} is not "):
            _cli(["drafter", "--to", "eagle", str(tmp_path / "export"), "--run", str(run)])
        (newest / name).write_bytes(original)
    assert not marker.exists()
