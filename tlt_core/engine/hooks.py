"""The engine's extension points: who chooses each step's draft plan, who is told how the step
went, and who receives the positions the target committed.

- `PlanPolicy`: told when a generate call starts (per-call state resets there), asked before
  every decode step with the running batch size and the rows' mean context, it returns a
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
    """How one decode step went: a row of the call's step trace (RolloutResult.step_trace)."""

    step: int  # index among the call's decode steps
    batch: int  # running rows
    context: int  # the rows' mean tokens in the cache before the step
    plan: DraftPlan | None  # None: a plain step
    emitted: int  # tokens the step added to the samples (past a stop id: dropped), all rows
    # wall time of the whole step (drafting, verification, the drafter's catch-up, host reads)
    seconds: float
    # of which: the drafter catching up on positions committed while it did not draft (paid
    # by the step that turns SD on)
    catch_up_s: float = 0.0
    # the step's end on the call's host clock (seconds since the call began, the finished rows
    # retired): admissions and prefills between steps count here, not in `seconds`
    ended_s: float = 0.0

    @property
    def arm(self) -> str:
        """The plan's key; "plain" for a plain step."""
        return "plain" if self.plan is None else self.plan.key


@runtime_checkable
class PlanPolicy(Protocol):
    def start_call(self) -> None:
        """A generate call begins: reset what must not carry over from the last one."""

    def choose(self, batch: int, context: int) -> DraftPlan | None:
        """The plan for a step at this running batch size and mean row context (tokens);
        None for a plain step."""

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
