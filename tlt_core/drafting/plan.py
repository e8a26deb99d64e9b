"""A draft plan: how one speculative step proposes the tokens the target then verifies.

A plan is anything with the `DraftPlan` protocol: a stable `key` (its identity for the adaptive loop,
the cost model's tables, checkpoints and metrics: equal keys mean the same plan), the tree
nodes it asks the target to verify (`num_verify_tokens`, root included), the most draft tokens
a row can accept in one step (`depth`: the tree's depth), the drafter-cache
slots it writes past the committed prefix (`fed_nodes`), whether it needs the learned drafter
(`uses_drafter`), whether its trees are chains (`is_chain`: node i's parent is i - 1, so the
target verifies them with a causal mask and no tree mask), and `draft(context)`, which returns
the `tlt_core.ops.DraftTree` of every running row.

The plans that ship: `tlt_core.drafting.tree.Strategy` (the learned drafter's EAGLE-2 tree),
`tlt_core.drafting.sampled_chain.SampledChain` and `tlt_core.drafting.sampled_tree.SampledTree`
(the drafter's tokens sampled from its distribution, for T > 0) and
`tlt_core.drafting.suffix_match.SuffixMatch` (tokens copied from related responses). Whatever a
plan proposes, verification keeps the target's distribution exactly: a plan decides speed,
never outputs.

Shapes: B running rows, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

import tlt_core.ops as ops
from tlt_core.drafting.learned import LearnedDrafter
from tlt_core.drafting.suffix_index import SuffixIndex
from tlt_core.model.kv_cache import KVCache


@dataclass(frozen=True)
class DraftContext:
    """What a plan may draft from, for the running rows [0, B) of one step."""

    roots: torch.Tensor  # (B,) int64: each row's last committed token, the tree's root
    sequence_keys: Sequence[object]  # (B,) each row's handle in suffix_index
    suffix_index: SuffixIndex
    # The learned drafter, its cache over the B rows (every committed pair up to the root),
    # and its output at each row's last pair, (B, H): None when the step has no drafter.
    drafter: LearnedDrafter | None = None
    drafter_cache: KVCache | None = None
    root_hidden: torch.Tensor | None = None
    # The rows' sampling parameters, as the verification kernel takes them (temperature,
    # top_k, top_p, seed, offset: (B,) each), for plans that sample their drafts.
    sampling: dict | None = None
    # Drafter-cache slots every level attends over, fixed: the draft then has the same shapes
    # for any lengths and can be captured in a CUDA graph (tlt_core.engine.step_graphs; the
    # caller checked room). None: the slots some row uses.
    read_len: int | None = None


@runtime_checkable
class DraftPlan(Protocol):
    @property
    def key(self) -> str:
        """Stable identity: equal keys, the same plan."""

    @property
    def num_verify_tokens(self) -> int:
        """N: tree nodes the target verifies per row, the root included."""

    @property
    def depth(self) -> int:
        """D: the most draft tokens one row can accept in a step (its tree's depth)."""

    @property
    def fed_nodes(self) -> int:
        """Drafter-cache slots a draft writes past the committed prefix (0 without a drafter)."""

    @property
    def uses_drafter(self) -> bool:
        """Whether draft() reads the learned drafter (its cache must hold every committed pair)."""

    @property
    def is_chain(self) -> bool:
        """Whether every row's tree is a chain (node i's parent is i - 1)."""

    def draft(self, context: DraftContext) -> ops.DraftTree:
        """The (B, N) tree of every running row; node 0 is the row's root."""


@dataclass(frozen=True)
class ChainPlan:
    """The shared part of the plans that propose one chain of at most `depth` tokens per row
    (N = depth + 1); a subclass says what the chain is (key, draft, the drafter's part)."""
    depth: int  # D: the most draft tokens per row

    def __post_init__(self):
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth: must be an int >= 1, got {self.depth!r}")

    @property
    def num_verify_tokens(self) -> int:
        return self.depth + 1

    @property
    def is_chain(self) -> bool:
        return True

    def __str__(self) -> str:
        return self.key
