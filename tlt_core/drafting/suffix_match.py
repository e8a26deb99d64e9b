"""`SuffixMatch(depth)`: the draft plan that copies tokens instead of drafting them with a model.

For each row, `SuffixIndex.propose` finds the row's last n-gram in a sibling response (same
prompt, this rollout) or an earlier response to the same prompt, and proposes up to `depth`
tokens that followed it; the row's tree is the chain root -> those tokens, `depth + 1` nodes
verified. A row with no match is verified alone (a plain step through the verifier). No model
pass, no drafter cache written; the target verifies with the same lossless kernels as learned
drafts (a deterministic chain), so a wrong proposal only costs its verification.

Shapes: B running rows, N = depth + 1 tree nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tlt_core.ops as ops
from tlt_core.drafting.plan import ChainPlan, DraftContext


@dataclass(frozen=True)
class SuffixMatch(ChainPlan):
    """At most D tokens per row, copied from a sibling or earlier response (module docstring)."""

    @property
    def key(self) -> str:
        return f"suffix({self.depth})"

    @property
    def fed_nodes(self) -> int:
        return 0  # the drafter's cache is not written

    @property
    def uses_drafter(self) -> bool:
        return False

    def draft(self, context: DraftContext) -> ops.DraftTree:
        """Each row's chain of copied tokens, padded to N nodes (padding nodes have parent -1
        and lie past num_nodes)."""
        roots = context.roots
        batch, N = roots.shape[0], self.num_verify_tokens
        tokens = torch.zeros(batch, N, dtype=torch.int64)  # (B, N)
        num_nodes = torch.ones(batch, dtype=torch.int32)  # (B,)
        for row, key in enumerate(context.sequence_keys):
            proposal = context.suffix_index.propose(key, self.depth)
            if proposal:
                tokens[row, 1:1 + len(proposal)] = torch.tensor(proposal)
                num_nodes[row] = 1 + len(proposal)
        parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(batch, N).clone()  # (B, N)
        parents[torch.arange(N)[None] >= num_nodes[:, None]] = -1  # padding nodes
        device = roots.device
        tokens = tokens.to(device)
        tokens[:, 0] = roots
        parents = parents.to(device)
        # node i is proposal token i - 1: its source index is its parent's
        return ops.DraftTree(tokens, parents, parents.clone(), num_nodes.to(device))
