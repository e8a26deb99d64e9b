"""The rollout engine: continuous batching over generation requests.

The engine maps token ids to token ids and log-probabilities; it knows nothing about tokenizers
or tasks. Each step is four named calls — schedule (admit waiting samples into free cache rows,
prefilling their prompts), forward (one decode step for every running row), sample (the shared
sampling kernel), commit (append, finish, free rows) — and records the running batch size, which
is what makes the long tail visible.

Running rows always occupy cache rows [0, running): a finished row is replaced by the last
running one, so a decode step is one forward over a contiguous block and costs what the running
batch costs, not what the cache was sized for.

Sampling is `tlt_core.ops.verify_tree_sampling` on a one-node tree (the root alone): the same
code, and the same temperature / top-k / top-p math, that speculative verification uses. Each
sample has its own Philox stream (seed) and uses uniform index = tokens generated so far, so a
sample's tokens do not depend on what else is in the batch.

Notation: B running rows, T tokens, V vocabulary.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

import tlt_core.ops as ops
from tlt_core.kv_cache import CacheShape, KVCache


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
class RolloutResult:
    rollouts: list[Rollout]  # ordered by (request_index, sample_index)
    trace_time_s: torch.Tensor  # (steps,) float64, end of each decode step
    trace_running: torch.Tensor  # (steps,) int64, running rows during that step
    total_s: float
    decode_steps: int


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # cache rows: the most samples decoding at once
    max_len: int = 1024  # token slots per row: prompt + response must fit
    cache_budget_bytes: int | None = None  # None: no limit beyond the machine's memory
    seed: int = 0  # base of the per-sample seeds that requests do not set

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {self.max_batch}")
        if self.max_len < 2:
            raise ValueError(f"max_len: must be >= 2, got {self.max_len}")


@dataclass
class _Sample:
    """Engine-private state of one sample while it waits or runs."""

    request_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    admitted_s: float = 0.0
    first_token_s: float = 0.0


def sample_seed(base: int, request_index: int, sample_index: int) -> int:
    """A 63-bit seed per sample, stable across runs and batch compositions."""
    digest = hashlib.blake2b(f"{base}/{request_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def sample_next(logits: torch.Tensor, last_tokens: torch.Tensor, params: Sequence[SamplingParams],
                seeds: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob for each row: the sampling kernel on a root-only tree.

    logits (B, V) at each row's last position; last_tokens (B,) the root; seeds, offsets (B,).
    """
    batch = logits.shape[0]
    # Parameters are validated once in SamplingParams; the kernel flags a bad row (NaN logits)
    # with token -1, checked below on this small tensor instead of a full validation pass.
    out = ops.verify_tree_sampling(
        logits[:, None, :].contiguous(), last_tokens[:, None],
        torch.full((batch, 1), -1, dtype=torch.int32),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int32),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        seed=seeds, offset=offsets, validate=False)
    tokens = out.emitted_tokens[:, 0]  # (B,)
    if bool((tokens < 0).any()):
        row = int(torch.nonzero(tokens < 0)[0])
        raise FloatingPointError(f"logits: row {row} has NaN or +inf logits; the model diverged")
    return tokens, out.emitted_logprobs[:, 0]  # (B,), (B,)


