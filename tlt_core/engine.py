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
from typing import Callable, Optional, Sequence, Union

import torch

import tlt_core.ops as ops
from tlt_core.drafter import Drafter
from tlt_core.harvest import HarvestBuffer
from tlt_core.kv_cache import CacheBudgetError, CacheShape, KVCache
from tlt_core.model_free import ModelFree, SuffixDrafts
from tlt_core.speculative import Strategy, draft_tree


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
    strategy: str  # "(depth,topk,num_verify_tokens)"
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
    harvest_s: float = 0.0  # time spent handing positions to the harvest buffer

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


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # cache rows: the most samples decoding at once
    max_len: int = 1024  # token slots per row: prompt + response must fit
    cache_budget_bytes: int | None = None  # None: no limit beyond the machine's memory
    seed: int = 0  # base of the per-sample seeds that requests do not set
    # Cache slots past max_len that a speculative step may write (its tree's nodes, in the
    # target's and the drafter's caches); bounds num_verify_tokens and (depth - 1) * topk.
    spec_reserve: int = 64
    # How the drafter's cache follows positions committed without it (plain and model-free
    # steps): "lazy" keeps their target features in a backlog and runs the drafter over it in
    # one batched pass when it drafts next (or the backlog holds draft_backlog positions);
    # "eager" runs the drafter after every such step. Same drafts either way.
    drafter_sync: str = "lazy"
    draft_backlog: int = 128

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {self.max_batch}")
        if self.max_len < 2:
            raise ValueError(f"max_len: must be >= 2, got {self.max_len}")
        if self.spec_reserve < 2:
            raise ValueError(f"spec_reserve: must be >= 2, got {self.spec_reserve}")
        if self.drafter_sync not in ("lazy", "eager"):
            raise ValueError(f"drafter_sync: must be 'lazy' or 'eager', got {self.drafter_sync!r}")
        if self.draft_backlog < self.spec_reserve:
            raise ValueError(f"draft_backlog: must be >= spec_reserve ({self.spec_reserve}), "
                             f"got {self.draft_backlog}")


# A draft plan for one step: the learned drafter's tree, or drafts copied from sibling responses.
DraftPlan = Union[Strategy, ModelFree]
# What generate() is told about speculation: never (None), always one plan, or a policy asked
# before every step with the running batch size (the adaptive loop). A policy with an
# observe(batch, plan, emitted_tokens, seconds) method is told how each step went.
StrategyPolicy = Union[DraftPlan, None, Callable[[int], Optional[DraftPlan]]]


@dataclass
class _Sample:
    """Engine-private state of one sample while it waits or runs (its row's tensors live in
    RolloutEngine's per-row state)."""

    request_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    done: str | None = None  # finish reason, once finished


