"""The engine's decode passes behind one interface, so the engine decides once, at construction,
how they run: `EagerPasses` at the running batch's own shapes (the readable truth), or
`tlt_core.engine.step_graphs.StepGraphs` at fixed shapes, replayed from CUDA graphs on a GPU
(held to the eager passes by tests/test_step_graphs.py).

`DecodePasses`, what a step runs over the running rows [0, batch):
- `prepare(plans, layers, max_batch, max_context, mask_stops)`: at a call's start, before any
  row runs;
- `plain(batch, layers, mask_stops)`: the target's one-token pass and the sampling kernel ->
  `Sampled`;
- `draft(batch, plan, keys, suffix_index)`: the plan's trees (the caller flushed the drafter's
  backlog when the plan uses it);
- `verify(batch, plan, tree, layers, mask_stops)`: the target's pass over `draft`'s trees
  (causal for chains, tree-masked otherwise) and the verification kernel -> `Verified`;
  mask_stops: some row is still short of its min_tokens, so the logits get RowState.mask_stops
  before the kernel (both passes, so plain and speculative steps sample the same distribution);
- `catch_up(batch, following, target_hidden, counts, host_counts, width)`: the drafter's pass
  over the pairs a speculative step committed (DrafterRows.extend), before it drafts again;
- `memory()`: the graphs held and what their captures reserved.

The passes read and write the engine's persistent per-row state (RowState, the KV cache,
DrafterRows); they own none of it. Their outputs are valid until the next pass: the engine uses
or copies them within the step.

Shapes: B running rows, N tree nodes, W committed pairs per row, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch

import tlt_core.ops as ops
from tlt_core.drafting.plan import DraftContext, DraftPlan
from tlt_core.drafting.suffix_index import SuffixIndex
from tlt_core.engine.drafter_rows import DrafterRows
from tlt_core.engine.rows import RowState
from tlt_core.engine.sampling import sample_roots
from tlt_core.model.kv_cache import KVCache
from tlt_core.model.transformer import Transformer


@dataclass(frozen=True)
class Sampled:
    """A plain pass over the running rows."""

    tokens: torch.Tensor  # (B,) int64: each row's next token
    logprobs: torch.Tensor  # (B,) float32: its target log-prob
    hidden: tuple[torch.Tensor, ...]  # (B, 1, H) the outputs of the requested layers


@dataclass(frozen=True)
class Verified:
    """A verification pass over the running rows' trees."""

    tree: ops.DraftTree  # (B, N) the trees verified
    verdict: ops.VerifyOutput  # each row's accepted path and final token
    hidden: tuple[torch.Tensor, ...]  # (B, N, H) the outputs of the requested layers


class DecodePasses(Protocol):
    def prepare(self, plans: Sequence[DraftPlan], layers: tuple[int, ...], max_batch: int,
                max_context: int, mask_stops: bool = False) -> None:
        """A call's start: it runs `plans` over at most max_batch rows of at most max_context
        slots, returning `layers`, masking stops in some steps if mask_stops; no row is
        running."""

    def plain(self, batch: int, layers: tuple[int, ...], mask_stops: bool = False) -> Sampled:
        """Forward each row's root, sample its next token."""

    def draft(self, batch: int, plan: DraftPlan, keys: Sequence[Hashable],
              suffix_index: SuffixIndex) -> ops.DraftTree:
        """The trees verify takes (keys: each row's handle in suffix_index)."""

    def verify(self, batch: int, plan: DraftPlan, tree: ops.DraftTree,
               layers: tuple[int, ...], mask_stops: bool = False) -> Verified:
        """The target's pass over draft's trees and the verification kernel's verdict."""

    def catch_up(self, batch: int, following: torch.Tensor,
                 target_hidden: Sequence[torch.Tensor], counts: torch.Tensor,
                 host_counts: Sequence[int], width: int) -> None:
        """The drafter follows the pairs a step committed: following (B, W) the tokens,
        target_hidden (B, W, H) each, counts (B,) (host_counts on the host), W <= width (the
        plan's N)."""

    def memory(self) -> dict:
        """"graphs" held, "pool" (shared or per_graph), "reserved_bytes" their captures took."""


