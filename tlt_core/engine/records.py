"""What goes into the engine and what comes out: requests with their sampling parameters, and the
rollout records of one generate call (samples, step statistics, the running-batch trace, the
per-step trace of batch, context, plan, tokens and seconds).

Shapes: T_gen generated tokens of one sample, including its stop token.

Context position: a row's tokens in the target's cache when a speculative step begins, prompt +
tokens generated so far - 1 (the last generated token is the step's root, which the step itself
feeds); equivalently the root's position. Acceptance falls as context grows (published EAGLE-3
drafters drop from about 2.3 to 1.09 tokens per verification between 2k and 16-20k tokens), so
every speculative step also counts its rows and tokens per context bucket.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from typing import Sequence

import torch

import tlt_core.ops as ops
from tlt_core.engine.hooks import StepOutcome

# Bucket i holds contexts c with EDGES[i - 1] <= c < EDGES[i]; the first has no lower edge,
# the last no upper one.
POSITION_BUCKET_EDGES: tuple[int, ...] = (256, 1024)
POSITION_BUCKET_LABELS: tuple[str, ...] = ("0-256", "256-1k", "1k+")
# The stop ids min_tokens masks per row are held in a fixed-width tensor (a captured graph's
# input); models end a turn with one to a few ids.
MAX_MASKED_STOP_IDS = 8


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; top_k <= 0 and top_p = 1 are off.
    min_tokens (vLLM's): the stop ids have probability 0 until the sample holds that many
    tokens, in plain and speculative steps alike, so min_tokens = max_tokens decodes exactly
    max_tokens tokens that stay a response (the model continues it instead of writing past its
    end of turn); the logprobs are those of the distribution sampled, stops masked."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None  # None: derived from the engine's seed and the request's index
    n: int = 1  # samples per prompt (a GRPO group)
    min_tokens: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < ops.MIN_TEMPERATURE:  # the kernels' bound (0 means greedy)
            raise ValueError(f"temperature: must be 0 (greedy) or >= {ops.MIN_TEMPERATURE}, got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if not isinstance(self.stop_ids, tuple):
            object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens: must be an int in [0, max_tokens = {self.max_tokens}],"
                             f" got {self.min_tokens!r}")
        if self.min_tokens and len(set(self.stop_ids)) > MAX_MASKED_STOP_IDS:
            raise ValueError(f"stop_ids: min_tokens can mask at most {MAX_MASKED_STOP_IDS} "
                             f"distinct stop ids, got {len(set(self.stop_ids))}")


def exact_length(params: SamplingParams, length: int) -> SamplingParams:
    """params decoding exactly `length` tokens (a forced output length, as vLLM's benchmarks fix
    one): the stop ids masked throughout (min_tokens = max_tokens), so the text stays a
    response, or dropped where there are more than min_tokens can mask."""
    stops = params.stop_ids if len(set(params.stop_ids)) <= MAX_MASKED_STOP_IDS else ()
    return replace(params, max_tokens=length, min_tokens=length, stop_ids=stops)


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
    # Per context bucket (POSITION_BUCKET_LABELS), from the rows' context positions at the
    # step's start; they sum to batch and emitted.
    bucket_rows: tuple[int, ...]  # running rows whose context fell in each bucket
    bucket_emitted: tuple[int, ...]  # tokens those rows emitted

    def __post_init__(self):
        for name in ("bucket_rows", "bucket_emitted"):
            if len(getattr(self, name)) != len(POSITION_BUCKET_LABELS):
                raise ValueError(f"{name}: one entry per bucket of POSITION_BUCKET_LABELS, got "
                                 f"{getattr(self, name)}")
        if sum(self.bucket_rows) != self.batch or sum(self.bucket_emitted) != self.emitted:
            raise ValueError(f"bucket_rows, bucket_emitted: must sum to batch ({self.batch}) and "
                             f"emitted ({self.emitted}), got {self.bucket_rows} and "
                             f"{self.bucket_emitted}")


def position_bucket(context: int) -> int:
    """The index in POSITION_BUCKET_LABELS of a row's context position."""
    return bisect_right(POSITION_BUCKET_EDGES, context)


