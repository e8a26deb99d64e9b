"""What goes into the engine and what comes out: requests with their sampling parameters, and the
rollout records of one generate call (samples, step statistics, the running-batch trace).

Shapes: T_gen generated tokens of one sample, including its stop token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; top_k <= 0 and top_p = 1 are off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None  # None: derived from the engine's seed and the request's index
    n: int = 1  # samples per prompt (a GRPO group)

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if not isinstance(self.stop_ids, tuple):
            object.__setattr__(self, "stop_ids", tuple(self.stop_ids))


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError("prompt_ids: a request needs at least one prompt token")


@dataclass(frozen=True)
class RequestTiming:
    admitted_s: float  # seconds since generate() started
    first_token_s: float
    finished_s: float


@dataclass(frozen=True)
class Rollout:
    """One generated sample."""

    request_index: int
    sample_index: int  # 0..n-1 within its request's group
    prompt_ids: tuple[int, ...]
    tokens: torch.Tensor  # (T_gen,) int64, stop token included
    logprobs: torch.Tensor  # (T_gen,) float32, target log p of each token as sampled
    finish_reason: str  # "stop" (a stop id) or "length" (max_tokens)
    timing: RequestTiming


@dataclass(frozen=True)
class SpecStepStats:
    """One speculative step over the running batch."""

    step: int  # index among the generate call's steps
    batch: int  # running rows
    plan_key: str  # the step's DraftPlan.key, e.g. "(6,1,7)" or "suffix(8)"
    drafted: int  # draft nodes verified, summed over rows
    accepted: int  # draft tokens accepted, summed over rows
    emitted: int  # tokens emitted: accepted + one per row
    draft_s: float  # growing the draft trees
    verify_s: float  # the target's tree pass and the verification kernel
    accept_s: float  # compacting the caches, the drafter's catch-up, committing tokens


@dataclass(frozen=True)
class RolloutResult:
    rollouts: list[Rollout]  # ordered by (request_index, sample_index)
    trace_time_s: torch.Tensor  # (steps,) float64, end of each decode step
    trace_running: torch.Tensor  # (steps,) int64, running rows during that step
    total_s: float
    decode_steps: int  # plain and speculative steps
    spec_steps: tuple[SpecStepStats, ...] = ()
    harvest_s: float = 0.0  # time spent handing positions to the harvest sink

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens a row emits per speculative step (accepted drafts + 1); None if no step
        was speculative."""
        rows = sum(s.batch for s in self.spec_steps)
        return sum(s.emitted for s in self.spec_steps) / rows if rows else None


def seconds_at_or_below(trace_time_s: Sequence[float], trace_running: Sequence[int],
                        limit: float) -> float:
    """Time a rollout spent in steps whose running batch was at most limit (its tail), from a
    RolloutResult's trace: end time of each decode step, and the rows running during it."""
    starts = [0.0] + list(trace_time_s[:-1])
    return sum(end - start for start, end, batch in zip(starts, trace_time_s, trace_running)
               if batch <= limit)
