"""The drafter refresh at the step boundary: every replica's weights replaced by the average of
all replicas, each weighted by the steps it trained this round.

Every replica started the round from the same weights, so this is one round of local SGD /
federated averaging; weighting by steps makes a replica count by the work it did (an unlucky
rank that never went idle, 0 steps, adds nothing), and unlike "best on held-out data" it needs
no held-out evaluation pass on the critical path. Every engine then holds the same weights; the
engines only read drafter weights inside generate(), so the switch is atomic between steps.
"""

from __future__ import annotations

import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.workers.group import WorkerGroup


def refresh(group: WorkerGroup, drafter: Drafter, steps_trained: int) -> bool:
    """Replaces every replica's weights with the step-weighted average of all replicas; False
    (and nothing changed) when no rank trained."""
    weight = torch.tensor([float(steps_trained)])
    total = float(group.all_reduce_sum(weight.clone())[0])
    if total == 0:
        return False
    with torch.no_grad():
        for param in drafter.parameters():
            summed = group.all_reduce_sum(param.detach().float() * (steps_trained / total))
            param.copy_(summed.to(param.dtype))
    return True
