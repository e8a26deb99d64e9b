"""`tlt train` starts local ranks itself (tlt_core.cli.local_ranks): the embedded main job runs
as 2 gloo ranks by default, so that a rank that finished its share of a rollout spot-trains the
drafter while the other decodes the tail; rank 0 alone prints and writes, the others log their
warnings only, and a rank's failure is the command's exit code."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tlt_core.cli import main
from tlt_core.cli.local_ranks import run_local_ranks
from tlt_core.cli.logs import configure_logging


def exits_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        raise SystemExit(3)
    return 0


def prints_its_rank() -> int:
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}")
    return 0


def logs_on_each_rank() -> int:
    logger = logging.getLogger("tlt_core.test_local_ranks")
    logger.info("info from rank %s", os.environ["RANK"])
    logger.warning("warning from rank %s", os.environ["RANK"])
    return 0


def test_a_failing_rank_is_the_exit_code():
    assert run_local_ranks(2, exits_on_rank_one) == 3


def test_only_rank_zero_prints(capfd):
    assert run_local_ranks(2, prints_its_rank) == 0
    assert capfd.readouterr().out.splitlines() == ["rank 0 of 2"]


def test_ranks_log_at_the_commands_level_and_only_rank_zero_says_info(capfd):
    logger = logging.getLogger("tlt_core")
    handlers, level = list(logger.handlers), logger.level
    try:
        configure_logging("info")  # as `tlt` does before it starts the ranks
        assert run_local_ranks(2, logs_on_each_rank) == 0
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    assert sorted(capfd.readouterr().err.splitlines()) == [
        "info from rank 0", "rank 1: warning: warning from rank 1", "warning: warning from rank 0"]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the default is 1 rank on 1 core")
def test_the_embedded_main_job_spot_trains_the_drafter_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--steps", "3", "--prompts-per-step", "4", "--out", str(out),
                 "--no-progress", "--tensorboard", "off"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # written once, by rank 0
    # a refresh of the drafter from the spot training of a rank that finished first
    assert records[-1]["drafter/version"] >= 1
