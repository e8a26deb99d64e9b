"""The cells the adaptive loop learns in: running-batch bucket x context-length bucket.

A step's cost depends on how many rows run (the target pass grows with them, and SD verifies N
tokens per row) and on how long their contexts are (attention reads them all; acceptance falls
as context grows). The loop keeps one table of arm rates per cell.

Batch buckets: `batch_edges` are upper bounds, ascending; bucket i holds the batches in
(batch_edges[i - 1], batch_edges[i]], the first from 1. They must cover 1..max_batch: a batch
in no bucket would have no estimate. Context buckets: `context_edges` are upper bounds
(exclusive), ascending; bucket j holds mean contexts in [context_edges[j - 1], context_edges[j]),
and one last bucket holds everything longer.
"""

from __future__ import annotations

import numbers
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Sequence

DEFAULT_BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_CONTEXT_EDGES = (1024, 4096, 16384)


def _edges(name: str, edges: Sequence[int], minimum: int) -> tuple[int, ...]:
    values = tuple(edges)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: edges must be ints, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name}: edges must be >= {minimum}, got {value}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: edges must be strictly increasing, got {list(values)}")
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class StepBuckets:
    batch_edges: tuple[int, ...] = DEFAULT_BATCH_EDGES
    context_edges: tuple[int, ...] = DEFAULT_CONTEXT_EDGES

    def __post_init__(self):
        object.__setattr__(self, "batch_edges", _edges("batch_edges", self.batch_edges, 1))
        object.__setattr__(self, "context_edges",
                           _edges("context_edges", self.context_edges, 1))
        if not self.batch_edges:
            raise ValueError("batch_edges: need at least one bucket")

    @classmethod
    def covering(cls, max_batch: int, batch_edges: Sequence[int] = DEFAULT_BATCH_EDGES,
                 context_edges: Sequence[int] = DEFAULT_CONTEXT_EDGES) -> StepBuckets:
        """The buckets of an engine of max_batch rows: batch_edges up to the first that holds
        max_batch (which must exist)."""
        buckets = cls(tuple(batch_edges), tuple(context_edges))
        if buckets.batch_edges[-1] < max_batch:
            raise ValueError(
                f"batch_edges: the last edge {buckets.batch_edges[-1]} is below max_batch "
                f"{max_batch}, so batches {buckets.batch_edges[-1] + 1}..{max_batch} fall in "
                f"no bucket; add an edge >= {max_batch}")
        last = bisect_left(buckets.batch_edges, max_batch)
        return cls(buckets.batch_edges[:last + 1], buckets.context_edges)

    @property
    def cells(self) -> int:
        return len(self.batch_edges) * (len(self.context_edges) + 1)

    def batch_bucket(self, batch: int) -> int:
        if batch < 1:
            raise ValueError(f"batch: must be >= 1, got {batch}")
        index = bisect_left(self.batch_edges, batch)
        if index == len(self.batch_edges):
            raise ValueError(f"batch: {batch} is past the last bucket edge "
                             f"{self.batch_edges[-1]}")
        return index

    def context_bucket(self, context: int) -> int:
        return bisect_right(self.context_edges, context)

    def cell(self, batch: int, context: int) -> int:
        return self.batch_bucket(batch) * (len(self.context_edges) + 1) + \
            self.context_bucket(context)

    def label(self, cell: int) -> str:
        """"b<=16 ctx<1024"-style name of a cell (for traces and reports)."""
        row, column = divmod(cell, len(self.context_edges) + 1)
        context = (f"ctx<{self.context_edges[column]}" if column < len(self.context_edges)
                   else f"ctx>={self.context_edges[-1]}" if self.context_edges else "ctx any")
        return f"b<={self.batch_edges[row]} {context}"
