"""Sampled trees: K draws from the drafter's distribution after the root, each the first token of
its own sampled chain, verified together by the sampled-draft rule (multi-draft recursion).

Why: a sampled chain's first token is accepted with 1 - TV(p, q) (tlt_core.drafting.
sampled_chain), and every deeper token only counts when it was. With K i.i.d. first tokens the
verifier tries them in turn against the residual max(0, p - q) left by each rejection (SpecInfer's
recursive rejection sampling, the kernel's sampled-draft rule), so the first level is accepted
with 1 - prod_k (1 - a_k) instead of a_1, and each accepted branch brings its chain along. At
T = 1 on a small model, where p is flat and a_1 well below 1, that raises the tokens per step for
(D - 1) K more verified nodes, which cost little while a step is bound by reading the weights.

Lossless for the same reason as the chain: each first token is drawn i.i.d. from the root's q
(draft_probs at the root), each deeper token from its parent's q, and the kernel is handed
exactly those distributions. Two equal first tokens are allowed (the second is then rejected
with certainty: a rejected x leaves no residual mass at x); they cost a branch, never
correctness. Greedy rows (T = 0) draw the argmax K times: correct, and no better than the chain.

Layout: node 0 the root; level j (1..D) branch i is node 1 + (j - 1) K + i, whose parent is node
1 + (j - 2) K + i (the root for j = 1), siblings in draw order. Drafter-cache bookkeeping as in
tlt_core.drafting.tree: the K nodes fed at level j (1 <= j < D) are written to slots
lengths + (j - 1) K + i at position lengths + j - 1 and see the committed prefix plus their own
branch's earlier nodes. Randomness: Philox draws on the drafting stream (DRAFT_STREAM), one per
drafted token.

Shapes: B rows, D depth, K branches, N = 1 + K D nodes, V' draft vocabulary, V target
vocabulary, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tlt_core.ops as ops
from tlt_core.drafting.plan import DraftContext
from tlt_core.drafting.sampled_chain import DRAFT_STREAM, check_sampled_context, draw
from tlt_core.model.attention_plan import attention_plan


@dataclass(frozen=True)
class SampledTree:
    """K sampled chains of D tokens per row that share the root."""

    depth: int  # D: the most draft tokens one row can accept in a step
    branches: int  # K: first tokens drawn after the root (K = 1 is SampledChain)

    def __post_init__(self):
        for name, least in (("depth", 1), ("branches", 2)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: must be an int >= {least}, got {value!r}")
        most = ops._C.max_tree_nodes
        if self.num_verify_tokens > most:
            raise ValueError(f"branches: {self.branches} branches of depth {self.depth} make "
                             f"{self.num_verify_tokens} nodes, more than the verifier's {most}")

    @property
    def key(self) -> str:
        return f"sampled({self.depth},{self.branches})"

    @property
    def num_verify_tokens(self) -> int:
        return 1 + self.branches * self.depth

    @property
    def fed_nodes(self) -> int:
        return self.branches * (self.depth - 1)

    @property
    def uses_drafter(self) -> bool:
        return True

    @property
    def is_chain(self) -> bool:
        return False

    def draft(self, context: DraftContext) -> ops.DraftTree:
        check_sampled_context(self.key, context)
        return sampled_tree(context, self.depth, self.branches)

    def __str__(self) -> str:
        return self.key


def sampled_tree(context: DraftContext, depth: int, branches: int) -> ops.DraftTree:
    drafter, cache, roots = context.drafter, context.drafter_cache, context.roots
    B, K, device = roots.shape[0], branches, roots.device
    fed = K * (depth - 1)
    if cache.longest() + fed > cache.shape.max_len:  # host mirror: no sync
        raise ValueError(f"strategy: sampled({depth},{K}) drafts {fed} nodes past the drafter "
                         f"cache's {cache.shape.max_len} slots; raise the engine's spec_reserve")
    sampling = context.sampling
    temperature = sampling["temperature"].to(torch.float32)  # (B,)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # (B,)
    uniforms = ops.philox_uniforms(sampling["seed"], sampling["offset"] + DRAFT_STREAM,
                                   K * depth).view(B, depth, K)  # one per drafted token
    N, vocab = 1 + K * depth, drafter.target.config.vocab_size
    draft_probs = torch.empty(B, N, vocab, dtype=torch.float32, device=device)
    draft_probs[:, N - K:] = 1.0 / vocab  # the leaves: never read

    def sample(level: int, logits: torch.Tensor, first: int) -> torch.Tensor:
        """logits (B, R, V') at R nodes (nodes first..first + R - 1): K draws from each when
        R = 1 (the root), one from each otherwise -> (B, K) target ids; writes their q."""
        R = logits.shape[1]
        return draw(drafter, logits, uniforms[:, level].view(B, R, -1), greedy, scale,
                    draft_probs[:, first:first + R]).view(B, K)

    levels = [sample(0, drafter.logits(context.root_hidden)[:, None], 0)]  # level 1: (B, K)
    hidden = context.root_hidden[:, None].expand(B, K, -1)  # (B, K, H): what level 1 is fed with
    ancestors = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
    own = ancestors
    for level in range(1, depth):  # feed level `level`'s K nodes, draw level + 1's
        plan = attention_plan((B, K), cache, ancestors, device, before=(level - 1) * K,
                              read_len=context.read_len)
        positions = (cache.lengths + level - 1)[:, None].expand(B, K)
        hidden = drafter(levels[-1], hidden, positions, cache, plan=plan)  # (B, K, H)
        levels.append(sample(level, drafter.logits(hidden), 1 + (level - 1) * K))
        ancestors = torch.cat((ancestors, own), dim=2)  # each branch sees its own nodes
    branch = torch.arange(K, dtype=torch.int32, device=device)
    parents = torch.cat([torch.full((1,), -1, dtype=torch.int32, device=device),
                         torch.zeros(K, dtype=torch.int32, device=device)]
                        + [1 + (level - 1) * K + branch for level in range(1, depth)])
    return ops.DraftTree(torch.cat([roots[:, None]] + levels, 1),
                         parents.expand(B, N).contiguous(),
                         torch.arange(-1, N - 1, dtype=torch.int32, device=device)
                         .expand(B, N).contiguous(),
                         torch.full((B,), N, dtype=torch.int32, device=device),
                         draft_probs)
