"""Response lengths for the `trace` workloads: each row decodes to exactly its drawn length, as
vLLM's serving benchmarks fix an output length, so a long tail is there by construction.

RL rollouts of reasoning models are long-tailed: most responses are short, a few are many times
longer (the TLT paper, Hu et al., ASPLOS 2026, motivates its system with such a distribution;
DAPO and the R1 report show response lengths growing into a long tail during training). We
draw from a lognormal: its `sigma` sets the tail, and sigma = 1.0 puts the 99th percentile
at 10.2x the median. The parameters are ours, chosen to have that shape, not fitted to anyone's
data; a file of measured lengths (`load_lengths`) replays a real distribution instead.

Lengths are whole tokens >= 1, capped at `cap` (the workload's max_tokens). `TraceOptions` holds
the trace flags `tlt bench rollout` and `tlt bench train` share.
"""

from __future__ import annotations

import json
import math
import numbers
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tlt_core.config_flags import option

DEFAULT_MEDIAN = 64
DEFAULT_SIGMA = 1.0  # p99 / median = exp(2.326 sigma) = 10.2
P99_Z = 2.3263  # the standard normal's 99th percentile


def lognormal_lengths(count: int, *, median: float = DEFAULT_MEDIAN,
                      sigma: float = DEFAULT_SIGMA, cap: int = 1024, seed: int = 0) -> list[int]:
    """`count` lengths from a lognormal of this median and sigma, each in [1, cap]."""
    if count < 1:
        raise ValueError(f"count: need at least one length, got {count}")
    if not median >= 1:
        raise ValueError(f"median: must be >= 1 token, got {median}")
    if not sigma >= 0:
        raise ValueError(f"sigma: must be >= 0, got {sigma}")
    if cap < 1:
        raise ValueError(f"cap: must be >= 1 token, got {cap}")
    draw = random.Random(seed)
    return [max(1, min(cap, round(median * math.exp(sigma * draw.gauss(0.0, 1.0)))))
            for _ in range(count)]


def check_lengths(lengths: Sequence[object], source: str = "lengths") -> list[int]:
    """lengths as ints >= 1; a ValueError naming the source and the first bad entry."""
    checked = []
    for index, value in enumerate(lengths):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{source}[{index}]: a length must be a whole number of tokens, "
                             f"got {value!r}")
        if value < 1:
            raise ValueError(f"{source}[{index}]: a length must be >= 1 token, got {value}")
        checked.append(int(value))
    if not checked:
        raise ValueError(f"{source}: holds no lengths")
    return checked


def load_lengths(path: str | Path) -> list[int]:
    """Lengths from a file: a JSON list of ints, or one int per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file: {path} does not exist")
    text = path.read_text()
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, list):
        values = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    values.append(int(line))
                except ValueError:
                    raise ValueError(f"trace file {path}, line {number}: not a whole number of "
                                     f"tokens: {line.strip()!r}") from None
    return check_lengths(values, f"trace file {path}")


def tail_shape(lengths: Sequence[int]) -> dict:
    """median, p99, max and p99 / median of lengths (nearest-rank percentiles)."""
    ordered = sorted(lengths)
    median = ordered[(len(ordered) - 1) // 2]
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"median": median, "p99": p99, "max": ordered[-1], "p99_over_median": p99 / median}


@dataclass(frozen=True)
class TraceOptions:
    """The trace workload's lengths: a lognormal's draws, or a file's lengths in order."""
    trace_file: Path | None = option("trace: the lengths, a JSON list or one int per line, "
                                     "taken in order (from the start again when the run needs "
                                     "more) instead of the lognormal", None, metavar="FILE")
    trace_median: int | None = option("trace: the lognormal's median length (default: 64; 32 "
                                      "on the embedded workload of `tlt bench rollout`)", None,
                                      metavar="N")
    trace_sigma: float = option("trace: the lognormal's sigma (1.0: p99 is 10.2x the median)",
                                DEFAULT_SIGMA)

    def __post_init__(self):
        if self.trace_median is not None and not self.trace_median >= 1:
            raise ValueError(f"trace_median: must be >= 1 token, got {self.trace_median}")
        if not self.trace_sigma >= 0:
            raise ValueError(f"trace_sigma: must be >= 0, got {self.trace_sigma}")

    def trace_lengths(self, count: int, *, cap: int, seed: int,
                      default_median: int = DEFAULT_MEDIAN) -> tuple[list[int], str]:
        """The lengths (the file's, else `count` lognormal draws), each capped at `cap`, and a
        sentence saying where they came from. A bad file raises FileNotFoundError /
        ValueError naming it."""
        if self.trace_file is not None:
            drawn, source = load_lengths(self.trace_file), f"file {self.trace_file}"
        else:
            median = self.trace_median or default_median
            drawn = lognormal_lengths(count, median=median, sigma=self.trace_sigma, cap=cap,
                                      seed=seed)
            source = f"lognormal (median {median}, sigma {self.trace_sigma})"
        return [min(n, cap) for n in drawn], f"{source}, capped at {cap}"
