"""Timing engine steps without adding host syncs.

On the CPU a mark is the host clock and a step's phases are known at once. On a GPU the host
runs ahead of the device, so host wall time would time the launches, not the work: a mark is a
CUDA event, and the seconds between marks are read only once the last event has completed,
which `poll` checks without waiting (the next step's host read has waited for it by then) and
`flush` waits for at the end of a call. What the times are for (the adaptive loop's measurements, the
calibration's step costs) is handed over then, in step order.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: deque[tuple[tuple[Mark, ...], Callable[[list[float]], None]]] = deque()

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def when_timed(self, marks: tuple[Mark, ...], deliver: Callable[[list[float]], None]) -> None:
        """Calls deliver(seconds between consecutive marks) once they are known: now on the CPU,
        later on a GPU (poll, flush); deliveries keep the order of these calls."""
        self._pending.append((marks, deliver))
        if not self.cuda:
            self.poll()

    def poll(self) -> None:
        """Delivers every pending timing whose marks have completed (no waiting)."""
        while self._pending and self._completed(self._pending[0][0][-1]):
            marks, deliver = self._pending.popleft()
            deliver(self._seconds(marks))

    def flush(self) -> None:
        """Waits for the last pending mark, then delivers everything pending."""
        if self._pending and self.cuda:
            self._pending[-1][0][-1].synchronize()
        self.poll()

    def drop(self) -> None:
        """Forgets what is pending (a call that failed)."""
        self._pending.clear()

    def _completed(self, mark: Mark) -> bool:
        return not self.cuda or mark.query()

    def _seconds(self, marks: tuple[Mark, ...]) -> list[float]:
        if not self.cuda:
            return [end - start for start, end in zip(marks, marks[1:])]
        return [start.elapsed_time(end) / 1000.0 for start, end in zip(marks, marks[1:])]