class EagerPasses:
    """Every pass at the running batch's own shapes: nothing captured, nothing padded."""

    def __init__(self, model: Transformer, cache: KVCache, rows: RowState,
                 drafter_rows: DrafterRows | None, pool: str):
        self.model, self.cache, self.rows, self.drafter_rows = model, cache, rows, drafter_rows
        self.pool_kind = pool

    def prepare(self, plans: Sequence[DraftPlan], layers: tuple[int, ...], max_batch: int,
                max_context: int, mask_stops: bool = False) -> None:
        """Nothing to capture, and an eager pass checks the packed weights it reads itself."""

    def plain(self, batch: int, layers: tuple[int, ...], mask_stops: bool = False) -> Sampled:
        view, roots = self.cache.rows(0, batch), self.rows.last[:batch]  # roots (B,)
        if layers:  # the features too, for the drafter or the harvest
            out = self.model.step(roots[:, None], view.lengths[:, None], view,
                                  hidden_layers=layers)
            logits, hidden = out.logits[:, 0], out.hidden_states  # (B, V), (B, 1, H) each
        else:
            logits, hidden = self.model.next_token_logits(roots, view), ()  # (B, V)
        if mask_stops:
            self.rows.mask_stops(logits[:, None], view.lengths[:, None], slice(0, batch))
        tokens, logprobs = sample_roots(logits, roots, **self.rows.sampling(slice(0, batch)))
        return Sampled(tokens, logprobs, hidden)

    def draft(self, batch: int, plan: DraftPlan, keys: Sequence[Hashable],
              suffix_index: SuffixIndex) -> ops.DraftTree:
        roots = self.rows.last[:batch]  # (B,)
        if not plan.uses_drafter:
            return plan.draft(DraftContext(roots, keys, suffix_index))
        dr = self.drafter_rows
        return plan.draft(DraftContext(roots, keys, suffix_index, dr.drafter, dr.rows(batch),
                                       dr.last_hidden[:batch],
                                       self.rows.sampling(slice(0, batch))))

    def verify(self, batch: int, plan: DraftPlan, tree: ops.DraftTree,
               layers: tuple[int, ...], mask_stops: bool = False) -> Verified:
        N = tree.tokens.shape[1]
        view = self.cache.rows(0, batch)
        if plan.is_chain:  # node i sees nodes 0..i: the causal mask
            positions = view.lengths[:, None] + torch.arange(N, device=tree.tokens.device)
            tree_mask = None
        else:
            meta = ops.tree_metadata(tree.parents, tree.num_nodes, view.lengths, validate=False)
            positions, tree_mask = meta.positions, ops.unpack_tree_mask(meta.mask, N)  # (B, N)
        out = self.model.step(tree.tokens, positions, view, tree_mask=tree_mask,
                              hidden_layers=layers)  # logits (B, N, V)
        if mask_stops:
            self.rows.mask_stops(out.logits, positions, slice(0, batch))
        verdict = ops.verify_tree_sampling(
            out.logits, tree.tokens, tree.parents, num_nodes=tree.num_nodes, validate=False,
            draft_probs=tree.draft_probs, **self.rows.sampling(slice(0, batch)))
        return Verified(tree, verdict, out.hidden_states)

    def catch_up(self, batch: int, following: torch.Tensor,
                 target_hidden: Sequence[torch.Tensor], counts: torch.Tensor,
                 host_counts: Sequence[int], width: int) -> None:
        self.drafter_rows.extend(0, following, target_hidden, counts, host_counts)

    def memory(self) -> dict:
        return {"graphs": 0, "pool": self.pool_kind, "reserved_bytes": 0}
