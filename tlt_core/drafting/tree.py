"""Draft trees: a strategy's shape, and growing the tree with the learned drafter (EAGLE-2
style). `Strategy` is the draft plan (tlt_core.drafting.plan) of the learned drafter.

A strategy (depth D, top-k K, num_verify_tokens N) drafts D levels: level 1 is the K most likely
tokens after the root; each later level feeds the K best nodes of the level before (by
cumulative draft log-prob) through the drafter and takes each one's K most likely children.
Every node drafted is a candidate; `ops.select_tree` keeps the N - 1 best (ancestor-closed), and
the target verifies root + those in one tree-masked pass. Chain drafting is K = 1, N = D + 1.

The drafts are deterministic (top-k, not sampled), so the verification kernel's deterministic-
draft rule keeps the result exactly the target's distribution whatever the drafter says.

Drafter-cache bookkeeping: the nodes fed at level j (1 <= j < D) are written to uncommitted
slots lengths + (j - 1) K + i at position lengths + j - 1 and see the committed prefix plus
their own ancestors among the fed nodes. Nothing is committed here; the engine's catch-up pass
after verification overwrites those slots with the accepted path recomputed from the target's
own features.

Shapes: B rows, K top-k, H hidden size, V vocabulary, M candidates, S drafter slots read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import tlt_core.ops as ops
from tlt_core.drafting.learned import LearnedDrafter
from tlt_core.drafting.plan import DraftContext
from tlt_core.model.attention_plan import AttentionPlan, attention_plan
from tlt_core.model.kv_cache import KVCache


@dataclass(frozen=True)
class Strategy:
    depth: int  # D: drafter levels
    topk: int  # K: children per expanded node, and nodes expanded per level
    num_verify_tokens: int  # N: tree nodes the target verifies, root included

    def __post_init__(self):
        for name in ("depth", "topk", "num_verify_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        most = min(self.candidates + 1, ops._C.max_tree_nodes)
        if not self.num_verify_tokens <= most:  # 1: the root alone, a plain step through SD
            raise ValueError(
                f"num_verify_tokens: must be in [1, {most}] for depth {self.depth} and topk "
                f"{self.topk} (the root plus at most the {self.candidates} nodes drafted), got "
                f"{self.num_verify_tokens}")

    @property
    def candidates(self) -> int:
        """M: nodes drafted, K at level 1 and K * K at each later level."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def fed_nodes(self) -> int:
        """Drafter cache slots a draft writes beyond the committed prefix."""
        return (self.depth - 1) * self.topk

    @property
    def key(self) -> str:
        return f"({self.depth},{self.topk},{self.num_verify_tokens})"

    @property
    def uses_drafter(self) -> bool:
        return True

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def draft(self, context: DraftContext) -> ops.DraftTree:
        if context.drafter is None:
            raise ValueError(f"strategy: {self.key} drafts with the learned drafter, and this "
                             "step has none")
        return draft_tree(context.drafter, context.drafter_cache, context.roots,
                          context.root_hidden, self, context.read_len)

    def __str__(self) -> str:
        return self.key


def draft_tree(drafter: LearnedDrafter, cache: KVCache, roots: torch.Tensor,
               root_hidden: torch.Tensor, strategy: Strategy, read_len: int | None = None
               ) -> ops.DraftTree:
    """The tree to verify for each row. cache: the drafter's cache over the B rows (pairs up
    to the root committed); roots (B,) int64 the root tokens; root_hidden (B, H) the drafter's
    output at its last committed pair (whose logits give the tokens after the root);
    read_len: DraftContext.read_len."""
    B, K = roots.shape[0], strategy.topk
    device = roots.device
    if K > drafter.vocab_size:
        raise ValueError(f"strategy: topk {K} exceeds the draft vocabulary "
                         f"({drafter.vocab_size})")
    lengths = cache.lengths
    shortest, longest = int(cache.host_lengths.min()), cache.longest()  # host mirror: no sync
    if longest + strategy.fed_nodes > cache.shape.max_len:
        raise ValueError(f"strategy: {strategy} drafts {strategy.fed_nodes} nodes past the "
                         f"drafter cache's {cache.shape.max_len} slots; raise the engine's "
                         "spec_reserve")
    if K == 1:
        return _draft_chain(drafter, cache, roots, root_hidden, strategy, shortest == longest,
                            longest, read_len)
    scores, tokens = torch.log_softmax(drafter.logits(root_hidden), -1).topk(K, dim=-1)  # (B, K)
    tokens = drafter.to_target_ids(tokens)
    cand_tokens, cand_scores = [tokens], [scores]
    cand_parents = [torch.full((B, K), -1, dtype=torch.int32, device=device)]
    frontier = tokens, scores, root_hidden[:, None].expand(B, K, -1)  # level 1: (B, K), (B, K, H)
    frontier_ids = torch.arange(K, device=device).expand(B, K)  # candidate index of each
    num_candidates = K
    # (B, K, fed): which of the fed nodes each frontier node sees (its ancestors and itself)
    ancestors = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
    for level in range(1, strategy.depth):
        tokens, scores, features = frontier
        fed_before = (level - 1) * K
        plan = attention_plan((B, K), cache, ancestors, device, before=fed_before,
                              read_len=read_len)
        positions = (lengths + level - 1)[:, None].expand(B, K)
        hidden = drafter(tokens, features, positions, cache, plan=plan)  # (B, K, H)
        child_scores, child_tokens = torch.log_softmax(drafter.logits(hidden), -1).topk(K, dim=-1)
        child_tokens = drafter.to_target_ids(child_tokens)
        total = (scores[..., None] + child_scores).view(B, K * K)  # cumulative log q
        cand_tokens.append(child_tokens.view(B, K * K))
        cand_scores.append(total)
        cand_parents.append(frontier_ids.repeat_interleave(K, dim=1).to(torch.int32))
        if level + 1 < strategy.depth:  # the next level expands the K best children
            best_scores, best = total.topk(K, dim=-1)  # (B, K)
            parent = best // K  # which fed node each comes from
            frontier = (child_tokens.view(B, K * K).gather(1, best), best_scores,
                        hidden.gather(1, parent[..., None].expand(B, K, hidden.shape[-1])))
            inherited = ancestors.gather(1, parent[..., None].expand(B, K, ancestors.shape[-1]))
            own = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
            ancestors = torch.cat((inherited, own), dim=2)  # (B, K, fed + K)
            frontier_ids = num_candidates + best
        num_candidates += K * K
    return ops.select_tree(torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1),
                           torch.cat(cand_parents, 1), roots, strategy.num_verify_tokens,
                           validate=False)


