"""Invariant "nothing a user gave is lost", under SIGKILL: a `tlt train` process killed at
random points (in set-up, in a step, in the middle of a checkpoint write) and resumed each time
ends exactly as an uninterrupted run: each attempt continues from the newest complete
checkpoint, metrics.jsonl never runs ahead of it nor holds a torn line, every step is recorded
once with the uninterrupted run's values (SD off: a resumed run repeats an uninterrupted one
exactly), and only complete checkpoints and no temporaries remain. The lock of a killed run is
the kernel's to release: each next attempt gets the folder at once."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from tests.test_run_folder import tiny_train_argv, tiny_train_inputs
from tlt_core.persistence.checkpoint_io import TEMPORARY_MARK, latest_checkpoint, step_folders

STEPS = 12
DEADLINE_S = 90  # per attempt: a hung run fails the test instead of hanging it


def metrics_steps(run) -> list[int]:
    """The steps metrics.jsonl records, in order; every line must be a whole JSON record."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def step_of(checkpoint) -> int:
    return int(checkpoint.name.removeprefix("step-"))


def newest_step(run) -> int:
    latest = latest_checkpoint(run / "checkpoints")
    return 0 if latest is None else step_of(latest)


def kill_when(process, condition) -> bool:
    """SIGKILLs `process` as soon as condition() holds; False when it exited first."""
    end = time.monotonic() + DEADLINE_S
    while process.poll() is None:
        if condition():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        if time.monotonic() > end:
            process.kill()
            pytest.fail(f"tlt train ran past {DEADLINE_S} s")
        time.sleep(0.001)
    return False


@pytest.mark.slow
def test_nothing_a_user_gave_is_lost_when_a_run_is_killed_and_resumed(tmp_path):
    model, data = tiny_train_inputs(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # what a killed attempt printed is kept

    def start(out, *flags):
        argv = tiny_train_argv(model, data, out, "--steps", str(STEPS), *flags)
        return subprocess.Popen([sys.executable, "-m", "tlt_core.cli", *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    whole = tmp_path / "whole"
    uninterrupted = start(whole)
    assert uninterrupted.wait(timeout=DEADLINE_S) == 0, uninterrupted.stdout.read()

    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    rng = random.Random(0)  # the same kill points on every run of the test

    def in_setup(process):
        began, delay = time.monotonic(), rng.uniform(0.2, 1.5)  # set-up takes seconds
        return lambda: time.monotonic() > began + delay

    def in_a_checkpoint_write(process):
        mine = f"{TEMPORARY_MARK}{process.pid}-"  # this process's temporary step folder
        first = newest_step(run)

        def condition():
            if newest_step(run) <= first:  # a good checkpoint of this attempt first
                return False
            names = os.listdir(checkpoints) if checkpoints.is_dir() else []
            return any(mine in name for name in names)
        return condition

    def at_random(process):
        first, delay, progressed = newest_step(run), rng.uniform(0.0, 0.6), []

        def condition():
            if not progressed and newest_step(run) > first:
                progressed.append(time.monotonic())
            return bool(progressed) and time.monotonic() > progressed[0] + delay
        return condition

    kills = 0
    for point in (in_setup, in_a_checkpoint_write, at_random, at_random, None):
        saved = latest_checkpoint(checkpoints)
        flags = ("--resume",) if saved is not None else ("--overwrite",) if run.exists() else ()
        process = start(run, *flags)
        if point is None:
            assert process.wait(timeout=DEADLINE_S) == 0, process.stdout.read()
        else:
            kills += kill_when(process, point(process))
        printed = process.stdout.read()
        if saved is not None and point is not in_setup:  # it got past set-up
            assert f"resumed at step {step_of(saved)} from {saved}" in printed, printed
        recorded = metrics_steps(run)
        assert recorded == list(range(len(recorded)))
        assert newest_step(run) - 1 <= len(recorded) <= newest_step(run)
    assert kills >= 3  # the run did not outpace the kill points

    ours = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "train/reward", "train/loss", "train/grad_norm", "response_lengths")
    assert [[m[k] for k in keys] for m in ours] == [[m[k] for k in keys] for m in theirs]
    assert list(step_folders(checkpoints)) == [STEPS - 1, STEPS]
    assert not [p for p in run.rglob("*") if TEMPORARY_MARK in p.name]
    final = f"policy/step-{STEPS:06d}/model.safetensors"
    ours, theirs = load_file(str(run / final)), load_file(str(whole / final))
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
