"""The engine's decode passes at fixed shapes (`DecodePasses`, tlt_core.engine.passes): CUDA
graphs on a GPU, the same code run eagerly on the CPU.

Four passes, each keyed by its shapes (a graph per key, in one GraphPool):
- ("plain", b, c, layers, mask_stops): the target's one-token pass and the sampling kernel;
- ("draft", b, c, plan): a learned drafter's levels for one plan (chains, trees, sampled
  chains), select_tree included;
- ("verify", b, c, N, chain, sampled, layers, mask_stops): the target's pass over N tree nodes
  and the verification kernel;
- ("catch_up", b, c, N): the drafter's pass over the pairs a speculative step committed,
  padded to N per row, before it drafts again.

b is the running batch padded up to a batch edge (powers of two, and max_batch). The rows past
the running ones are free cache rows: their passes are harmless dummies (a free row has length
0, writes only its own uncommitted slots, and its outputs are dropped). c is the cache slots
attention reads, the longest running row's context plus the pass's new tokens, padded up to a
context edge (powers of two from 128, and the cache's slots): a step at a short context does not
pay for max_len. `layers` are the target layers whose outputs the pass returns.

A pass reads the engine's persistent per-row state (RowState, the caches and their lengths,
DrafterRows) through views at fixed addresses; what a step makes anew (a tree drafted on the
host) is copied into the graph's static inputs. Outputs are valid until another pass runs: the
engine uses or copies them within the step (verify returns the tree from its own inputs, which
stay put). A first run of a key captures it, its warm-up runs executing for real: harmless, as
every pass writes only uncommitted cache slots. `capture` (from `prepare`, at a call's start)
runs every key a call may use up front, on the scratch state of an engine with no running rows.

Weights: `check_weights` refreshes the target's and the drafter's packed weights in place (what
the graphs read) and drops every graph when a pack was replaced instead (its generation
changed), to be captured again.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Hashable, Sequence

import torch

import tlt_core.ops as ops
from tlt_core.drafting.plan import DraftContext, DraftPlan
from tlt_core.drafting.suffix_index import SuffixIndex
from tlt_core.engine.graph_pool import GraphPool
from tlt_core.engine.passes import Sampled, Verified
from tlt_core.engine.sampling import sample_roots

GRAPH_POOLS = ("shared", "per_graph")
FIRST_CONTEXT_EDGE = 128


def edges(first: int, last: int) -> tuple[int, ...]:
    """Powers of two from `first` below `last`, then `last`."""
    out, edge = [], first
    while edge < last:
        out.append(edge)
        edge *= 2
    return tuple(out) + (last,)


class StepGraphs:
    def __init__(self, model, cache, rows, drafter_rows, *, capture: bool, pool: str = "shared"):
        if pool not in GRAPH_POOLS:
            raise ValueError(f"graph_pool: must be one of {GRAPH_POOLS}, got {pool!r}")
        self.model, self.cache, self.rows, self.drafter_rows = model, cache, rows, drafter_rows
        self.pool = GraphPool(cache.device, enabled=capture, share_pool=pool == "shared")
        self.pool_kind = pool
        slots = cache.shape.max_len
        self.batch_edges = edges(1, cache.shape.batch)
        self.context_edges = edges(min(FIRST_CONTEXT_EDGE, slots), slots)
        model.reserve_positions(slots)
        if drafter_rows is not None:
            drafter_rows.drafter.reserve_positions(drafter_rows.cache.shape.max_len)
        self._generation: tuple | None = None

    # ---- shapes ------------------------------------------------------------------------------

    def batch_edge(self, batch: int) -> int:
        return next(edge for edge in self.batch_edges if edge >= batch)

    def context_edge(self, slots: int) -> int:
        """The context edge holding `slots` read slots (the caller checked room: slots fit)."""
        return next(edge for edge in self.context_edges if edge >= slots)

    # ---- weights -----------------------------------------------------------------------------

    def check_weights(self) -> None:
        """Refreshes the packed weights the passes read; drops every graph if one was replaced."""
        generation = (self.model.refresh_inference(),)
        if self.drafter_rows is not None:
            generation += (self.drafter_rows.drafter.refresh_inference(),)
        if self._generation is not None and generation != self._generation:
            self.pool.clear()
        self._generation = generation

    # ---- the passes --------------------------------------------------------------------------

    def prepare(self, plans: Sequence[DraftPlan], layers: tuple[int, ...], max_batch: int,
                max_context: int, mask_stops: bool = False) -> None:
        """A call's start: the weights refreshed, and on a GPU every pass the call may run
        captured now, on scratch state (no row is running)."""
        self.check_weights()
        if max_batch and self.pool.enabled:
            self.capture(plans, layers, max_batch, max_context, mask_stops)

    def plain(self, batch: int, layers: tuple[int, ...], mask_stops: bool = False) -> Sampled:
        """The plain step's pass over rows [0, batch)."""
        b = self.batch_edge(batch)
        c = self.context_edge(self._longest(batch) + 1)

        def plain_pass():
            roots, view = self.rows.last[:b], self.cache.rows(0, b)
            out = self.model.step(roots[:, None], view.lengths[:, None], view,
                                  hidden_layers=layers, read_len=c)
            if mask_stops:
                self.rows.mask_stops(out.logits, view.lengths[:, None], slice(0, b))
            tokens, logprobs = sample_roots(out.logits[:, 0], roots,
                                            **self.rows.sampling(slice(0, b)))
            return tokens, logprobs, out.hidden_states

        tokens, logprobs, hidden = self.pool.run(("plain", b, c, layers, mask_stops), plain_pass)
        return Sampled(tokens[:batch], logprobs[:batch], tuple(h[:batch] for h in hidden))

    def draft(self, batch: int, plan: DraftPlan, keys: Sequence[Hashable],
              suffix_index: SuffixIndex) -> ops.DraftTree:
        """The plan's trees for rows [0, batch), padded to the batch edge's rows: a learned
        drafter's from its graph (over rows with no keys: the padding has none, and the drafter
        reads none), any other plan's drafted eagerly and padded (pad_tree)."""
        if not plan.uses_drafter:
            return self.pad_tree(plan.draft(DraftContext(self.rows.last[:batch], keys,
                                                         suffix_index)))
        b = self.batch_edge(batch)
        dr = self.drafter_rows
        c = self.context_edge(dr.rows(batch).longest() + plan.fed_nodes + 1)

        def draft_pass():
            return plan.draft(DraftContext(
                self.rows.last[:b], [None] * b, suffix_index, dr.drafter, dr.rows(b),
                dr.last_hidden[:b], self.rows.sampling(slice(0, b)), read_len=c))

        return self.pool.run(("draft", b, c, plan.key), draft_pass)

    def pad_tree(self, tree: ops.DraftTree) -> ops.DraftTree:
        """A tree of the running rows padded to its batch edge's rows: each padding row a lone
        root (one node)."""
        batch, N = tree.tokens.shape
        pad = self.batch_edge(batch) - batch
        if pad == 0:
            return tree
        device = tree.tokens.device
        chain = torch.arange(-1, N - 1, dtype=torch.int32, device=device).expand(pad, N)
        return ops.DraftTree(
            torch.cat((tree.tokens, tree.tokens.new_zeros(pad, N))),
            torch.cat((tree.parents, chain)),
            torch.cat((tree.source_index, chain)),
            torch.cat((tree.num_nodes, tree.num_nodes.new_ones(pad))),
            None if tree.draft_probs is None else torch.cat(
                (tree.draft_probs, tree.draft_probs[:1].expand(pad, -1, -1))))

    def verify(self, batch: int, plan: DraftPlan, tree: ops.DraftTree,
               layers: tuple[int, ...], mask_stops: bool = False) -> Verified:
        """The target's pass over draft's padded trees and the verification kernel, cut to
        rows [0, batch); the tree is the one the graph holds (stable until the next verify,
        unlike draft's)."""
        b, N = tree.tokens.shape
        c = self.context_edge(self._longest(batch) + N)
        view = self.cache.rows(0, b)
        chain, sampled = plan.is_chain, tree.draft_probs is not None
        inputs = [tree.tokens, tree.parents, tree.num_nodes]
        if not chain:
            meta = ops.tree_metadata(tree.parents, tree.num_nodes, view.lengths, validate=False)
            inputs += [meta.positions, ops.unpack_tree_mask(meta.mask, N)]
        if sampled:
            inputs.append(tree.draft_probs)

        def verify_pass(tokens, parents, num_nodes, *rest):
            if chain:
                positions = view.lengths[:, None] + torch.arange(N, device=tokens.device)
                mask = None
            else:
                positions, mask = rest[:2]
            out = self.model.step(tokens, positions, view, tree_mask=mask, hidden_layers=layers,
                                  read_len=c)
            if mask_stops:
                self.rows.mask_stops(out.logits, positions, slice(0, b))
            verdict = ops.verify_tree_sampling(
                out.logits, tokens, parents, num_nodes=num_nodes, validate=False,
                draft_probs=rest[-1] if sampled else None, **self.rows.sampling(slice(0, b)))
            return out.hidden_states, verdict

        key = ("verify", b, c, N, chain, sampled, layers, mask_stops)
        hidden, verdict = self.pool.run(key, verify_pass, *inputs)
        if key in self.pool:
            held = self.pool.static_inputs(key)
            tree = ops.DraftTree(held[0], held[1], tree.source_index, held[2],
                                 held[-1] if sampled else None)
        return Verified(_first_rows(tree, batch), _first_rows(verdict, batch),
                        tuple(h[:batch] for h in hidden))

    def catch_up(self, batch: int, following: torch.Tensor,
                 target_hidden: Sequence[torch.Tensor], counts: torch.Tensor,
                 host_counts: Sequence[int], width: int) -> None:
        """DrafterRows.extend over rows [0, batch) after a speculative step, its drafter pass
        padded to the batch edge's rows and `width` pairs (the plan's N): following (B, W),
        target_hidden (B, W, H) each, W <= width."""
        dr = self.drafter_rows
        b = self.batch_edge(batch)
        pad_rows, pad_cols = b - batch, width - following.shape[1]
        c = self.context_edge(dr.rows(batch).longest() + width)
        inputs = [torch.nn.functional.pad(t, (0, 0, 0, pad_cols, 0, pad_rows) if t.dim() == 3
                                          else (0, pad_cols, 0, pad_rows))
                  for t in (following, *target_hidden[:len(dr.drafter.config.feature_layers)])]

        def catch_up_pass(padded_following, *padded_hidden):
            return dr.run(0, padded_following, padded_hidden, read_len=c)

        hidden = self.pool.run(("catch_up", b, c, width), catch_up_pass, *inputs)
        dr.commit(0, hidden[:batch], counts, host_counts)

    # ---- capture -----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, plans: Sequence[DraftPlan], layers: tuple[int, ...], max_batch: int,
                max_context: int, mask_stops: bool = False) -> None:
        """Captures every pass a call may run, for batches up to max_batch and contexts up to
        max_context (with and without masked stops if mask_stops), on an engine with no running
        rows (scratch state: every row free). On the CPU it runs each pass once, eagerly (what
        tests exercise)."""
        top = self.batch_edge(min(max_batch, self.batch_edges[-1]))  # more samples queue
        batches = [b for b in self.batch_edges if b <= top]
        # The scratch rows' length at each context edge leaves room for every pass a plan
        # runs there: its verified nodes, and the nodes its draft feeds (a tree may feed more
        # than it verifies) plus the root.
        room = max((max(p.num_verify_tokens, p.fed_nodes + 1) for p in plans), default=1)
        suffix_index = SuffixIndex()
        for b in batches:
            for c in self.context_edges:
                length = max(0, c - 1 - room)
                if c > self.context_edge(max_context):
                    break
                self.cache.set_lengths(length if c > FIRST_CONTEXT_EDGE else 0, slice(0, b))
                for masked in (False, True)[:1 + mask_stops]:
                    self.plain(b, layers, masked)
                    for plan in plans:
                        tree = self._scratch_tree(b, plan, suffix_index)
                        self.verify(b, plan, tree, layers, masked)
                        if plan.uses_drafter and self.drafter_rows is not None:
                            self._scratch_catch_up(b, plan.num_verify_tokens)
        self.cache.set_lengths(0)
        if self.drafter_rows is not None:
            self.drafter_rows.reset()

    def _scratch_tree(self, b: int, plan: DraftPlan, suffix_index: SuffixIndex
                      ) -> ops.DraftTree:
        if plan.uses_drafter and self.drafter_rows is not None:
            self.drafter_rows.cache.set_lengths(int(self.cache.host_lengths[0]), slice(0, b))
            return self.draft(b, plan, [None] * b, suffix_index)
        N = plan.num_verify_tokens
        device = self.cache.device
        chain = torch.arange(-1, N - 1, dtype=torch.int32, device=device).expand(b, N)
        return ops.DraftTree(torch.zeros(b, N, dtype=torch.int64, device=device),
                             chain.contiguous(), chain.contiguous(),
                             torch.full((b,), N, dtype=torch.int32, device=device), None)

    def _scratch_catch_up(self, b: int, width: int) -> None:
        dr, device = self.drafter_rows, self.cache.device
        weight = self.model.model.embed_tokens.weight
        hidden = torch.zeros(b, width, weight.shape[1], dtype=weight.dtype, device=device)
        self.catch_up(b, torch.zeros(b, width, dtype=torch.int64, device=device),
                      [hidden] * len(dr.drafter.config.feature_layers),
                      torch.ones(b, dtype=torch.int64, device=device), [1] * b, width)

    def memory(self) -> dict:
        """The graphs and the memory their captures reserved."""
        return {"graphs": len(self.pool), "pool": self.pool_kind,
                "reserved_bytes": self.pool.reserved_bytes}

    def _longest(self, batch: int) -> int:
        return self.cache.rows(0, batch).longest()


def _first_rows(record, batch: int):
    """A record of (B, ...) tensors (DraftTree, VerifyOutput) cut to its first `batch` rows."""
    return type(record)(*(None if value is None else value[:batch] for value in
                          (getattr(record, f.name) for f in fields(record))))