def _draft_chain(drafter: LearnedDrafter, cache: KVCache, roots: torch.Tensor,
                 root_hidden: torch.Tensor, strategy: Strategy, uniform: bool, longest: int,
                 read_len: int | None) -> ops.DraftTree:
    """draft_tree for K = 1, without the tree bookkeeping: level j's node is candidate j - 1,
    the child of candidate j - 2 (grown by chain_levels, each level's argmax)."""
    B, depth, device = roots.shape[0], strategy.depth, roots.device
    # When every drafted node is verified, scores only need to fall with depth; otherwise
    # select_tree keeps the best prefix by cumulative log q.
    exact = strategy.num_verify_tokens - 1 < depth
    scores: list[torch.Tensor] = []  # (B, 1) cumulative log q per level, when exact

    def argmax(level: int, logits: torch.Tensor) -> torch.Tensor:  # logits (B, V')
        score, index = (torch.log_softmax(logits, -1) if exact else logits).max(-1, keepdim=True)
        if exact:
            scores.append(score if level == 0 else scores[-1] + score)
        return drafter.to_target_ids(index)

    tokens = chain_levels(drafter, cache, root_hidden, depth, uniform, longest, argmax, read_len)
    if not exact:
        scores = [-torch.arange(depth, dtype=torch.float32, device=device).expand(B, depth)]
    parents = torch.arange(-1, depth - 1, dtype=torch.int32, device=device).expand(B, depth)
    return ops.select_tree(torch.cat(tokens, 1), torch.cat(scores, 1), parents, roots,
                           strategy.num_verify_tokens, validate=False)


def chain_levels(drafter: LearnedDrafter, cache: KVCache, root_hidden: torch.Tensor,
                 depth: int, uniform: bool, longest: int,
                 pick: Callable[[int, torch.Tensor], torch.Tensor],
                 read_len: int | None = None) -> list[torch.Tensor]:
    """A chain of `depth` draft tokens per row: level 0's from the drafter's output at the root
    (root_hidden (B, H)), each later level's from feeding the previous token through the
    drafter. pick(level, logits (B, V')) -> (B, 1) target ids chooses each level's token (an
    argmax, or a sample). Level j's node is written to drafter-cache slot lengths + j - 1 at
    that position and sees every slot before it, with no mask at all when the rows have equal
    lengths (`uniform`; `longest` is the longest row's committed length) unless read_len
    (DraftContext.read_len) fixes the slots read."""
    B, lengths, device = root_hidden.shape[0], cache.lengths, root_hidden.device
    tokens, hidden = [], root_hidden[:, None]  # (B, 1, H)
    for level in range(depth):
        if level > 0:
            slots = lengths[:, None] + (level - 1)  # (B, 1): where it is written = its position
            plan = (AttentionPlan(None, slots, longest + level) if uniform and read_len is None
                    else attention_plan((B, 1), cache, None, device, before=level - 1,
                                        read_len=read_len))
            hidden = drafter(tokens[-1], hidden, slots, cache, plan=plan)  # (B, 1, H)
        tokens.append(pick(level, drafter.logits(hidden[:, 0])))
    return tokens
