"""The rollout workers as torch.distributed ranks: who this process is, which requests are its
own, and what the ranks share.

One process per worker (`torchrun --nproc-per-node N`; gloo on CPU, NCCL on GPU; one process
and no launcher is a group of one). Requests come in groups of `group_size` consecutive
requests (GRPO's n samples of one prompt) and group g goes to rank g mod N, so siblings share a
rank (as in verl's contiguous split: their lengths are correlated, which is where the imbalance
between ranks comes from, and sibling drafts need them together). Request i keeps i as its id,
so seeds and records do not depend on N. A counter in the group's store says when every rank's
shard is done: until then a rank that finished is idle in the tail.

On GPUs each rank takes the device `LOCAL_RANK` names (set by torchrun) before the process group
starts, and collectives run on tensors on that device (NCCL reduces device memory only); on the
CPU (gloo) they stay on the CPU.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch
import torch.distributed as dist

from tlt_core.engine.records import Request, Rollout


class WorkerGroup:
    """This process's place among the rollout workers."""

    def __init__(self, device: torch.device | str | None = None):
        """device: where this rank computes (default: cuda:LOCAL_RANK when CUDA is available
        and the group is distributed, else the CPU); it picks NCCL (CUDA) or gloo."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if device is None:
            cuda = torch.cuda.is_available() and (world > 1 or dist.is_initialized())
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized() and world > 1:
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
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
        """The elementwise sum over ranks, on tensor's device (reduced on this rank's)."""
        if self.distributed:
            here = tensor.to(self.device)
            dist.all_reduce(here)
            return here.to(tensor.device)
        return tensor
