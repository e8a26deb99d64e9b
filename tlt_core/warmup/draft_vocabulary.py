"""Phase 2 of the warm-up: the draft vocabulary V', the V' token ids the responses use most,
stop ids always included (FR-Spec / EAGLE-3's d2t: a drafting level's LM head then costs V'/V).
Only response positions count: the prompts are the user's, the responses what the drafter
proposes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tlt_core.drafting.training import DraftRecord


def draft_vocabulary(records: list[DraftRecord], prompt_lengths: list[int], size: int | None,
                     stop_ids: Sequence[int], vocab: int) -> torch.Tensor | None:
    """The `size` ids the responses use most (ties to the lower id), stop ids always in; fewer
    when the responses use fewer distinct ids. None: no reduced vocabulary."""
    if size is None:
        return None
    counts = torch.zeros(vocab, dtype=torch.int64)
    for record, start in zip(records, prompt_lengths):
        counts += torch.bincount(record.tokens[start:], minlength=vocab)
    used = int((counts > 0).sum())
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = set(order[:min(size, used)].tolist())
    for stop in stop_ids:
        if stop not in chosen:
            chosen.discard(int(order[len(chosen) - 1]))  # the least used goes
            chosen.add(int(stop))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def coverage(records: list[DraftRecord], prompt_lengths: list[int], ids: torch.Tensor) -> float:
    inside = total = 0
    for record, start in zip(records, prompt_lengths):
        response = record.tokens[start:]
        inside += int(torch.isin(response, ids).sum())
        total += response.numel()
    return inside / max(total, 1)
