"""The spot trainer: drafter training in small, preemptible steps on harvested data.

A worker that went idle in the rollout's tail calls `train_until(should_stop)`; the trainer checks
`should_stop` before every step, so it yields within one training step of work arriving or the
rollout ending. Steps are the unrolled loss of `tlt_core.drafting.training` (the offline
warm-up's objective, the same weights) on batches packed from the `HarvestBuffer`. Only the
drafter's own tensors are optimised or saved; the target's are never touched.

Determinism: the batch of global step s is fixed by the buffer's records, the seed and s alone
(epoch s // batches, position s % batches, the epoch's order drawn from Random(seed, epoch)), so
a run resumed from a checkpoint continues exactly as an uninterrupted run would (CPU, same
buffer).

Checkpoints are asynchronous: the tensors are copied at the call (the only cost on the caller),
a background thread writes them; `wait()` joins it, and raises what the write raised (an OSError
naming the path: disk full, no permission). A checkpoint is a folder of safetensors and JSON
written atomically (tlt_core.persistence.checkpoint_io.write_state): a reader, or a process
killed mid-write, sees the previous checkpoint or the new one, and a failed write leaves no
temporary behind. `resume` reads it back without running code (no pickle): anything else at
the path is refused, naming it.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.training import (REGRESSION_WEIGHT, REJECTION_WEIGHT, TOKEN_WEIGHT,
                                        DraftBatch, check_loss_weight, make_optimizer,
                                        train_step)
from tlt_core.drafting.unrolled import check_unroll
from tlt_core.persistence.checkpoint_io import read_state, write_state
from tlt_core.workers.harvest import HarvestBuffer


@dataclass(frozen=True)
class SpotConfig:
    lr: float = 1e-3
    batch_tokens: int = 4096  # padded positions per training batch
    seed: int = 0
    token_weight: float = TOKEN_WEIGHT  # weight of the EAGLE loss's cross-entropy term
    # drafting steps trained on the drafter's own outputs (OfflineConfig.unroll, whose default
    # this shares); a step, and so the wait before a preempted trainer yields, costs about
    # `unroll` teacher-forced ones
    unroll: int = 1
    # weight of the loss's sampled rejection term (OfflineConfig.rejection_weight, whose
    # default this shares: the spot trainer's objective is the warm-up's)
    rejection_weight: float = REJECTION_WEIGHT
    regression_weight: float = REGRESSION_WEIGHT  # OfflineConfig.regression_weight's, alike

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens: must be >= 1, got {self.batch_tokens}")
        check_unroll(self.unroll)
        check_loss_weight("rejection_weight", self.rejection_weight)
        check_loss_weight("regression_weight", self.regression_weight)


@dataclass(frozen=True)
class SpotSession:
    """What one train_until() call did."""

    steps: int  # training steps taken in this call
    seconds: float
    stopped: str  # "signal" (should_stop), "max_steps", or "no_data"
    last_loss: float | None
    last_top1: float | None


class SpotTrainer:
    def __init__(self, drafter: Drafter, buffer: HarvestBuffer, config: SpotConfig = SpotConfig()):
        self.drafter, self.buffer, self.config = drafter, buffer, config
        self.optimizer = make_optimizer(drafter, config.lr)
        self.steps = 0  # global steps trained, across calls and resumes
        self._packing: tuple[int, list[DraftBatch]] | None = None  # (buffer version, batches)
        self._order: tuple[int, list[int]] | None = None  # (epoch, batch order)
        self._writer: threading.Thread | None = None
        self._write_error: OSError | None = None  # what the last background write raised

    def train_until(self, should_stop: Callable[[], bool],
                    max_steps: int | None = None) -> SpotSession:
        """Trains until should_stop() is true (checked before each step) or max_steps steps."""
        start, taken, last = time.perf_counter(), 0, None
        stopped = "max_steps"
        while max_steps is None or taken < max_steps:
            if should_stop():
                stopped = "signal"
                break
            batch = self._batch(self.steps)
            if batch is None:
                stopped = "no_data"
                break
            last = train_step(self.drafter, self.optimizer, batch,
                              token_weight=self.config.token_weight, unroll=self.config.unroll,
                              rejection_weight=self.config.rejection_weight,
                              regression_weight=self.config.regression_weight)
            self.steps += 1
            taken += 1
        return SpotSession(taken, time.perf_counter() - start, stopped,
                           None if last is None else last["loss"],
                           None if last is None else last["top1"])

    def _batch(self, step: int) -> DraftBatch | None:
        if self.buffer.collect() == 0:
            return None
        if self._packing is None or self._packing[0] != self.buffer.version:  # new data
            self._packing = (self.buffer.version, self.buffer.batches(self.config.batch_tokens))
            self._order = None
        packed = self._packing[1]
        epoch, index = divmod(step, len(packed))
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(packed)))
            random.Random(f"{self.config.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return packed[self._order[1][index]]

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The trainable tensors, the optimizer state and the step count (copied)."""
        return {"drafter": {k: v.detach().clone() for k, v in self.drafter.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def checkpoint(self, path: str | Path) -> None:
        """Saves to the folder `path` asynchronously: copies now, writes on a background thread
        (one at a time)."""
        self.wait()
        state, path = self.state_dict(), Path(path)

        def write():
            try:
                write_state(state, path)
            except OSError as error:  # write_state's names the path
                self._write_error = OSError(error.errno,
                                            f"spot trainer: {error.strerror or error}")

        self._writer = threading.Thread(target=write, name="spot-checkpoint", daemon=True)
        self._writer.start()

    def wait(self) -> None:
        """Joins the checkpoint write in flight; raises what it raised."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    def resume(self, path: str | Path) -> None:
        """Loads the checkpoint folder `checkpoint` wrote at `path`."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"path: no spot-trainer checkpoint at {path}")
        try:
            state = read_state(path)
            missing = sorted({"drafter", "optimizer", "steps"} - state.keys())
            if missing:
                raise ValueError(f"it lacks {', '.join(missing)}")
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(f"path: {path} is not a spot-trainer checkpoint ({error}); give a "
                             "folder that SpotTrainer.checkpoint wrote") from None
        self.load_state_dict(state)
