"""Random draft trees and target logits for kernel-vs-reference sweeps. Seeded, so every test
that uses them is deterministic."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeCase:
    logits: torch.Tensor  # (B, N, V) float32
    tokens: torch.Tensor  # (B, N) int64
    parents: torch.Tensor  # (B, N) int32
    num_nodes: torch.Tensor  # (B,) int32


def random_tree_case(seed: int, batch: int, n_max: int, vocab: int, *, ragged: bool = True,
                     accept_bias: float = 6.0, chain: bool = False, ties: bool = False) -> TreeCase:
    """Random trees whose target logits favour one child's token at most nodes, so paths of
    several accepted tokens occur; `ties` quantises logits so argmax / top-k ties happen."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, n_max), -1, dtype=torch.int32)
    tokens = torch.randint(0, vocab, (batch, n_max), generator=g)
    num_nodes = torch.full((batch,), n_max, dtype=torch.int32)
    if ragged:
        num_nodes = torch.randint(1, n_max + 1, (batch,), generator=g, dtype=torch.int32)
    for b in range(batch):
        for i in range(1, n_max):
            parents[b, i] = i - 1 if chain else int(torch.randint(0, i, (1,), generator=g))
        tokens[b, int(num_nodes[b]):] = 0
        parents[b, int(num_nodes[b]):] = -1
    logits = torch.randn(batch, n_max, vocab, generator=g) * 2.0
    if ties:
        logits = torch.round(logits)
    for b in range(batch):
        for i in range(1, int(num_nodes[b])):
            if float(torch.rand(1, generator=g)) < 0.7:
                logits[b, parents[b, i], tokens[b, i]] += accept_bias
    return TreeCase(logits, tokens, parents, num_nodes)