def sample_seed(base: int, request_index: int, sample_index: int) -> int:
    """A 63-bit seed per sample, stable across runs and batch compositions."""
    digest = hashlib.blake2b(f"{base}/{request_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def sample_next(logits: torch.Tensor, last_tokens: torch.Tensor, params: Sequence[SamplingParams],
                seeds: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob for each row: the sampling kernel on a root-only tree.

    logits (B, V) at each row's last position; last_tokens (B,) the root; seeds, offsets (B,).
    """
    return _sample_roots(
        logits, last_tokens,
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int32),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        seed=seeds, offset=offsets)


def _sample_roots(logits: torch.Tensor, last_tokens: torch.Tensor, *, temperature, top_k, top_p,
                  seed, offset) -> tuple[torch.Tensor, torch.Tensor]:
    batch = logits.shape[0]
    # Parameters are validated once in SamplingParams; the kernel flags a bad row (NaN logits)
    # with token -1, checked below on this small tensor instead of a full validation pass.
    out = ops.verify_tree_sampling(
        logits[:, None, :].contiguous(), last_tokens[:, None],
        torch.full((batch, 1), -1, dtype=torch.int32, device=logits.device),
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
        validate=False)
    tokens = out.emitted_tokens[:, 0]  # (B,)
    _check_emitted(tokens)
    return tokens, out.emitted_logprobs[:, 0]  # (B,), (B,)


def _check_emitted(first_tokens: torch.Tensor) -> None:
    if bool((first_tokens < 0).any()):
        row = int(torch.nonzero(first_tokens < 0)[0])
        raise FloatingPointError(f"logits: row {row} has NaN or +inf logits; the model diverged")


class _RowState:
    """Per-row tensors over the cache's rows: what each step's kernels read, kept in place so a
    step does not rebuild them from Python lists. Rows move with their samples (move)."""

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)  # the root token
        self.seed = torch.zeros(rows, dtype=torch.int64, device=device)
        self.offset = torch.zeros(rows, dtype=torch.int64, device=device)  # tokens generated
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.int32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        # The drafter's output at its last committed pair: its guess of the root's feature.
        self.draft_hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)

    def admit(self, row: int, sample: _Sample) -> None:
        self.seed[row], self.offset[row] = sample.seed, 0
        p = sample.params
        self.temperature[row], self.top_k[row], self.top_p[row] = p.temperature, p.top_k, p.top_p

    def move(self, source: int, target: int) -> None:
        for t in (self.last, self.seed, self.offset, self.temperature, self.top_k, self.top_p,
                  self.draft_hidden):
            t[target] = t[source]

    def sampling(self, rows: slice) -> dict:
        """The sampling kernels' per-row arguments for rows."""
        return dict(temperature=self.temperature[rows], top_k=self.top_k[rows],
                    top_p=self.top_p[rows], seed=self.seed[rows], offset=self.offset[rows])


class RolloutEngine:
    """Generates samples for requests with a target model and a preallocated KV cache; with a
    drafter, speculatively (lossless) at the steps a strategy policy chooses."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig = EngineConfig(),
                 drafter: Drafter | None = None, harvest: HarvestBuffer | None = None):
        self.model = model
        self.config = config
        self.drafter = drafter
        self.harvest = harvest  # receives every committed position's target features
        if harvest is not None and drafter is None:
            raise ValueError("harvest: needs the drafter whose feature layers it keeps")
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        if drafter is not None and drafter.target is not model:
            raise ValueError("drafter: was built for another target model; attach it to this one")
        weight = next(model.parameters())
        self.device = weight.device
        reserve = config.spec_reserve
        shape = CacheShape(model_config.num_layers, config.max_batch, model_config.num_kv_heads,
                           config.max_len + reserve, model_config.head_dim)
        budget = config.cache_budget_bytes
        if drafter is not None and budget is not None:
            budget -= shape.bytes(weight.dtype) // model_config.num_layers  # the drafter's one layer
            if budget < 0:
                raise CacheBudgetError(f"budget_bytes: {config.cache_budget_bytes:,} bytes do "
                                       "not hold the drafter's cache; raise the budget")
        self.cache = KVCache(shape, dtype=weight.dtype, device=weight.device, budget_bytes=budget)
        self.draft_cache = (None if drafter is None else
                            drafter.new_cache(config.max_batch, config.max_len + reserve))
        self.rows = _RowState(config.max_batch, model_config.hidden_size, weight.dtype,
                              weight.device)
        self._drafting = False  # per generate(): keep the drafter's cache current
        self._harvest_s = 0.0  # per generate(): time handing positions to the harvest
        # Sibling and previous-rollout responses for model-free drafts; each generate() turns
        # the last one's responses into history (add_history adds a caller's own).
        self.model_free = SuffixDrafts()
        # The lazy drafter sync's backlog: per row, committed pairs (x_{t+1}, target features
        # at t) the drafter has not seen, _backlog_len of them; allocated on first use.
        self._backlog_tokens: torch.Tensor | None = None  # (rows, draft_backlog) int64
        self._backlog_features: torch.Tensor | None = None  # (rows, draft_backlog, F, H)
        self._backlog_len = torch.zeros(config.max_batch, dtype=torch.int64, device=self.device)
        self._backlog_width = 0  # bound on max(_backlog_len) over the running rows

    # ---- public ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], strategy: StrategyPolicy = None, *,
                 request_ids: Sequence[int] | None = None,
                 observe: Callable[[int, DraftPlan | None, int, float], None] | None = None
                 ) -> RolloutResult:
        """Runs every request to completion. strategy: None (plain decoding), a Strategy (every
        step speculative) or a policy called before each step with the running batch size
        that returns a Strategy or None for that step. Speculation never changes what is
        sampled: outputs follow the target's distribution exactly, greedy rows token for token.
        request_ids: each request's index in a larger set (a worker's shard), used in records
        and seeds so a sample does not depend on how requests were split among workers.
        observe(batch, plan, emitted_tokens, seconds): told how each step went, whatever the
        strategy, plain decoding included (default: the policy's own observe method, if any)."""
        policy = self._policy(strategy)
        if observe is None:
            observe = getattr(strategy, "observe", None)
        self.model_free.new_round()
        waiting = self._expand(requests, request_ids)
        running: list[_Sample] = []
        finished: list[Rollout] = []
        trace_time, trace_running, spec_steps = [], [], []
        self.cache.lengths.zero_()
        self._drafting = policy is not None and self.drafter is not None
        self._harvest_s = 0.0
        if self._drafting:
            self.draft_cache.lengths.zero_()
        self._backlog_len.zero_()
        self._backlog_width = 0
        start = time.perf_counter()
        clock = lambda: time.perf_counter() - start  # noqa: E731
        steps = 0
        while waiting or running:
            self._schedule(waiting, running, finished, clock)
            if not running:
                continue
            batch = len(running)
            step_start = time.perf_counter()
            chosen = None if policy is None else policy(batch)
            if chosen is None:
                self._plain_step(running)
                emitted = batch
            else:
                spec_steps.append(self._speculative_step(running, chosen, steps))
                emitted = spec_steps[-1].emitted
            if observe is not None:
                observe(batch, chosen, emitted, time.perf_counter() - step_start)
            self._retire(running, finished, clock)
            steps += 1
            trace_time.append(clock())
            trace_running.append(batch)
        finished.sort(key=lambda r: (r.request_index, r.sample_index))
        return RolloutResult(finished, torch.tensor(trace_time, dtype=torch.float64),
                             torch.tensor(trace_running, dtype=torch.int64), clock(), steps,
                             tuple(spec_steps), self._harvest_s)

    # ---- the steps ---------------------------------------------------------------------------

    def _schedule(self, waiting: list[_Sample], running: list[_Sample], finished: list[Rollout],
                  clock) -> None:
        """Admit waiting samples into the free rows after the running block: prefill their
        prompts in one batched pass (right-padded; padding sits after each prompt, so causal
        attention never lets a prompt token see it) and sample their first tokens."""
        admitted: list[_Sample] = []
        while waiting and len(running) + len(admitted) < self.config.max_batch:
            admitted.append(waiting.pop(0))
        if not admitted:
            return
        first_row, count, now = len(running), len(admitted), clock()
        view = self.cache.rows(first_row, count)
        view.lengths.zero_()
        device = self.device
        lengths = [len(s.prompt_ids) for s in admitted]
        prompts = torch.zeros(count, max(lengths), dtype=torch.int64)  # (B_new, T)
        for row, sample in enumerate(admitted):
            prompts[row, :len(sample.prompt_ids)] = torch.tensor(sample.prompt_ids)
            sample.admitted_s = now
            self.rows.admit(first_row + row, sample)
        prompts = prompts.to(device)
        prompt_lens = torch.tensor(lengths, device=device)  # (B_new,)
        positions = torch.arange(prompts.shape[1], device=device).expand_as(prompts)  # (B_new, T)
        out = self.model.step(prompts, positions, view, hidden_layers=self._target_layers())
        self._harvest(admitted, prompts, out.hidden_states, lengths)
        view.commit(prompt_lens)
        rows = slice(first_row, first_row + count)
        last_index = torch.arange(count, device=device), prompt_lens - 1
        tokens, logprobs = _sample_roots(out.logits[last_index], prompts[last_index],
                                         **self.rows.sampling(rows))
        if self._drafting:  # pairs (f_t, x_{t+1}): the prompt shifted by one, then the new token
            # (prompts go to the drafter at once: one batched pass, not worth a backlog)
            following = torch.cat((prompts[:, 1:], prompts[:, :1]), dim=1)
            following[last_index] = tokens
            self._drafter_extend(first_row, following, out.hidden_states, prompt_lens)
        self.rows.last[rows] = tokens
        self.rows.offset[rows] += 1
        now = clock()
        for sample, token, logprob in zip(admitted, tokens.tolist(), logprobs.tolist()):
            sample.first_token_s = now
            self._append(sample, [token], [logprob])
        running.extend(admitted)
        self._retire(running, finished, clock)  # a stop id or max_tokens = 1

    def _plain_step(self, running: list[_Sample]) -> None:
        """One token per row: feed each row's root, sample the next token, commit."""
        batch = len(running)
        view = self.cache.rows(0, batch)
        roots = self.rows.last[:batch]
        if self._target_layers():  # the features too, for the drafter or the harvest
            out = self.model.step(roots[:, None], view.lengths[:, None], view,
                                  hidden_layers=self._target_layers())
            logits = out.logits[:, 0]
            self._harvest(running, roots[:, None], out.hidden_states, [1] * batch)
        else:
            logits = self.model.decode(roots, view)  # (B, V)
        ones = torch.ones(batch, dtype=torch.int64, device=self.device)
        view.commit(ones)
        tokens, logprobs = _sample_roots(logits, roots, **self.rows.sampling(slice(0, batch)))
        if self._drafting:
            self._drafter_follow(tokens[:, None], out.hidden_states, ones, 1, batch)
        self.rows.last[:batch] = tokens
        self.rows.offset[:batch] += 1
        for sample, token, logprob in zip(running, tokens.tolist(), logprobs.tolist()):
            self._append(sample, [token], [logprob])

    def _speculative_step(self, running: list[_Sample], strategy: DraftPlan,
                          step: int) -> SpecStepStats:
        """Draft a tree per row, verify it in one target pass, keep the accepted path and the
        corrected / bonus token, and bring both caches and the drafter's state up to date."""
        batch, N = len(running), strategy.num_verify_tokens
        view = self.cache.rows(0, batch)
        roots = self.rows.last[:batch]
        t0 = time.perf_counter()
        model_free = isinstance(strategy, ModelFree)
        if model_free:
            tree = self._model_free_tree(running, strategy)
        else:
            self._backlog_flush(batch)  # the drafter needs every committed pair
            tree = draft_tree(self.drafter, self.draft_cache.rows(0, batch), roots,
                              self.rows.draft_hidden[:batch], strategy)
        t1 = time.perf_counter()
        if model_free or strategy.topk == 1:  # a chain: node i sees nodes 0..i (causal)
            positions = view.lengths[:, None] + torch.arange(N, device=self.device)
            tree_mask = None
        else:
            meta = ops.tree_metadata(tree.parents, tree.num_nodes, view.lengths)
            positions, tree_mask = meta.positions, ops.unpack_tree_mask(meta.mask, N)
        out = self.model.step(tree.tokens, positions, view, tree_mask=tree_mask,
                              hidden_layers=self._target_layers())
        verdict = ops.verify_tree_sampling(
            out.logits, tree.tokens, tree.parents, num_nodes=tree.num_nodes, validate=False,
            **self.rows.sampling(slice(0, batch)))
        _check_emitted(verdict.emitted_tokens[:, 0])
        t2 = time.perf_counter()
        counts = verdict.num_accepted.to(torch.int64) + 1  # (B,) tokens each row emits
        view.compact(verdict.accept_index, verdict.num_accepted)
        count_list = counts.tolist()  # the accept phase's one host sync
        width = max(count_list)
        path = verdict.accept_index[:, :width].clamp(min=0).long()  # (B, width) accepted nodes
        path_hidden = [h.gather(1, path[..., None].expand(-1, -1, h.shape[-1]))
                       for h in out.hidden_states]
        emitted = verdict.emitted_tokens[:, :width]
        if model_free:  # the drafter may not draft next: it can follow lazily
            if self._drafting:
                self._drafter_follow(emitted.clamp(min=0), path_hidden, counts, width, batch)
        else:  # it drafts next step, most likely: follow now
            self._drafter_extend(0, emitted.clamp(min=0), path_hidden, counts)
        self.rows.last[:batch] = emitted.gather(1, (counts - 1)[:, None])[:, 0]
        self.rows.offset[:batch] += counts
        kept = [self._append(sample, tokens[:n], logprobs[:n]) for sample, n, tokens, logprobs
                in zip(running, count_list, emitted.tolist(), verdict.emitted_logprobs.tolist())]
        # a position belongs to the sequence only if the token after it was kept
        self._harvest(running, tree.tokens.gather(1, path), path_hidden, kept)
        t3 = time.perf_counter()
        drafted = int(tree.num_nodes.sum()) - batch
        emitted_total = sum(count_list)
        return SpecStepStats(step, batch, str(strategy), drafted, emitted_total - batch,
                             emitted_total, t1 - t0, t2 - t1, t3 - t2)

    def _drafter_extend(self, first_row: int, following: torch.Tensor,
                        target_hidden: Sequence[torch.Tensor], counts: torch.Tensor) -> None:
        """Commit drafter pairs (f_t, x_{t+1}) for the positions the target just committed:
        following (B, T) the tokens x_{t+1}, target_hidden the target's feature-layer outputs
        (B, T, H) at t, counts (B,) valid pairs per row (padding after them is written to
        uncommitted slots and seen by no valid pair). Keeps each row's last output."""
        batch, width = following.shape
        view = self.draft_cache.rows(first_row, batch)
        positions = view.lengths[:, None] + torch.arange(width, device=self.device)  # (B, T)
        features = self.drafter.features(target_hidden[:len(self.drafter.config.feature_layers)])
        hidden = self.drafter(following, features, positions, view)  # (B, T, H)
        view.commit(counts)
        last = torch.arange(batch, device=self.device), (counts - 1).clamp(min=0)
        rows = slice(first_row, first_row + batch)
        self.rows.draft_hidden[rows] = torch.where((counts > 0)[:, None], hidden[last],
                                                   self.rows.draft_hidden[rows])

    def _drafter_follow(self, following: torch.Tensor, target_hidden: Sequence[torch.Tensor],
                        counts: torch.Tensor, width: int, batch: int) -> None:
        """Pairs committed without the drafter (rows [0, batch), as _drafter_extend): extended
        now ("eager") or queued in the backlog ("lazy")."""
        if self.config.drafter_sync == "eager":
            self._drafter_extend(0, following, target_hidden, counts)
            return
        if self._backlog_width + width > self.config.draft_backlog:
            # the bound also counts rows that have since finished: tighten it (a host sync,
            # once per draft_backlog positions at most), and flush only if really full
            self._backlog_width = int(self._backlog_len[:batch].max())
            if self._backlog_width + width > self.config.draft_backlog:
                self._backlog_flush(batch)
        features = torch.stack(tuple(target_hidden[:len(self.drafter.config.feature_layers)]),
                               dim=2)  # (B, W, F, H)
        if self._backlog_tokens is None:
            rows, cap = self.config.max_batch, self.config.draft_backlog
            self._backlog_tokens = torch.zeros(rows, cap, dtype=torch.int64, device=self.device)
            self._backlog_features = features.new_zeros((rows, cap) + features.shape[2:])
        # row b's W columns go after its backlog; columns past counts[b] are padding that the
        # row's next pairs overwrite, and _backlog_len never counts
        columns = (self._backlog_len[:batch, None]
                   + torch.arange(width, device=self.device)).clamp(max=self.config.draft_backlog - 1)
        rows = torch.arange(batch, device=self.device)[:, None].expand(batch, width)
        self._backlog_tokens[rows, columns] = following
        self._backlog_features[rows, columns] = features
        self._backlog_len[:batch] += counts
        self._backlog_width += width

    def _backlog_flush(self, batch: int) -> None:
        """The drafter catches up on the backlog of rows [0, batch) in one pass."""
        if self._backlog_width == 0:
            return
        width = int(self._backlog_len[:batch].max())  # the bound may count finished rows
        if width == 0:
            self._backlog_width = 0
            return
        features = self._backlog_features[:batch, :width]
        self._drafter_extend(0, self._backlog_tokens[:batch, :width], features.unbind(dim=2),
                             self._backlog_len[:batch])
        self._backlog_len.zero_()
        self._backlog_width = 0

    def _model_free_tree(self, running: list[_Sample], plan: ModelFree) -> ops.DraftTree:
        """Chains copied from sibling / earlier responses (SuffixDrafts); a row without a match
        gets its root alone."""
        batch, N = len(running), plan.num_verify_tokens
        tokens = torch.zeros(batch, N, dtype=torch.int64)
        num_nodes = torch.ones(batch, dtype=torch.int32)
        for row, sample in enumerate(running):
            proposal = self.model_free.propose(id(sample), plan.depth)
            if proposal:
                tokens[row, 1:1 + len(proposal)] = torch.tensor(proposal)
                num_nodes[row] = 1 + len(proposal)
        parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(batch, N).clone()
        parents[torch.arange(N)[None] >= num_nodes[:, None]] = -1  # padding nodes
        device = self.device
        tokens = tokens.to(device)
        tokens[:, 0] = self.rows.last[:batch]
        return ops.DraftTree(tokens, parents.to(device),
                             torch.where(parents >= 0, parents, -1).to(device),
                             num_nodes.to(device))

    def _retire(self, running: list[_Sample], finished: list[Rollout], clock) -> None:
        # Back to front, so moving the last running row into a freed one never skips a row.
        for row in range(len(running) - 1, -1, -1):
            if running[row].done is not None:
                self._finish(running, row, finished, clock)

    # ---- helpers -----------------------------------------------------------------------------

    def _policy(self, strategy: StrategyPolicy) -> Callable[[int], DraftPlan | None] | None:
        if strategy is None:
            return None
        reserve = self.config.spec_reserve

        def checked(chosen: DraftPlan | None) -> DraftPlan | None:
            if chosen is None:
                return None
            if not isinstance(chosen, (Strategy, ModelFree)):
                raise TypeError(f"strategy: expected a Strategy, ModelFree or None, got {chosen!r}")
            if isinstance(chosen, Strategy) and self.drafter is None:
                raise ValueError("strategy: speculative decoding with a learned drafter needs "
                                 "one; build the engine with RolloutEngine(model, config, "
                                 "drafter), or use ModelFree drafts")
            need = max(chosen.num_verify_tokens, chosen.fed_nodes)
            if need > reserve:
                raise ValueError(f"strategy: {chosen} needs {need} cache slots past max_len; "
                                 f"EngineConfig.spec_reserve is {reserve}")
            return chosen

        if isinstance(strategy, (Strategy, ModelFree)):
            checked(strategy)
            return lambda batch: strategy
        if callable(strategy):
            return lambda batch: checked(strategy(batch))
        raise TypeError(f"strategy: expected None, a Strategy, ModelFree or a callable, got "
                        f"{strategy!r}")

    def _target_layers(self) -> tuple[int, ...]:
        """The target layers each pass returns: the drafter's feature layers while drafting or
        harvesting, then (harvesting) the last layer, the drafter's regression target."""
        if not (self._drafting or self.harvest is not None):
            return ()
        features = self.drafter.config.feature_layers
        return features + ((-1,) if self.harvest is not None else ())

    def _harvest(self, samples: list[_Sample], tokens: torch.Tensor,
                 hidden: Sequence[torch.Tensor], counts: list[int]) -> None:
        """Hands a pass's committed positions to the harvest buffer (tokens (B, W) and the
        _target_layers outputs (B, W, H), counts[b] positions of row b)."""
        if self.harvest is None:
            return
        start = time.perf_counter()
        features = torch.stack(tuple(hidden[:-1]), dim=2)  # (B, W, F, H)
        # tokens may view per-row state the step is about to overwrite: keep a copy
        self.harvest.add_step([(s.request_index, s.sample_index) for s in samples],
                              tokens.clone(), features, hidden[-1], counts)
        self._harvest_s += time.perf_counter() - start

    def _expand(self, requests: Sequence[Request],
                request_ids: Sequence[int] | None = None) -> list[_Sample]:
        if request_ids is not None and len(request_ids) != len(requests):
            raise ValueError(f"request_ids: {len(request_ids)} ids for {len(requests)} requests")
        samples = []
        for position, request in enumerate(requests):
            request_index = position if request_ids is None else int(request_ids[position])
            if not isinstance(request, Request):
                raise TypeError(f"requests[{position}]: expected a Request, got "
                                f"{type(request).__name__}")
            bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"requests[{position}].prompt_ids: token id {bad[0]} is "
                                 f"outside the vocabulary [0, {self.vocab_size})")
            need = len(request.prompt_ids) + request.params.max_tokens
            if need > self.config.max_len:
                raise ValueError(
                    f"requests[{position}]: prompt ({len(request.prompt_ids)} tokens) + "
                    f"max_tokens ({request.params.max_tokens}) exceeds max_len "
                    f"({self.config.max_len}); raise EngineConfig.max_len or lower max_tokens")
            for sample_index in range(request.params.n):
                seed = (sample_seed(request.params.seed, 0, sample_index)
                        if request.params.seed is not None
                        else sample_seed(self.config.seed, request_index, sample_index))
                sample = _Sample(request_index, sample_index, request.prompt_ids,
                                 request.params, seed)
                self.model_free.track(id(sample), sample.prompt_ids, sample.tokens)
                samples.append(sample)
        return samples

    @staticmethod
    def _append(sample: _Sample, tokens: list[int], logprobs: list[float]) -> int:
        """Appends a step's tokens, up to a stop id or max_tokens (what a speculative step
        emits past either is dropped: plain decoding would never have produced it). Returns
        how many it kept."""
        for kept, (token, logprob) in enumerate(zip(tokens, logprobs), start=1):
            sample.tokens.append(token)
            sample.logprobs.append(logprob)
            if token in sample.params.stop_ids:
                sample.done = "stop"
            elif len(sample.tokens) >= sample.params.max_tokens:
                sample.done = "length"
            if sample.done is not None:
                return kept
        return len(tokens)

    def _finish(self, running: list[_Sample], row: int, finished: list[Rollout], clock) -> None:
        sample = running[row]
        rollout = Rollout(sample.request_index, sample.sample_index, sample.prompt_ids,
                          torch.tensor(sample.tokens, dtype=torch.int64),
                          torch.tensor(sample.logprobs, dtype=torch.float32), sample.done,
                          RequestTiming(sample.admitted_s, sample.first_token_s, clock()))
        last = len(running) - 1
        if row != last:
            self.cache.move_row(last, row)
            if self._drafting:
                self.draft_cache.move_row(last, row)
                if self._backlog_tokens is not None:
                    self._backlog_tokens[row] = self._backlog_tokens[last]
                    self._backlog_features[row] = self._backlog_features[last]
                self._backlog_len[row] = self._backlog_len[last]
            self.rows.move(last, row)
            running[row] = running[last]
        running.pop()
        self.cache.lengths[last] = 0
        if self._drafting:
            self.draft_cache.lengths[last] = 0
            self._backlog_len[last] = 0
        finished.append(rollout)
        if self.harvest is not None:
            start = time.perf_counter()
            self.harvest.finish((sample.request_index, sample.sample_index))
            self._harvest_s += time.perf_counter() - start
