"""Mixed-precision training of the policy: bf16 (or fp16) weights, float32 master weights.

The policy keeps one set of weights in its own dtype, and the rollout engine decodes from
exactly those: the log-probs a rollout records and the ones the trainer recomputes come from the
same numbers (autocast would instead train float32 weights that the engine never decodes with,
or cast them on every op). Gradients arrive in the weights' dtype; AdamW runs on float32 copies
(its moments and small updates would round away in bf16: an update below 2^-8 of a weight is
lost), and the rounded result is written back into the policy's weights in place, so the
engine's packed copy sees the change through the version counter. For float32 policies this is
plain AdamW, step for step.

Memory per parameter: the weight (2 bytes in bf16), its gradient (2), the float32 master (4) and
AdamW's two moments (8).
"""

from __future__ import annotations

from typing import Iterable

import torch


class MasterWeightAdamW:
    """AdamW over float32 masters of `parameters` (the same tensors when they are float32)."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], **adamw):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.parameters)
        if self.mixed:
            self.masters = [p.detach().float().clone().requires_grad_(True)
                            for p in self.parameters]
        else:
            self.masters = self.parameters
        self.optimizer = torch.optim.AdamW(self.masters, **adamw)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (the schedule sets it every RL step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None
        if self.mixed:
            for m in self.masters:
                m.grad = None

    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clips the gradients to `max_grad_norm` (their norm in float32), steps AdamW, writes
        the masters back into the weights; returns the norm before clipping."""
        if self.mixed:
            for p, m in zip(self.parameters, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, max_grad_norm)
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.parameters, self.masters):
                    p.copy_(m)
        return float(norm)

    def state_dict(self) -> dict:
        state = {"adamw": self.optimizer.state_dict()}
        if self.mixed:
            state["masters"] = [m.detach() for m in self.masters]
        return state

    def load_state_dict(self, state: dict) -> None:
        if ("masters" in state) != self.mixed:
            raise ValueError("optimizer: the checkpoint was saved with "
                             f"{'mixed' if 'masters' in state else 'float32'} precision, this "
                             "policy is " + ("mixed" if self.mixed else "float32"))
        self.optimizer.load_state_dict(state["adamw"])
        if self.mixed:
            with torch.no_grad():
                for p, m, saved in zip(self.parameters, self.masters, state["masters"]):
                    m.copy_(saved)
                    p.copy_(saved)