class RolloutEngine:
    """Generates samples for requests with a target model and a preallocated KV cache."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        self.cache = KVCache(
            CacheShape(model_config.num_layers, config.max_batch, model_config.num_kv_heads,
                       config.max_len, model_config.head_dim),
            dtype=next(model.parameters()).dtype, device=next(model.parameters()).device,
            budget_bytes=config.cache_budget_bytes)

    # ---- public ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request]) -> RolloutResult:
        waiting = self._expand(requests)
        running: list[_Sample] = []
        finished: list[Rollout] = []
        trace_time, trace_running = [], []
        self.cache.lengths.zero_()
        start = time.perf_counter()
        clock = lambda: time.perf_counter() - start  # noqa: E731
        steps = 0
        while waiting or running:
            self._schedule(waiting, running, finished, clock)
            if not running:
                continue
            logits = self._forward(running)  # (B, V)
            tokens, logprobs = self._sample(running, logits)
            self._commit(running, tokens, logprobs, finished, clock)
            steps += 1
            trace_time.append(clock())
            trace_running.append(len(tokens))
        finished.sort(key=lambda r: (r.request_index, r.sample_index))
        return RolloutResult(finished, torch.tensor(trace_time, dtype=torch.float64),
                             torch.tensor(trace_running, dtype=torch.int64), clock(), steps)

    # ---- the four steps ----------------------------------------------------------------------

    def _schedule(self, waiting: list[_Sample], running: list[_Sample], finished: list[Rollout],
                  clock) -> None:
        """Admit waiting samples into the free rows after the running block: prefill their
        prompts in one batched forward (right-padded; padding sits after each prompt, so causal
        attention never lets a prompt token see it) and sample their first tokens."""
        admitted: list[_Sample] = []
        while waiting and len(running) + len(admitted) < self.config.max_batch:
            admitted.append(waiting.pop(0))
        if not admitted:
            return
        first_row, now = len(running), clock()
        view = self.cache.rows(first_row, len(admitted))
        view.lengths.zero_()
        prompt_lens = torch.tensor([len(s.prompt_ids) for s in admitted])  # (B_new,)
        prompts = torch.zeros(len(admitted), int(prompt_lens.max()), dtype=torch.int64)  # (B_new, T)
        for row, sample in enumerate(admitted):
            prompts[row, :len(sample.prompt_ids)] = torch.tensor(sample.prompt_ids)
            sample.admitted_s = now
        positions = torch.arange(prompts.shape[1]).expand_as(prompts)  # (B_new, T)
        logits = self.model(prompts, positions, view).logits  # (B_new, T, V)
        view.commit(prompt_lens)
        running.extend(admitted)
        tokens, logprobs = self._sample(admitted, logits[torch.arange(len(admitted)), prompt_lens - 1])
        now = clock()
        for sample, token, logprob in zip(admitted, tokens.tolist(), logprobs.tolist()):
            sample.first_token_s = now
            self._append(sample, token, logprob)
        for row in range(len(running) - 1, first_row - 1, -1):  # a stop id or max_tokens = 1
            if self._done(running[row]) is not None:
                self._finish(running, row, finished, clock)

    def _forward(self, running: list[_Sample]) -> torch.Tensor:
        """One decode step: feed each row's last sampled token; returns next-token logits."""
        batch = len(running)
        view = self.cache.rows(0, batch)
        last = torch.tensor([s.tokens[-1] for s in running], dtype=torch.int64)  # (B,)
        logits = self.model.decode(last, view)  # (B, V)
        view.commit(torch.ones(batch, dtype=torch.int64))
        return logits

    def _sample(self, samples: list[_Sample], logits: torch.Tensor):
        last = torch.tensor([s.tokens[-1] if s.tokens else s.prompt_ids[-1] for s in samples])
        seeds = torch.tensor([s.seed for s in samples], dtype=torch.int64)
        offsets = torch.tensor([len(s.tokens) for s in samples], dtype=torch.int64)
        return sample_next(logits, last, [s.params for s in samples], seeds, offsets)

    def _commit(self, running: list[_Sample], tokens: torch.Tensor, logprobs: torch.Tensor,
                finished: list[Rollout], clock) -> None:
        for sample, token, logprob in zip(list(running), tokens.tolist(), logprobs.tolist()):
            self._append(sample, token, logprob)
        # Back to front, so moving the last running row into a freed one never skips a row.
        for row in range(len(running) - 1, -1, -1):
            if self._done(running[row]) is not None:
                self._finish(running, row, finished, clock)

    # ---- helpers -----------------------------------------------------------------------------

    def _expand(self, requests: Sequence[Request]) -> list[_Sample]:
        samples = []
        for request_index, request in enumerate(requests):
            if not isinstance(request, Request):
                raise TypeError(f"requests[{request_index}]: expected a Request, got "
                                f"{type(request).__name__}")
            bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"requests[{request_index}].prompt_ids: token id {bad[0]} is "
                                 f"outside the vocabulary [0, {self.vocab_size})")
            need = len(request.prompt_ids) + request.params.max_tokens
            if need > self.config.max_len:
                raise ValueError(
                    f"requests[{request_index}]: prompt ({len(request.prompt_ids)} tokens) + "
                    f"max_tokens ({request.params.max_tokens}) exceeds max_len "
                    f"({self.config.max_len}); raise EngineConfig.max_len or lower max_tokens")
            for sample_index in range(request.params.n):
                seed = (sample_seed(request.params.seed, 0, sample_index)
                        if request.params.seed is not None
                        else sample_seed(self.config.seed, request_index, sample_index))
                samples.append(_Sample(request_index, sample_index, request.prompt_ids,
                                       request.params, seed))
        return samples

    @staticmethod
    def _append(sample: _Sample, token: int, logprob: float) -> None:
        sample.tokens.append(token)
        sample.logprobs.append(logprob)

    @staticmethod
    def _done(sample: _Sample) -> str | None:
        if sample.tokens[-1] in sample.params.stop_ids:
            return "stop"
        if len(sample.tokens) >= sample.params.max_tokens:
            return "length"
        return None

    def _finish(self, running: list[_Sample], row: int, finished: list[Rollout], clock) -> None:
        sample = running[row]
        reason = self._done(sample)
        rollout = Rollout(sample.request_index, sample.sample_index, sample.prompt_ids,
                          torch.tensor(sample.tokens, dtype=torch.int64),
                          torch.tensor(sample.logprobs, dtype=torch.float32), reason,
                          RequestTiming(sample.admitted_s, sample.first_token_s, clock()))
        last = len(running) - 1
        if row != last:
            self.cache.move_row(last, row)
            running[row] = running[last]
        running.pop()
        self.cache.lengths[last] = 0
        finished.append(rollout)
