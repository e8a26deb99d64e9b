"""One rollout round on one rank: its shard rolled out, then drafter training in the tail's idle
time until the last rank is done, then every rank's rollouts gathered.

A rank whose shard is done is idle while the others decode: while its idle detector agrees, its
spot trainer trains the drafter on what this rank harvested, checking before every training
step whether the last rank has finished (the group's store), so it yields within one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from tlt_core.engine.engine import RolloutEngine
from tlt_core.engine.hooks import Speculation, StepOutcome
from tlt_core.engine.records import POSITION_BUCKET_LABELS, Request, Rollout
from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.idle import IdleDetector
from tlt_core.workers.spot_trainer import SpotTrainer


@dataclass(frozen=True)
class WorkerRound:
    """One rollout round on one rank."""

    rank: int
    rollout_s: float  # this rank's own shard
    makespan_s: float  # until every rank's shard was done (as this rank saw it)
    idle_s: float  # makespan - rollout: the tail this rank sat out
    spot_steps: int  # drafter training steps taken in that idle time
    spot_s: float
    acceptance_length: float | None
    tokens: int
    harvest_s: float  # critical-path cost of harvesting, inside rollout_s
    yield_lag_s: float  # from the last rank finishing to this rank leaving its training step
    sd_on_share: float = 0.0  # share of this rank's decode steps that were speculative
    trace_time_s: tuple[float, ...] = ()  # this rank's engine trace: end of each decode step
    trace_running: tuple[int, ...] = ()  # and the running rows during it
    trace_speculative: tuple[bool, ...] = ()  # and whether it was speculative
    # acceptance_length per context bucket (RolloutResult.acceptance_by_position)
    acceptance_by_position: dict[str, float | None] = field(
        default_factory=lambda: dict.fromkeys(POSITION_BUCKET_LABELS))
    # this rank's decode steps in order: batch, context, arm, tokens, seconds, catch-up
    step_trace: tuple[StepOutcome, ...] = ()


def rollout_round(group: WorkerGroup, engine: RolloutEngine, requests: Sequence[Request],
                  round_id: int, strategy: Speculation = None,
                  trainer: SpotTrainer | None = None, detector: IdleDetector | None = None,
                  poll_s: float = 0.002, group_size: int = 1
                  ) -> tuple[list[Rollout], WorkerRound]:
    """Rolls out this rank's shard (whole groups of `group_size` siblings), spot-trains while
    the other ranks finish, and returns every rank's rollouts (gathered) with this rank's
    timings."""
    ids, mine = group.shard(requests, group_size)
    start = time.perf_counter()
    result = engine.generate(mine, strategy, request_ids=ids)
    rollout_s = time.perf_counter() - start
    group.mark_done(round_id)
    spot_steps, spot_s = 0, 0.0
    while not group.all_done(round_id):
        idle = detector.poll(engine_has_work=False) if detector is not None else True
        if trainer is not None and idle:
            session = trainer.train_until(lambda: group.all_done(round_id), max_steps=1)
            spot_steps += session.steps
            spot_s += session.seconds
            if session.stopped == "no_data":
                time.sleep(poll_s)
        else:
            time.sleep(poll_s)
    makespan = time.perf_counter() - start
    finished_at = group.all_done_at(round_id)
    yield_lag = max(0.0, time.time() - finished_at) if finished_at is not None else 0.0
    if detector is not None:
        detector.poll(engine_has_work=True)  # the next round's work is arriving
    rollouts = group.gather(result.rollouts)
    return rollouts, WorkerRound(group.rank, rollout_s, makespan, makespan - rollout_s,
                                 spot_steps, spot_s, result.acceptance_length,
                                 sum(len(r.tokens) for r in result.rollouts), result.harvest_s,
                                 yield_lag, len(result.spec_steps) / max(result.decode_steps, 1),
                                 tuple(result.trace_time_s.tolist()),
                                 tuple(result.trace_running.tolist()),
                                 tuple(result.trace_speculative.tolist()),
                                 result.acceptance_by_position, result.step_trace)
