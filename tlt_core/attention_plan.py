"""How the new tokens of one forward attend: the mask over cache slots and where they write.

Shared by `Transformer.forward` and the packed inference pass (`tlt_core.decode`), so the two can
never disagree on which slots a token sees: new token i of row b is written to slot
`cache.lengths[b] + i` and sees the row's committed slots plus the new tokens its `tree_mask`
row allows (default causal), always including itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionPlan:
    """How every layer of one forward attends; built once per forward."""

    mask: torch.Tensor | None  # (B, 1, T, S) bool, True = may attend; None = causal over T
    write_slots: torch.Tensor | None  # (B, T) int64 cache slot of each new token; None = no cache
    read_len: int  # S: cache slots read, max(lengths) + T


def attention_plan(shape: torch.Size | tuple[int, int], cache, tree_mask: torch.Tensor | None,
                   device: torch.device) -> AttentionPlan:
    """shape (B, T) of the new tokens; cache a tlt_core.kv_cache.KVCache or None; tree_mask
    (B, T, T) bool or None."""
    B, T = shape
    own = torch.eye(T, dtype=torch.bool, device=device)  # (T, T)
    if cache is None:
        if tree_mask is None:
            return AttentionPlan(None, None, T)
        # Every query sees at least itself: a padding token whose mask row is all False
        # would otherwise get NaN from some attention backends (zeros from others).
        return AttentionPlan((tree_mask | own)[:, None], None, T)
    cache.check_room(torch.full((B,), T, dtype=torch.int64))
    lengths = cache.lengths  # (B,) committed slots
    # One host sync: read only the slots some row uses, not all of T_max.
    read_len = int(lengths.max()) + T
    allowed = (torch.ones(T, T, dtype=torch.bool, device=device).tril() if tree_mask is None
               else tree_mask) | own  # (B or 1, T, T)
    rel = torch.arange(read_len, device=device) - lengths[:, None]  # (B, S) slot - lengths
    is_new = (rel >= 0) & (rel < T)  # (B, S) slots this pass writes
    new_index = rel.clamp(0, T - 1)[:, None, :].expand(B, T, read_len)  # (B, T, S)
    sees_new = allowed.expand(B, T, T).gather(2, new_index) & is_new[:, None]  # (B, T, S)
    mask = (rel < 0)[:, None, :] | sees_new  # (B, T, S): committed prefix + allowed new
    write_slots = lengths[:, None] + torch.arange(T, device=device)  # (B, T)
    return AttentionPlan(mask[:, None], write_slots, read_len)
