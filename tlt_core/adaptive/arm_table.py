"""What the adaptive loop has measured: how each arm's committed tokens per second compare with
what was predicted for it, per cell.

Arms are plain decoding (arm 0) and the SD plans; cells are `StepBuckets` cells, `groups` x
`columns` of them (batch buckets x context buckets). A prediction (the calibrated cost model:
tokens per second of an arm at a batch and context) gives the shape; the table learns the
level. Each (cell, arm) keeps its last `window` steps as (tokens committed, tokens predicted
for the step's seconds at its own batch and context, seconds), and the estimate at a step is the
prediction there times the ratio of sums. Normalising each step by its own batch matters:
within a batch bucket (16 to 32 rows, say) the rate of every arm still grows with the batch,
and the loop meets a bucket's larger batches first, so raw rates would compare one arm's
early steps with another's late ones.

A cell where an arm has not run takes its ratio from the nearest group where it has (the
cell's own first, then the larger batch bucket before the smaller): a calibration that is
wrong is wrong alike in neighbouring cells (its requests are not the workload's), and a
rollout's batch only falls, so a cell the loop enters for the first time starts from what the
bucket above it taught. An SD arm that ran nowhere yet borrows the pooled ratio of the SD arms
that ran (one drafter's acceptance, misjudged alike), else plain decoding's. The
ratio counts as `prior_weight` steps; its spread is the per-step
ratios' standard deviation, or `prior_spread` while fewer than two steps are measured.

The table outlives a generate call: what one RL step measured is the next step's prior, and
the window forgets what a since-retrained drafter did. State is plain lists (checkpoints).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# a prediction's relative standard deviation before the loop measures: calibration runs other
# requests, and acceptance on them can be off by half (1.31 against 2.10 measured on SmolLM2)
PRIOR_SPREAD = 0.5


@dataclass(frozen=True)
class Estimate:
    rate: float  # tokens per second
    spread: float  # standard deviation of one step's rate
    steps: int  # measured steps in the window

    def bound(self, z: float, prior_weight: float) -> tuple[float, float]:
        """(lower, upper) confidence bound: rate -+ z x spread / sqrt(steps + prior_weight)."""
        width = z * self.spread / math.sqrt(self.steps + max(prior_weight, 1e-9))
        return self.rate - width, self.rate + width


class ArmTable:
    def __init__(self, groups: int, columns: int, arms: int, *, window: int = 32,
                 prior_weight: float = 2.0, prior_spread: float = PRIOR_SPREAD):
        if groups < 1 or columns < 1 or arms < 1:
            raise ValueError(f"groups, columns, arms: need at least one of each, got {groups}, "
                             f"{columns}, {arms}")
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window: must be an int >= 2, got {window!r}")
        if not (math.isfinite(prior_weight) and prior_weight >= 0):
            raise ValueError(f"prior_weight: must be finite and >= 0, got {prior_weight}")
        self.groups, self.columns, self.arms = groups, columns, arms
        self.cells, self.window = groups * columns, window
        self.prior_weight, self.prior_spread = float(prior_weight), float(prior_spread)
        self._steps = [[deque(maxlen=window) for _ in range(arms)] for _ in range(self.cells)]
        self._sum_groups()

    def _sum_groups(self) -> None:
        """Per (group, arm), over every windowed step: tokens committed and predicted."""
        self._measured = [[0.0] * self.arms for _ in range(self.groups)]
        self._predicted = [[0.0] * self.arms for _ in range(self.groups)]
        for cell in range(self.cells):
            for arm in range(self.arms):
                for step in self._steps[cell][arm]:
                    self._count(cell, arm, *step, 1)

    def _count(self, cell: int, arm: int, tokens: float, predicted: float, _seconds: float,
               sign: int) -> None:
        group = cell // self.columns
        self._measured[group][arm] += sign * tokens
        self._predicted[group][arm] += sign * predicted

    def add(self, cell: int, arm: int, tokens: int, seconds: float, predicted_rate: float
            ) -> None:
        """One step of `arm` in `cell`: `tokens` committed in `seconds` (> 0), where the
        prediction was `predicted_rate` tokens per second (> 0)."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds: a step takes a finite time > 0, got {seconds}")
        if not (math.isfinite(predicted_rate) and predicted_rate > 0):
            raise ValueError(f"predicted_rate: must be finite and > 0, got {predicted_rate}")
        steps = self._steps[cell][arm]
        if len(steps) == steps.maxlen:  # the oldest leaves the window, and the group sums
            self._count(cell, arm, *steps[0], -1)
        step = (float(tokens), predicted_rate * seconds, float(seconds))
        steps.append(step)
        self._count(cell, arm, *step, 1)

    def steps(self, cell: int, arm: int) -> int:
        return len(self._steps[cell][arm])

    def mean_step_s(self, cell: int, arm: int) -> float | None:
        """The mean duration of the arm's measured steps in the cell; None if none."""
        steps = self._steps[cell][arm]
        return sum(s for _, _, s in steps) / len(steps) if steps else None

    def group_ratio(self, cell: int, arm: int) -> float:
        """Measured over predicted tokens in the nearest group where the arm ran; for an SD
        arm that ran nowhere, the SD arms' pooled (they share a drafter, so a calibration that
        misjudged its acceptance misjudged it for all of them); for plain decoding, or when no
        SD arm ran either, plain decoding's (the machine is as much faster or slower than
        predicted for every arm), else 1."""
        sd_arms = range(1, self.arms) if arm else ()
        for arms in ((arm,), sd_arms, (0,)):
            ratio = self._nearest_ratio(cell // self.columns, arms)
            if ratio is not None:
                return ratio
        return 1.0

    def _nearest_ratio(self, group: int, arms) -> float | None:
        """The arms' pooled measured over predicted tokens in the nearest group where any of
        them ran (the same distance: the larger batch bucket first); None where none ran."""
        for distance in range(self.groups):
            for near in (group + distance, group - distance) if distance else (group,):
                if 0 <= near < self.groups:
                    predicted = sum(self._predicted[near][a] for a in arms)
                    if predicted > 0:
                        return sum(self._measured[near][a] for a in arms) / predicted
        return None

    def estimate(self, cell: int, arm: int, predicted_rate: float) -> Estimate:
        """The arm's rate at a step in `cell` whose prediction is `predicted_rate`."""
        steps = self._steps[cell][arm]
        prior = self.group_ratio(cell, arm)
        if not steps:
            return Estimate(predicted_rate * prior,
                            predicted_rate * prior * self.prior_spread, 0)
        tokens = sum(t for t, _, _ in steps)
        predicted = sum(p for _, p, _ in steps)
        weight = self.prior_weight * predicted / len(steps)  # the prior as that many steps
        ratio = (prior * weight + tokens) / (weight + predicted)
        if len(steps) < 2:
            return Estimate(predicted_rate * ratio,
                            predicted_rate * max(ratio, prior) * self.prior_spread, 1)
        ratios = [t / p for t, p, _ in steps]
        mean = sum(ratios) / len(ratios)
        spread = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1))
        return Estimate(predicted_rate * ratio, predicted_rate * spread, len(steps))

    def state_dict(self) -> dict:
        return {"groups": self.groups, "columns": self.columns, "arms": self.arms,
                "window": self.window,
                "steps": [[[list(step) for step in arm] for arm in cell]
                          for cell in self._steps]}

    def load_state_dict(self, state: dict) -> None:
        shape = (state.get("groups"), state.get("columns"), state.get("arms"))
        if shape != (self.groups, self.columns, self.arms):
            raise ValueError(f"state: saved for {shape[0]} x {shape[1]} cells x {shape[2]} "
                             f"arms, this table has {self.groups} x {self.columns} x "
                             f"{self.arms}")
        steps = [[deque((tuple(float(v) for v in step) for step in arm), maxlen=self.window)
                  for arm in cell] for cell in state["steps"]]
        if len(steps) != self.cells or any(len(cell) != self.arms for cell in steps):
            raise ValueError("state: its steps do not match its cells x arms")
        if any(len(step) != 3 or not all(map(math.isfinite, step)) or step[0] < 0
               or step[1] <= 0 or step[2] <= 0 for cell in steps for arm in cell for step in arm):
            raise ValueError("state: steps must be (tokens >= 0, predicted > 0, seconds > 0), "
                             "finite")
        self._steps = steps
        self._sum_groups()
