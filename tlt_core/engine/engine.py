"""The rollout engine: continuous batching over generation requests, speculative at the steps a
policy chooses, with the target's distribution either way.

The engine maps token ids to token ids and log-probabilities; it knows nothing about tokenizers
or tasks. `generate` runs one call's requests to completion as a loop of three named parts:

- admit: waiting samples take the free cache rows after the running block; their prompts are
  prefilled in one batched pass and their first tokens sampled;
- step: one decode step over every running row, plain (forward, sample, commit) or speculative
  (draft, verify, accept, commit), as the policy chose for this running batch size;
- retire: finished samples leave, and the last running row moves into each freed row.

Running rows always occupy cache rows [0, running), so a decode step is one forward over a
contiguous block and costs what the running batch costs, not what the cache was sized for. The
running batch size of every step is recorded: it is what makes the long tail visible.

A speculative step verifies each row's draft tree (tlt_core.drafting) in one target pass with
`ops.verify_tree_sampling`, the kernel plain sampling also uses (tlt_core.engine.sampling), so
greedy rows emit exactly the plain tokens (in float32) and sampled rows follow the target's
distribution exactly; the emitted log-probs are the target's.

Passes: a step's model passes (plain, draft, verify, the drafter's catch-up) go through one
`DecodePasses` (tlt_core.engine.passes), chosen at construction: eager at the running batch's
shapes, or fixed-shape CUDA graphs (EngineConfig.graphs). The step code is the same either way.

State: what one call needs (its queue, running samples, trace, timings) is a `_Run` local to
that call. The engine owns what every call reuses: the target's KV cache, the per-row tensors,
the drafter's per-row state (`DrafterRows`) and the suffix index whose history carries
responses from one call to the next. A call holds those buffers until it returns, so an engine
runs one call at a time; a second concurrent call is refused.

Notation: B running rows, N tree nodes, W tokens a step commits per row (at most N), T tokens,
V vocabulary, H hidden size.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

import tlt_core.ops as ops
from tlt_core.drafting.learned import LearnedDrafter, check_drafter
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.suffix_index import SuffixIndex
from tlt_core.engine.drafter_rows import SYNCS, DrafterRows
from tlt_core.engine.hooks import HarvestSink, PlanPolicy, Speculation, StepObserver, StepOutcome
from tlt_core.engine.host_read import HostReader
from tlt_core.engine.passes import DecodePasses, EagerPasses, Verified
from tlt_core.engine.records import (Request, RequestTiming, Rollout, RolloutResult,
                                     SamplingParams, SpecStepStats, bucket_counts)
from tlt_core.engine.rows import RowState
from tlt_core.engine.sampling import check_emitted, sample_roots, sample_seed
from tlt_core.engine.step_clock import StepClock
from tlt_core.engine.step_graphs import GRAPH_POOLS, StepGraphs
from tlt_core.model.kv_cache import CacheBudgetError, CacheShape, KVCache, cache_dtype
from tlt_core.model.transformer import ModelOutput


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # cache rows: the most samples decoding at once
    max_len: int = 1024  # token slots per row: prompt + response must fit
    cache_budget_bytes: int | None = None  # None: no limit beyond the machine's memory
    seed: int = 0  # base of the per-sample seeds that requests do not set
    # Cache slots past max_len that a speculative step may write (its tree's nodes, in the
    # target's and the drafter's caches); bounds num_verify_tokens and (depth - 1) * topk.
    spec_reserve: int = 64
    # How the drafter's cache follows positions committed without it (prompts, plain and
    # suffix-match steps): "lazy" keeps their target features in a backlog and runs the drafter
    # over it in one batched pass when it drafts next (or the backlog holds draft_backlog
    # positions); "eager" runs the drafter after every such step. Same drafts either way
    # (DrafterRows). draft_backlog None: a row's whole length, so a loop that decodes without
    # SD runs no drafter pass at all, and the catch-up is paid once, by the step that turns SD
    # on; it holds max_batch x (max_len + spec_reserve) x feature layers x hidden features.
    drafter_sync: str = "lazy"
    draft_backlog: int | None = None
    # Prefill's token budget: samples are admitted together while their padded prompts fit it,
    # and prefilled in chunks of at most this many tokens (a prompt of any length fits).
    prefill_tokens: int = 8192
    # Decode passes at fixed shapes (tlt_core.engine.step_graphs): None = on a CUDA device
    # (captured as CUDA graphs), off elsewhere; True = on (eagerly on the CPU: the same code,
    # what tests compare with the dynamic path); False = off. graph_pool: "shared" (one memory
    # pool for every graph) or "per_graph" (to measure what sharing saves).
    graphs: bool | None = None
    graph_pool: str = "shared"

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {self.max_batch}")
        if self.max_len < 2:
            raise ValueError(f"max_len: must be >= 2, got {self.max_len}")
        if self.spec_reserve < 2:
            raise ValueError(f"spec_reserve: must be >= 2, got {self.spec_reserve}")
        if self.drafter_sync not in SYNCS:
            raise ValueError(f"drafter_sync: must be 'lazy' or 'eager', got {self.drafter_sync!r}")
        if not isinstance(self.prefill_tokens, int) or self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens: must be an int >= 1, got {self.prefill_tokens!r}")
        if self.graph_pool not in GRAPH_POOLS:
            raise ValueError(f"graph_pool: must be one of {GRAPH_POOLS}, got {self.graph_pool!r}")
        if self.graphs not in (None, True, False):
            raise ValueError(f"graphs: must be None, True or False, got {self.graphs!r}")
        if self.draft_backlog is not None and self.draft_backlog < self.spec_reserve:
            raise ValueError(f"draft_backlog: must be >= spec_reserve ({self.spec_reserve}), "
                             f"got {self.draft_backlog}")


@dataclass
class _Sample:
    """One sample while it waits or runs (its row's tensors live in RowState / DrafterRows)."""

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

    @property
    def key(self) -> tuple[int, int]:
        """Unique within a call: the sample's handle in the suffix index and the harvest."""
        return self.request_index, self.sample_index


@dataclass
class _Run:
    """One generate call's state."""

    waiting: deque[_Sample]
    choose: Callable[[int, int], DraftPlan | None] | None  # (batch, context); None: plain
    observers: tuple[StepObserver, ...]
    suffix_index: SuffixIndex
    drafting: bool  # the drafter follows every committed position (a plan may use it)
    hidden_layers: tuple[int, ...]  # target layers every pass returns (drafter, harvest)
    start: float  # time.perf_counter() when the call began
    min_tokens: bool  # some sample masks its stop ids for a while (SamplingParams.min_tokens)
    running: list[_Sample] = field(default_factory=list)  # row i runs running[i]
    finished: list[Rollout] = field(default_factory=list)
    steps: int = 0
    spec_steps: list[SpecStepStats] = field(default_factory=list)
    step_trace: list[StepOutcome] = field(default_factory=list)
    harvest_s: float = 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.start

    def masks_stops(self) -> bool:
        """Whether a running row is still short of its min_tokens: the step masks stops."""
        return self.min_tokens and any(len(s.tokens) < s.params.min_tokens for s in self.running)


@dataclass(frozen=True)
class _Committed:
    """What a step commits for the running rows [0, B)."""

    counts: torch.Tensor  # (B,) int64: tokens each row commits
    count_list: list[int]  # the same, on the host
    emitted: torch.Tensor  # (B, W) int64: the tokens, -1 past a row's count
    emitted_rows: list[list[int]]  # on the host, a list per row: its first counts[b] count
    logprob_rows: list[list[float]]  # (B, W) their target log-probs, a list per row
    last: torch.Tensor  # (B,) int64: each row's last committed token, its next root
    fed_tokens: torch.Tensor  # (B, W) int64: the token at each position just committed
    hidden: tuple[torch.Tensor, ...]  # (B, W, H) per returned target layer, at those positions
    # (B,) on the host, speculative steps only: each row's tokens in the cache before the step
    # (its context position), and its tree's nodes
    context_list: list[int] = field(default_factory=list)
    node_list: list[int] = field(default_factory=list)


class RolloutEngine:
    """Generates samples for requests with a target model and a preallocated KV cache; with a
    drafter, speculatively (lossless) at the steps a policy chooses."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig = EngineConfig(),
                 drafter: LearnedDrafter | None = None, harvest: HarvestSink | None = None):
        if drafter is not None:
            check_drafter(drafter)
        if harvest is not None and drafter is None:
            raise ValueError("harvest: needs the drafter whose feature layers it keeps")
        if drafter is not None and drafter.target is not model:
            raise ValueError("drafter: was built for another target model; attach it to this one")
        self.model, self.config, self.drafter, self.harvest = model, config, drafter, harvest
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        weight = next(model.parameters())
        self.device = weight.device
        slots = config.max_len + config.spec_reserve
        shape = CacheShape(model_config.num_layers, config.max_batch, model_config.num_kv_heads,
                           slots, model_config.head_dim)
        budget = config.cache_budget_bytes
        if drafter is not None and budget is not None:
            # the drafter's cache: one layer of the target's shape
            budget -= shape.bytes(cache_dtype(weight.dtype, weight.device)) // \
                model_config.num_layers
            if budget < 0:
                raise CacheBudgetError(f"budget_bytes: {config.cache_budget_bytes:,} bytes do "
                                       "not hold the drafter's cache; raise the budget")
        self.cache = KVCache(shape, dtype=cache_dtype(weight.dtype, weight.device),
                             device=weight.device, budget_bytes=budget)
        self.rows = RowState(config.max_batch, weight.device)
        self.drafter_rows = (None if drafter is None else DrafterRows(
            drafter, config.max_batch, slots, sync=config.drafter_sync,
            backlog_capacity=slots if config.draft_backlog is None else config.draft_backlog))
        # Sibling and previous-call responses for suffix-match drafts: each generate call turns
        # the previous call's responses into history (add_history adds a caller's own).
        self.suffix_index = SuffixIndex()
        self.host = HostReader(weight.device)  # a step's one device-to-host read
        self.step_clock = StepClock(weight.device)
        on_gpu = weight.device.type == "cuda"
        # Eager or fixed-shape passes, decided here once (tlt_core.engine.passes); `graphs`
        # stays reachable for studies that capture outside a call.
        self.graphs = (StepGraphs(model, self.cache, self.rows, self.drafter_rows,
                                  capture=on_gpu, pool=config.graph_pool)
                       if (on_gpu if config.graphs is None else config.graphs) else None)
        self._passes: DecodePasses = (
            self.graphs if self.graphs is not None else
            EagerPasses(model, self.cache, self.rows, self.drafter_rows, config.graph_pool))
        self._in_call = False

    # ---- public ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], strategy: Speculation = None, *,
                 request_ids: Sequence[int] | None = None, observe: StepObserver | None = None,
                 suffix_index: SuffixIndex | None = None) -> RolloutResult:
        """Runs every request to completion.

        strategy: None (plain decoding), a DraftPlan (every step speculative), a PlanPolicy
        (asked before every step with the running batch size, told every outcome), or a function
        of the running batch size returning a DraftPlan or None. Speculation never changes what
        is sampled: outputs follow the target's distribution exactly, greedy rows token for
        token. request_ids: each request's index in a larger set (a worker's shard), used in
        records and seeds so a sample does not depend on how requests were split among workers.
        observe: told every step's StepOutcome, plain steps included. suffix_index: where
        suffix-match drafts come from and this call's responses go (default: the engine's own,
        which remembers earlier calls). The target's parameters must not change during the
        call: its packed weights are compared with them once, at the start."""
        if self._in_call:
            raise RuntimeError("generate: this engine is already running a call (from another "
                               "thread, or from a policy or observer); an engine runs one call "
                               "at a time: build another engine for concurrent calls")
        self._in_call = True
        try:
            with self.model.inference_pack_held():
                run = self._start(requests, strategy, request_ids, observe, suffix_index)
                while run.waiting or run.running:
                    self._admit(run)
                    if run.running:
                        self._step(run)
            self.step_clock.flush()  # the last steps' times, to the observers
        finally:
            self.step_clock.drop()
            self._in_call = False
        run.finished.sort(key=lambda r: (r.request_index, r.sample_index))
        return RolloutResult(run.finished, run.clock(), run.steps, tuple(run.spec_steps),
                             run.harvest_s, tuple(run.step_trace))

    def graph_memory(self) -> dict:
        """The decode graphs held (count, "pool": shared or per_graph, "reserved_bytes": what
        their captures reserved); zeros when the engine runs without graphs or on the CPU."""
        return self._passes.memory()

    # ---- the call ----------------------------------------------------------------------------

    def _start(self, requests: Sequence[Request], strategy: Speculation,
               request_ids: Sequence[int] | None, observe: StepObserver | None,
               suffix_index: SuffixIndex | None) -> _Run:
        choose = self._plan_chooser(strategy)
        told = None
        if isinstance(strategy, PlanPolicy):
            strategy.start_call()
            told = strategy.observe
        index = self.suffix_index if suffix_index is None else suffix_index
        index.new_round()
        drafting = choose is not None and self.drafter is not None
        hidden_layers = ()
        if drafting or self.harvest is not None:  # features for the drafter, and its target
            hidden_layers = self.drafter.config.feature_layers + (
                (-1,) if self.harvest is not None else ())
        waiting = deque(self._expand(requests, request_ids, index))
        self.cache.set_lengths(0)
        if self.drafter_rows is not None:
            self.drafter_rows.reset()
        plans = (strategy,) if isinstance(strategy, DraftPlan) else tuple(
            getattr(strategy, "plans", ()))  # a policy's plans, where it names them
        longest = max((len(s.prompt_ids) + s.params.max_tokens for s in waiting), default=0)
        min_tokens = any(s.params.min_tokens for s in waiting)
        self._passes.prepare(tuple(p for p in plans if drafting or not p.uses_drafter),
                             hidden_layers, len(waiting), longest + self.config.spec_reserve,
                             mask_stops=min_tokens)
        return _Run(waiting, choose, tuple(o for o in (told, observe) if o is not None), index,
                    drafting, hidden_layers, time.perf_counter(), min_tokens)

    def _admit(self, run: _Run) -> None:
        """Admit waiting samples into the free rows after the running block: prefill their
        prompts batched (right-padded; padding sits after each prompt, so causal attention
        never lets a prompt token see it) and sample their first tokens. A call admits
        samples while their padded prompts fit `prefill_tokens` (at least one), and prefills
        them in column chunks of at most that many tokens, so no prompt length can exhaust
        memory; only each row's last position gets logits."""
        admitted: list[_Sample] = []
        longest = 0
        while run.waiting and len(run.running) + len(admitted) < self.config.max_batch:
            longest_if = max(longest, len(run.waiting[0].prompt_ids))
            if admitted and longest_if * (len(admitted) + 1) > self.config.prefill_tokens:
                break
            admitted.append(run.waiting.popleft())
            longest = longest_if
        if not admitted:
            return
        first_row, count, now = len(run.running), len(admitted), run.clock()
        view = self.cache.rows(first_row, count)
        view.set_lengths(0)
        device = self.device
        lengths = [len(s.prompt_ids) for s in admitted]
        prompts = torch.zeros(count, max(lengths), dtype=torch.int64)  # (B_new, T)
        for row, sample in enumerate(admitted):
            prompts[row, :len(sample.prompt_ids)] = torch.tensor(sample.prompt_ids)
            sample.admitted_s = now
            self.rows.admit(first_row + row, sample.seed, sample.params, lengths[row])
        prompts = prompts.to(device)
        prompt_lens = torch.tensor(lengths, device=device)  # (B_new,)
        out = self._prefill(prompts, prompt_lens, lengths, view, run.hidden_layers)
        self._harvest(run, admitted, prompts, out.hidden_states, lengths)
        rows = slice(first_row, first_row + count)
        last_index = torch.arange(count, device=device), prompt_lens - 1
        if any(sample.params.min_tokens for sample in admitted):
            self.rows.mask_stops(out.logits, last_index[1][:, None], rows)
        tokens, logprobs = sample_roots(out.logits[:, 0], prompts[last_index],
                                        **self.rows.sampling(rows))
        if run.drafting:  # pairs (f_t, x_{t+1}): the prompt shifted by one, then the new token
            following = torch.cat((prompts[:, 1:], prompts[:, :1]), dim=1)  # (B_new, T)
            following[last_index] = tokens
            self.drafter_rows.follow(first_row, following, out.hidden_states, prompt_lens,
                                     lengths)
        self.rows.advance(rows, tokens, 1)
        token_list, logprob_list = self.host.read(tokens, logprobs)
        check_emitted(token_list)
        now = run.clock()
        for sample, token, logprob in zip(admitted, token_list, logprob_list):
            sample.first_token_s = now
            self._append(sample, [token], [logprob], 1)
        run.running.extend(admitted)
        self._retire(run)  # a stop id or max_tokens = 1

    def _prefill(self, prompts: torch.Tensor, prompt_lens: torch.Tensor, lengths: list[int],
                 view: KVCache, hidden_layers: tuple[int, ...]) -> ModelOutput:
        """prompts (B_new, T) right-padded into the empty rows `view`, in column chunks of at
        most prefill_tokens / B_new; returns each row's last-position logits (B_new, 1, V)
        and the requested layers' (B_new, T, H) outputs, and commits prompt_lens (`lengths`
        on the host).

        Every chunk commits its full width for every row: a row whose prompt ended earlier
        writes padding past its length, which only its own later padding sees (causal), and
        the final commit sets each row's length to its prompt's."""
        count, width = prompts.shape
        chunk = max(1, self.config.prefill_tokens // count)
        last = prompt_lens - 1  # (B_new,)
        logits = None
        hidden: list[list[torch.Tensor]] = [[] for _ in hidden_layers]
        for start in range(0, width, chunk):
            stop = min(width, start + chunk)
            positions = torch.arange(start, stop, device=prompts.device).expand(count, -1)
            # logits at each row's last prompt position if this chunk holds it, else anywhere
            at = (last.clamp(start, stop - 1) - start)[:, None]  # (B_new, 1)
            out = self.model.step(prompts[:, start:stop], positions, view,
                                  hidden_layers=hidden_layers, logit_index=at)
            ends_here = ((last >= start) & (last < stop))[:, None, None]  # (B_new, 1, 1)
            logits = out.logits if logits is None else torch.where(ends_here, out.logits, logits)
            for saved, layer in zip(hidden, out.hidden_states):
                saved.append(layer)
            view.commit(torch.full_like(prompt_lens, stop - start), host=stop - start)
        view.set_lengths(lengths)
        return ModelOutput(logits, tuple(torch.cat(parts, dim=1) for parts in hidden))

    def _step(self, run: _Run) -> None:
        """One decode step over the running rows, with the plan the policy chose for their
        number and context; then the finished rows retire."""
        batch, step = len(run.running), run.steps
        context = int(self.cache.host_lengths[:batch].sum()) // batch
        started = self.step_clock.mark()
        plan = None if run.choose is None else run.choose(batch, context)
        caught_up = started
        if plan is not None and plan.uses_drafter and self.drafter_rows.pending(batch):
            self.drafter_rows.flush(batch)  # the drafter needs every committed pair
            caught_up = self.step_clock.mark()
        if plan is None:
            kept = self._plain_step(run)
        else:
            kept = self._speculative_step(run, plan)
        ended = self.step_clock.mark()
        self._retire(run)
        run.steps += 1
        ended_s = run.clock()

        def tell(seconds: list[float]) -> None:
            outcome = StepOutcome(step, batch, context, plan, kept, sum(seconds),
                                  seconds[0] if caught_up is not started else 0.0, ended_s)
            run.step_trace.append(outcome)
            for observer in run.observers:
                observer(outcome)

        marks = (started, caught_up, ended) if caught_up is not started else (started, ended)
        self.step_clock.when_timed(marks, tell)

    def _retire(self, run: _Run) -> None:
        # Back to front, so moving the last running row into a freed one never skips a row.
        for row in range(len(run.running) - 1, -1, -1):
            if run.running[row].done is not None:
                self._finish(run, row)

    # ---- the plain step ----------------------------------------------------------------------

    def _plain_step(self, run: _Run) -> int:
        """One token per row: forward each row's root, sample the next token, commit. Returns
        the tokens kept (one per row)."""
        batch = len(run.running)
        roots = self.rows.last[:batch]  # (B,)
        sampled = self._passes.plain(batch, run.hidden_layers, run.masks_stops())
        ones = torch.ones(batch, dtype=torch.int64, device=self.device)
        self.cache.rows(0, batch).commit(ones, host=1)
        # the step's one host sync
        token_list, logprob_list = self.host.read(sampled.tokens, sampled.logprobs)
        check_emitted(token_list)
        committed = _Committed(
            counts=ones, count_list=[1] * batch, emitted=sampled.tokens[:, None],
            emitted_rows=[[token] for token in token_list],
            logprob_rows=[[logprob] for logprob in logprob_list], last=sampled.tokens,
            fed_tokens=roots[:, None], hidden=sampled.hidden)
        kept = self._commit(run, committed, drafter_next=False)
        self.step_clock.poll()  # earlier steps' times, now that the device caught up
        return kept

    # ---- the speculative step ----------------------------------------------------------------

    def _speculative_step(self, run: _Run, plan: DraftPlan) -> int:
        """Draft a tree per row, verify every tree in one target pass, accept each row's path
        and final token, commit. Returns the tokens kept (those past a stop id or max_tokens
        are dropped); the step's SpecStepStats joins run.spec_steps once its phases are timed
        (StepClock)."""
        batch, step = len(run.running), run.steps
        started = self.step_clock.mark()
        tree = self._draft(run, plan)
        drafted = self.step_clock.mark()
        verified = self._passes.verify(batch, plan, tree, run.hidden_layers, run.masks_stops())
        verified_at = self.step_clock.mark()
        committed = self._accept(verified, plan.is_chain)
        kept = self._commit(run, committed, drafter_next=plan.uses_drafter,
                            width=verified.tree.tokens.shape[1])
        done = self.step_clock.mark()
        emitted = sum(committed.count_list)
        drafted_nodes = sum(committed.node_list) - batch
        bucket_rows, bucket_emitted = bucket_counts(committed.context_list, committed.count_list)

        def record(seconds: list[float]) -> None:
            run.spec_steps.append(SpecStepStats(
                step, batch, plan.key, drafted_nodes, emitted - batch, emitted, *seconds,
                bucket_rows=bucket_rows, bucket_emitted=bucket_emitted))

        self.step_clock.when_timed((started, drafted, verified_at, done), record)
        self.step_clock.poll()
        return kept

    def _draft(self, run: _Run, plan: DraftPlan) -> ops.DraftTree:
        """Every running row's draft tree (B, N), node 0 its root (padded rows past B with
        fixed-shape passes); the drafter has caught up (_step)."""
        batch = len(run.running)
        return self._passes.draft(batch, plan, [sample.key for sample in run.running],
                                  run.suffix_index)

    def _accept(self, verified: Verified, chain: bool) -> _Committed:
        """Keeps each row's accepted path: its K/V moves next to the committed prefix
        (compaction; a chain's path is already there, its first nodes, so it is committed as
        it lies), and its tokens and target features are gathered for the commit."""
        tree, verdict = verified.tree, verified.verdict
        batch = tree.tokens.shape[0]
        counts = verdict.num_accepted.to(torch.int64) + 1  # (B,) tokens each row emits
        view = self.cache.rows(0, batch)
        context_list = view.host_lengths.tolist()  # (B,) before compaction grows them
        # The step's one host sync: what the host loop needs, every node's worth (the widths
        # are not known before it).
        count_list, node_list, emitted_rows, logprob_rows = self.host.read(
            counts, tree.num_nodes, verdict.emitted_tokens, verdict.emitted_logprobs)
        check_emitted([row[0] for row in emitted_rows])
        if chain:
            view.commit(counts, host=count_list)
        else:
            view.compact(verdict.accept_index, verdict.num_accepted,
                         host=[count - 1 for count in count_list], validate=False)
        width = max(count_list)
        path = verdict.accept_index[:, :width].clamp(min=0).long()  # (B, W) accepted nodes
        hidden = tuple(h.gather(1, path[..., None].expand(-1, -1, h.shape[-1]))
                       for h in verified.hidden)  # (B, W, H) each
        emitted = verdict.emitted_tokens[:, :width]  # (B, W)
        last = emitted.gather(1, (counts - 1)[:, None])[:, 0]  # (B,)
        return _Committed(
            counts=counts, count_list=count_list, emitted=emitted, emitted_rows=emitted_rows,
            logprob_rows=logprob_rows, last=last, fed_tokens=tree.tokens.gather(1, path),
            hidden=hidden, context_list=context_list, node_list=node_list)

    # ---- commit, shared by both steps --------------------------------------------------------

    def _commit(self, run: _Run, committed: _Committed, drafter_next: bool,
                width: int = 1) -> int:
        """Brings the drafter along (now if it drafts next, as it most likely does after a step
        it drafted; else as its sync says), appends each row's tokens to its sample up to a stop
        id or max_tokens, hands the committed positions to the harvest, and moves each row's
        root forward. width: the most tokens a row could commit (the tree's nodes). Returns the
        tokens the samples kept."""
        c = committed
        if run.drafting:
            following = c.emitted.clamp(min=0)  # (B, W); padding past a row's count
            if drafter_next:
                self._passes.catch_up(len(run.running), following, c.hidden, c.counts,
                                      c.count_list, width)
            else:
                self.drafter_rows.follow(0, following, c.hidden, c.counts, c.count_list)
        kept = [self._append(sample, tokens, logprobs, count) for sample, count, tokens, logprobs
                in zip(run.running, c.count_list, c.emitted_rows, c.logprob_rows)]
        # a position belongs to the sequence only if the token after it was kept
        self._harvest(run, run.running, c.fed_tokens, c.hidden, kept)
        self.rows.advance(slice(0, len(run.running)), c.last, c.counts)
        return sum(kept)

    # ---- helpers -----------------------------------------------------------------------------

    def _plan_chooser(self, strategy: Speculation
                      ) -> Callable[[int, int], DraftPlan | None] | None:
        """generate's strategy as a function of the running batch size and the rows' mean
        context, its plans checked."""
        if strategy is None:
            return None
        if isinstance(strategy, DraftPlan):
            self._checked(strategy)
            return lambda batch, context: strategy
        if isinstance(strategy, PlanPolicy):
            choose = strategy.choose
        elif callable(strategy):
            def choose(batch: int, context: int, of_batch=strategy) -> DraftPlan | None:
                return of_batch(batch)
        else:
            raise TypeError(f"strategy: expected None, a DraftPlan, a PlanPolicy or a function "
                            f"of the running batch size, got {strategy!r}")
        # Each plan object is checked once per call: a policy returns the same few objects,
        # and a runtime Protocol check evaluates every property of the plan.
        checked: dict[int, DraftPlan] = {}  # id -> the plan (kept here, so ids stay unique)

        def choose_checked(batch: int, context: int) -> DraftPlan | None:
            plan = choose(batch, context)
            if plan is not None and checked.get(id(plan)) is not plan:
                checked[id(plan)] = self._checked(plan)
            return plan

        return choose_checked

    def _checked(self, plan: DraftPlan | None) -> DraftPlan | None:
        if plan is None:
            return None
        if not isinstance(plan, DraftPlan):
            raise TypeError(f"strategy: expected a DraftPlan (Strategy, SuffixMatch) or None, "
                            f"got {plan!r}")
        if plan.uses_drafter and self.drafter is None:
            raise ValueError("strategy: speculative decoding with a learned drafter needs one; "
                             "build the engine with RolloutEngine(model, config, drafter), or "
                             "use SuffixMatch drafts")
        need, reserve = max(plan.num_verify_tokens, plan.fed_nodes), self.config.spec_reserve
        if need > reserve:
            raise ValueError(f"strategy: {plan.key} needs {need} cache slots past max_len; "
                             f"EngineConfig.spec_reserve is {reserve}")
        return plan

    def _harvest(self, run: _Run, samples: list[_Sample], tokens: torch.Tensor,
                 hidden: Sequence[torch.Tensor], counts: list[int]) -> None:
        """Hands a pass's committed positions to the harvest (tokens (B, W) and the outputs of
        run.hidden_layers, each (B, W, H); counts[b] positions of row b)."""
        if self.harvest is None:
            return
        start = time.perf_counter()
        features = torch.stack(tuple(hidden[:-1]), dim=2)  # (B, W, F, H)
        # tokens may view per-row state the step is about to overwrite, and a captured pass's
        # outputs are overwritten by its next replay: keep copies
        self.harvest.add_step([s.key for s in samples], tokens.clone(), features,
                              hidden[-1].clone(), counts)
        run.harvest_s += time.perf_counter() - start

    def _expand(self, requests: Sequence[Request], request_ids: Sequence[int] | None,
                suffix_index: SuffixIndex) -> list[_Sample]:
        if request_ids is not None:
            if len(request_ids) != len(requests):
                raise ValueError(f"request_ids: {len(request_ids)} ids for {len(requests)} "
                                 "requests")
            if len(set(request_ids)) != len(request_ids):
                raise ValueError("request_ids: ids must be distinct (a sample's records and "
                                 "seed are keyed by its request's id)")
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
            bad = [t for t in request.params.stop_ids if not 0 <= t < self.vocab_size]
            if bad and request.params.min_tokens:  # masked in the logits, so they must index
                raise ValueError(f"requests[{position}].params.stop_ids: token id {bad[0]} is "
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
                suffix_index.track(sample.key, sample.prompt_ids, sample.tokens)
                samples.append(sample)
        return samples

    @staticmethod
    def _append(sample: _Sample, tokens: list[int], logprobs: list[float], count: int) -> int:
        """Appends the first `count` of a step's tokens, up to a stop id or max_tokens (what a
        speculative step emits past either is dropped: plain decoding would never have
        produced it). Returns how many it kept."""
        for index in range(count):
            token = tokens[index]
            sample.tokens.append(token)
            sample.logprobs.append(logprobs[index])
            if token in sample.params.stop_ids:
                sample.done = "stop"
            elif len(sample.tokens) >= sample.params.max_tokens:
                sample.done = "length"
            if sample.done is not None:
                return index + 1
        return count

    def _finish(self, run: _Run, row: int) -> None:
        running, sample = run.running, run.running[row]
        run.finished.append(Rollout(
            sample.request_index, sample.sample_index, sample.prompt_ids,
            torch.tensor(sample.tokens, dtype=torch.int64),
            torch.tensor(sample.logprobs, dtype=torch.float32), sample.done,
            RequestTiming(sample.admitted_s, sample.first_token_s, run.clock())))
        last = len(running) - 1
        if row != last:
            self.cache.move_row(last, row)
            if run.drafting:
                self.drafter_rows.move_row(last, row)
            self.rows.move(last, row)
            running[row] = running[last]
        running.pop()
        self.cache.set_lengths(0, slice(last, last + 1))
        if run.drafting:
            self.drafter_rows.free_row(last)
        if self.harvest is not None:
            start = time.perf_counter()
            self.harvest.finish(sample.key)
            run.harvest_s += time.perf_counter() - start
