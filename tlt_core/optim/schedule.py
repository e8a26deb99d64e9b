"""The learning-rate schedule: linear warm-up, then constant or cosine decay to a floor.

With base rate lr, `warmup_steps` W and `steps` S, the rate of step s (0-based) is
    lr (s + 1) / W                                              for s < W
    lr                                                          constant, after warm-up
    lr (m + (1 - m) (1 + cos(pi p)) / 2),  p = (s - W) / (S - W)   cosine, m = min_lr_ratio
(p held at 1 past the last step). A pure function of the step, so a resumed run follows the
same schedule with nothing stored. Every trainer in tlt_core uses it: the RL driver once per RL
step (veRL's choice: the number of optimizer steps in an RL step varies with dynamic sampling
and the responses' lengths), the drafter's warm-up and the embedded model's trainings once per
optimizer step, cosine to a tenth (m = 0.1).
"""

from __future__ import annotations

import math

LR_SCHEDULERS = ("constant", "cosine")


def learning_rate(step: int, *, lr: float, steps: int, warmup_steps: int = 0,
                  scheduler: str = "constant", min_lr_ratio: float = 0.0) -> float:
    """The learning rate at `step` for base rate `lr` (module docstring)."""
    if scheduler not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler_type: must be one of {LR_SCHEDULERS}, got {scheduler!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if scheduler == "constant":
        return lr
    progress = min((step - warmup_steps) / max(steps - warmup_steps, 1), 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_multiplier(step: int, *, steps: int, warmup_steps: int = 0, scheduler: str = "constant",
                  min_lr_ratio: float = 0.0) -> float:
    """The factor on the base learning rate at `step`: `learning_rate` of a base rate of 1."""
    return learning_rate(step, lr=1.0, steps=steps, warmup_steps=warmup_steps,
                         scheduler=scheduler, min_lr_ratio=min_lr_ratio)
