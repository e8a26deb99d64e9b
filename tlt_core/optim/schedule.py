"""The learning-rate schedule, per RL step: linear warm-up, then constant or cosine decay.

With base rate lr, `warmup_steps` W and `steps` S, the rate of step s (0-based) is
    lr (s + 1) / W                                              for s < W
    lr                                                          constant, after warm-up
    lr (m + (1 - m) (1 + cos(pi p)) / 2),  p = (s - W) / (S - W)   cosine, m = min_lr_ratio
A pure function of the step, so a resumed run follows the same schedule with nothing stored.
Stepping once per RL step (not per optimizer step) is veRL's choice: the number of optimizer
steps in a step varies with dynamic sampling and the responses' lengths.
"""

from __future__ import annotations

import math

LR_SCHEDULERS = ("constant", "cosine")


def lr_multiplier(step: int, *, steps: int, warmup_steps: int = 0, scheduler: str = "constant",
                  min_lr_ratio: float = 0.0) -> float:
    """The factor on the base learning rate at `step` (module docstring)."""
    if scheduler not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler_type: must be one of {LR_SCHEDULERS}, got {scheduler!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(steps - warmup_steps, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
