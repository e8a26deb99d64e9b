"""Typed results of the tree ops. Every field is an array of the caller's kind (torch tensor,
NumPy or CuPy array) on the caller's device. Shapes: B rows, N tree nodes, W = ceil(N / 32)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftTree:
    """A selected draft tree: node 0 is the root, parents[b, i] < i, siblings by draft score."""

    tokens: Any  # (B, N) int64; 0 on padding nodes
    parents: Any  # (B, N) int32; -1 for the root and padding nodes
    source_index: Any  # (B, N) int32; candidate each node came from, -1 for root / padding
    num_nodes: Any  # (B,) int32; valid nodes per row, root included
    # (B, N, V) float32: node v's children were sampled from draft_probs[b, v] (the sampled-
    # draft rule of verify_tree_sampling); None: deterministic drafts (top-k, one-hot q)
    draft_probs: Any = None


@dataclass(frozen=True)
class TreeMetadata:
    """What a tree-masked target forward needs."""

    depths: Any  # (B, N) int32
    positions: Any  # (B, N) int64; cache_len + depth
    mask: Any  # (B, N, W) int32; bit j of row i: node j is node i or one of its ancestors


@dataclass(frozen=True)
class VerifyOutput:
    """One verification step. A row commits num_accepted + 1 tokens: the accepted draft tokens,
    then the final (bonus or corrected) token."""

    accept_index: Any  # (B, N) int32; accepted path, root (0) first, -1 after
    num_accepted: Any  # (B,) int32; accepted draft nodes
    emitted_tokens: Any  # (B, N) int64; -1 after the emitted tokens
    emitted_logprobs: Any  # (B, N) float32; target log-prob of each emitted token, 0 after
