"""Rollout workers as torch.distributed ranks, with idle-time drafter training and refresh.

One process per worker (`torchrun --nproc-per-node N`; gloo on CPU, NCCL on GPU; one process
and no launcher is a group of one). Each rank runs its own engine over its shard of the requests:
requests come in groups of `group_size` consecutive requests (GRPO's n samples of one prompt)
and group g goes to rank g mod N, so siblings share a rank (as in verl's contiguous split: their
lengths are correlated, which is where the imbalance between ranks comes from, and sibling
drafts need them together). Request i keeps i as its id, so seeds and records do not depend on
N. A rank whose shard is done is in the tail's idle time: while its idle detector agrees, its
spot trainer trains the drafter on what this rank harvested, until the last rank finishes
(a counter in the group's store, checked before every training step).

At the step boundary `refresh` combines the drafter replicas: the average of their weights,
each weighted by the steps it trained this round. Every replica started the round from the
same weights, so this is one round of local SGD / federated averaging; weighting by steps makes
a replica count by the work it did (an unlucky rank that never went idle, 0 steps, adds
nothing), and unlike "best on held-out data" it needs no held-out evaluation pass on the
critical path. Every engine then holds the same weights with a new version number; the engines
only read drafter weights inside generate(), so the switch is atomic between steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tlt_core.drafter import Drafter
from tlt_core.engine import Request, Rollout, RolloutEngine, StrategyPolicy
from tlt_core.idle import IdleDetector
from tlt_core.spot_trainer import SpotTrainer


class WorkerGroup:
    """This process's place among the rollout workers."""

    def __init__(self):
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._store = dist.distributed_c10d._get_default_store() if self.distributed else None
        self._done_local: dict[str, int] = {}

    def shard(self, requests: Sequence[Request], group_size: int = 1
              ) -> tuple[list[int], list[Request]]:
        """This rank's (ids, requests): the groups of `group_size` consecutive requests whose
        group index is this rank's modulo the world size."""
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: must be an int >= 1, got {group_size!r}")
        if len(requests) % group_size:
            raise ValueError(f"group_size: {len(requests)} requests are not whole groups of "
                             f"{group_size}")
        ids = [i for i in range(len(requests)) if (i // group_size) % self.world_size == self.rank]
        return ids, [requests[i] for i in ids]

    def mark_done(self, round_id: int) -> None:
        """This rank's shard is done; the last rank to say so stamps the time (wall clock,
        shared by the ranks of one machine) for measuring how fast idle ranks yield."""
        key = f"tlt/rollout_done/{round_id}"
        if self._store is None:
            self._done_local[key] = self._done_local.get(key, 0) + 1
        elif self._store.add(key, 1) == self.world_size:
            self._store.set(f"{key}/at", repr(time.time()))

    def all_done_at(self, round_id: int) -> float | None:
        """When the last rank finished (time.time()), or None in a group of one."""
        if self._store is None:
            return None
        return float(self._store.get(f"tlt/rollout_done/{round_id}/at").decode())

    def all_done(self, round_id: int) -> bool:
        key = f"tlt/rollout_done/{round_id}"
        if self._store is None:
            return self._done_local.get(key, 0) >= self.world_size
        return self._store.add(key, 0) >= self.world_size

    def gather(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Every rank's rollouts, on every rank, ordered by (request, sample)."""
        if not self.distributed:
            merged = list(rollouts)
        else:
            parts: list[list[Rollout]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(parts, rollouts)
            merged = [r for part in parts for r in part]
        return sorted(merged, key=lambda r: (r.request_index, r.sample_index))

    def mean(self, value: float | None) -> float | None:
        """The mean over ranks of a per-rank number (None where a rank has none), so every
        rank's watchdog judges a drafter version on the same acceptance."""
        pair = torch.tensor([0.0 if value is None else float(value),
                             0.0 if value is None else 1.0], dtype=torch.float64)
        total, count = self.all_reduce_sum(pair).tolist()
        return total / count if count else None

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor


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


def rollout_round(group: WorkerGroup, engine: RolloutEngine, requests: Sequence[Request],
                  round_id: int, strategy: StrategyPolicy = None,
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
            session = trainer.train(lambda: group.all_done(round_id), max_steps=1)
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
                                 tuple(result.trace_running.tolist()))


def refresh(group: WorkerGroup, drafter: Drafter, steps_trained: int) -> bool:
    """Replaces every replica's weights with the step-weighted average of all replicas; False
    (and nothing changed) when no rank trained."""
    weight = torch.tensor([float(steps_trained)])
    total = float(group.all_reduce_sum(weight.clone())[0])
    if total == 0:
        return False
    with torch.no_grad():
        for param in drafter.parameters():
            summed = group.all_reduce_sum(param.detach().float() * (steps_trained / total))
            param.copy_(summed.to(param.dtype))
    return True