def bucket_counts(contexts: Sequence[int], counts: Sequence[int]
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rows and emitted tokens per context bucket of one step: row b had contexts[b] tokens in
    the cache and emitted counts[b]."""
    if len(contexts) != len(counts):
        raise ValueError(f"contexts, counts: one of each per row, got {len(contexts)} and "
                         f"{len(counts)}")
    rows, emitted = [0] * len(POSITION_BUCKET_LABELS), [0] * len(POSITION_BUCKET_LABELS)
    for context, count in zip(contexts, counts):
        bucket = position_bucket(context)
        rows[bucket] += 1
        emitted[bucket] += count
    return tuple(rows), tuple(emitted)


def acceptance_by_position(spec_steps: Sequence[SpecStepStats]) -> dict[str, float | None]:
    """Mean tokens a row emits per speculative step, per context bucket (label -> value); None
    for a bucket no row-step fell in."""
    result = {}
    for bucket, label in enumerate(POSITION_BUCKET_LABELS):
        rows = sum(s.bucket_rows[bucket] for s in spec_steps)
        emitted = sum(s.bucket_emitted[bucket] for s in spec_steps)
        result[label] = emitted / rows if rows else None
    return result


@dataclass(frozen=True)
class RolloutResult:
    rollouts: list[Rollout]  # ordered by (request_index, sample_index)
    total_s: float
    decode_steps: int  # plain and speculative steps
    spec_steps: tuple[SpecStepStats, ...] = ()
    harvest_s: float = 0.0  # time spent handing positions to the harvest sink
    # every decode step in order: batch, context, plan, tokens committed, seconds, end time
    step_trace: tuple[StepOutcome, ...] = ()

    @property
    def trace_time_s(self) -> torch.Tensor:
        """(steps,) float64: the end of each decode step, seconds since the call began."""
        return torch.tensor([o.ended_s for o in self.step_trace], dtype=torch.float64)

    @property
    def trace_running(self) -> torch.Tensor:
        """(steps,) int64: the rows running during each decode step."""
        return torch.tensor([o.batch for o in self.step_trace], dtype=torch.int64)

    @property
    def trace_speculative(self) -> torch.Tensor:
        """(steps,) bool: whether each decode step was speculative."""
        return torch.tensor([o.plan is not None for o in self.step_trace], dtype=torch.bool)

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens a row emits per speculative step (accepted drafts + 1); None if no step
        was speculative."""
        rows = sum(s.batch for s in self.spec_steps)
        return sum(s.emitted for s in self.spec_steps) / rows if rows else None

    @property
    def acceptance_by_position(self) -> dict[str, float | None]:
        """acceptance_length per context bucket (POSITION_BUCKET_LABELS -> mean tokens a row
        emits per speculative step, None where no row-step fell)."""
        return acceptance_by_position(self.spec_steps)


def step_trace_rows(trace: Sequence[StepOutcome]) -> list[dict]:
    """A step trace as JSON rows: step, running batch, mean context, arm ("plain" or the plan's
    key), tokens committed, seconds, catch-up seconds."""
    return [{"step": o.step, "batch": o.batch, "context": o.context, "arm": o.arm,
             "emitted": o.emitted, "seconds": o.seconds, "catch_up_s": o.catch_up_s}
            for o in trace]


def seconds_at_or_below(trace_time_s: Sequence[float], trace_running: Sequence[int],
                        limit: float) -> float:
    """Time a rollout spent in steps whose running batch was at most limit (its tail), from a
    RolloutResult's trace: end time of each decode step, and the rows running during it."""
    starts = [0.0] + list(trace_time_s[:-1])
    return sum(end - start for start, end, batch in zip(starts, trace_time_s, trace_running)
               if batch <= limit)
