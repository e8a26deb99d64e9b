"""Long-tail traces: response-length distributions to replay through the engine.

A trace is a list of response lengths, one per request (in GRPO groups of `group_size`
consecutive requests sharing a prompt and a length scale). `replay_requests` turns it into
requests whose lengths are forced, the way serving benchmarks force output lengths: the stop
ids are ignored and max_tokens is the trace's length, so every rollout mode decodes exactly the
same number of tokens per request and modes compare on the tail's shape alone.

Families (`sample_lengths`):
- `lognormal(median, sigma)`: the shape of reasoning-RL response lengths (a heavy right tail;
  p99 / median = exp(2.326 sigma)); a group's samples share a per-prompt scale drawn from the
  family and vary around it by `within_group_sigma`, as a hard prompt's samples are all long;
- `pareto(minimum, alpha)`: a power-law tail;
- `uniform(low, high)`: no tail to speak of;
- `embedded`: the embedded task's own distribution (lognormal, median 35 tokens, sigma 1.0,
  see tlt_core/embedded/task.py);
or a user's file of lengths (`load_lengths`: one integer per line, or a JSON list).
Lengths are clipped to [1, max_length]. Deterministic for a seed.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Sequence

from tlt_core.engine.records import Request, SamplingParams

FAMILIES = ("lognormal", "pareto", "uniform", "embedded")


def sample_lengths(family: str, count: int, *, seed: int = 0, group_size: int = 8,
                   max_length: int = 512, median: float = 35.0, sigma: float = 1.0,
                   minimum: float = 16.0, alpha: float = 1.5, low: int = 32, high: int = 64,
                   within_group_sigma: float = 0.15) -> list[int]:
    if family not in FAMILIES:
        raise ValueError(f"family: must be one of {FAMILIES}, got {family!r}")
    if count < 1 or group_size < 1 or count % group_size:
        raise ValueError(f"count: {count} must be a positive multiple of group_size {group_size}")
    if family == "embedded":
        family, median, sigma = "lognormal", 35.0, 1.0
    rng = random.Random(f"{family}/{seed}")
    lengths = []
    for _ in range(count // group_size):
        if family == "lognormal":
            scale = median * math.exp(sigma * rng.gauss(0, 1))
        elif family == "pareto":
            scale = minimum * rng.paretovariate(alpha)
        else:
            scale = rng.uniform(low, high)
        for _ in range(group_size):
            jitter = math.exp(within_group_sigma * rng.gauss(0, 1)) if family != "uniform" else 1.0
            lengths.append(int(min(max(round(scale * jitter), 1), max_length)))
    return lengths


def load_lengths(path: str | Path) -> list[int]:
    """A user's trace: a JSON list of lengths, or one integer per line."""
    text = Path(path).read_text()
    try:
        values = json.loads(text)
        if not isinstance(values, list):
            raise ValueError
    except ValueError:
        values = [line.strip() for line in text.splitlines() if line.strip()]
    lengths = []
    for number, value in enumerate(values, start=1):
        try:
            length = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"lengths: entry {number} of {path} is not an integer: {value!r}") from None
        if length < 1:
            raise ValueError(f"lengths: entry {number} of {path} is {length}; lengths are >= 1")
        lengths.append(length)
    if not lengths:
        raise ValueError(f"lengths: {path} holds no lengths")
    return lengths


def replay_requests(lengths: Sequence[int], prompts: Sequence[Sequence[int]], *,
                    group_size: int = 8, temperature: float = 1.0) -> list[Request]:
    """One request per length, forced to exactly that many tokens; group g uses prompt
    g mod len(prompts) (its samples share the prompt, as GRPO's do)."""
    if not prompts:
        raise ValueError("prompts: need at least one prompt")
    return [Request(prompts[(i // group_size) % len(prompts)],
                    SamplingParams(temperature=temperature, max_tokens=int(length), stop_ids=()))
            for i, length in enumerate(lengths)]


def tail_stats(lengths: Sequence[int]) -> dict:
    ordered = sorted(lengths)
    median = ordered[len(ordered) // 2]
    return {"count": len(ordered), "median": median, "max": ordered[-1],
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_over_median": ordered[-1] / median}
