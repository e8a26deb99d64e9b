"""The engine's extension points: who chooses each step's draft plan, who is told how the step
went, and who receives the positions the target committed.

- `PlanPolicy`: asked before every decode step with the running batch size, it returns a
  `tlt_core.drafting.DraftPlan` (speculate with it) or None (a plain step); after the step it is
  told the `StepOutcome`. `tlt_core.adaptive.AdaptivePolicy` is one.
- A plain function `batch -> DraftPlan | None` is a policy that wants no feedback.
- A `StepObserver` is told every step's outcome, whatever chose the plan, plain decoding
  included (calibration and progress displays use it).
- A `HarvestSink` receives every committed position's target features, in position order, and
  the end of every sequence (`tlt_core.workers.HarvestBuffer` is one: the drafter's training
  data, at no extra target pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from tlt_core.drafting.plan import DraftPlan


@dataclass(frozen=True)
class StepOutcome:
    """How one decode step went."""

    batch: int  # running rows
    plan: DraftPlan | None  # None: a plain step
    emitted: int  # tokens the step committed, summed over rows
    seconds: float  # wall time of the step


@runtime_checkable
class PlanPolicy(Protocol):
    def choose(self, batch: int) -> DraftPlan | None:
        """The plan for a step at this running batch size; None for a plain step."""

    def observe(self, outcome: StepOutcome) -> None:
        """How the step it chose went."""


StepObserver = Callable[[StepOutcome], None]
# What generate() is told about speculation: never (None), always one plan, a policy with
# feedback, or a function of the running batch size.
Speculation = Union[None, DraftPlan, PlanPolicy, Callable[[int], Optional[DraftPlan]]]


class HarvestSink(Protocol):
    def add_step(self, keys: Sequence[Hashable], tokens: torch.Tensor, features: torch.Tensor,
                 last_hidden: torch.Tensor, counts: Sequence[int]) -> None:
        """Positions one target pass committed: row b of tokens (B, W), features (B, W, F, H)
        and last_hidden (B, W, H) holds counts[b] positions of sequence keys[b], in order."""

    def finish(self, key: Hashable) -> None:
        """Sequence `key` is complete."""
