"""How the new tokens of one forward attend: the mask over cache slots and where they write.

Shared by `Transformer.forward`, the packed inference pass (`tlt_core.model.packed`) and the
draft tree's levels (`tlt_core.drafting.tree`), so none can disagree on which slots a token sees: new
token i of row b is written to slot `cache.lengths[b] + before + i` and sees the row's committed
slots plus the uncommitted ones (the `before` slots an earlier pass wrote, and the new tokens)
that its `tree_mask` row allows (default causal), always including itself.
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
                   device: torch.device, before: int = 0, read_len: int | None = None
                   ) -> AttentionPlan:
    """shape (B, T) of the new tokens; cache a tlt_core.model.KVCache or None; tree_mask
    (B, T, before + T) bool or None; before: uncommitted slots written by earlier passes (the
    draft tree's previous levels), after each row's committed ones. read_len: None reads the
    slots some row uses (bounds and the room check from the cache's host mirror: no device
    read); an int reads exactly that many slots with no room check (the caller's), so the pass
    has fixed shapes and can be captured in a CUDA graph."""
    B, T = shape
    own = torch.eye(T, dtype=torch.bool, device=device)  # (T, T)
    if cache is None:
        if tree_mask is None:
            return AttentionPlan(None, None, T)
        # Every query sees at least itself: a padding token whose mask row is all False
        # would otherwise get NaN from some attention backends (zeros from others).
        return AttentionPlan((tree_mask | own)[:, None], None, T)
    span = before + T  # uncommitted slots the new tokens may see
    lengths = cache.lengths  # (B,) committed slots
    uniform = False  # every row has the same committed slots (a batch of one always does)
    if read_len is None:
        cache.check_room(span)
        read_len = cache.longest() + span
        uniform = int(cache.host_lengths.min()) == cache.longest()
    if tree_mask is None:
        allowed = torch.ones(T, span, dtype=torch.bool, device=device).tril(before)
    else:
        allowed = tree_mask.clone()  # (B, T, span)
        allowed[..., before:] |= own
    write_slots = lengths[:, None] + before + torch.arange(T, device=device)  # (B, T)
    if uniform:  # the committed slots, then `allowed`: no per-row gather (a fixed read_len
        # never comes here: its lengths change between the replays of a captured graph)
        committed = read_len - span
        mask = torch.empty(B, 1, T, read_len, dtype=torch.bool, device=device)
        mask[..., :committed] = True
        mask[..., committed:] = allowed[:, None] if allowed.dim() == 3 else allowed
        return AttentionPlan(mask, write_slots, read_len)
    rel = torch.arange(read_len, device=device) - lengths[:, None]  # (B, S) slot - lengths
    in_span = (rel >= 0) & (rel < span)  # (B, S) uncommitted slots
    index = rel.clamp(0, span - 1)[:, None, :].expand(B, T, read_len)  # (B, T, S)
    sees = allowed.expand(B, T, span).gather(2, index) & in_span[:, None]  # (B, T, S)
    mask = (rel < 0)[:, None, :] | sees  # (B, T, S): committed prefix + allowed uncommitted
    return AttentionPlan(mask[:, None], write_slots, read_len)
