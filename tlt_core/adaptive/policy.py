"""The adaptive rollout loop: one decision over measured truth, per step.

An `AdaptivePolicy` is a `tlt_core.engine.PlanPolicy`. Its arms are plain decoding and every SD
plan; its cells are (running-batch bucket x context-length bucket) (`StepBuckets`). Before each
step it picks the arm with the most committed tokens per second at the step's batch and
context, by the loop's own steps in that cell (`ArmTable`: wall time of the whole step,
drafting, verification and host reads included). Calibration (`CostModel`) only predicts how
each arm's rate varies with batch and context (where it timed nothing, a benchmark's measured
rates can stand in: `fallback_model`, tlt_core.adaptive.measured_plans); the loop's own steps
set the level, and overrule it. After each step the engine tells it the `StepOutcome`, which
goes into the table.

Never worse by construction:
- the call's mode (plain or SD) follows evidence, not predictions: it turns to SD only once the
  best SD arm's lower confidence bound has beaten plain decoding's estimate for `hysteresis`
  consecutive steps (turning SD on makes the drafter catch up on every position committed
  while it was off, tlt_core.engine.DrafterRows, which that step pays); it turns back at once
  when the best SD arm's upper bound falls below plain's estimate, else after `hysteresis`
  steps that prefer plain. Within SD the best plan runs (switching plans is free);
- while SD is the mode, plain decoding is measured first in every cell it speculates in
  (BASELINE_STEPS steps, kept in the table across calls), so turning back compares two
  measurements;
- every other arm is an exploration: tried only while its upper confidence bound beats the
  estimate of the arm the mode would run, and only when the cell's exploration budget covers
  the step's worst case: each step in a cell adds `tolerance` (3%) of its seconds to the
  budget, each exploration spends what it lost against that arm (the seconds it took minus
  the seconds that arm needs for the same tokens), and a drafter catch-up spends its seconds.
  So a favourable calibration alone can cost no more than the budget, what exploring costs in
  a cell stays within `tolerance` of the time the cell took, and exploration dies out as the
  bounds tighten. The policy's first speculative step (in RL training, the process's first),
  which pays one-time costs, is charged to the budget but kept out of the table;
- per generate call (`start_call`): the mode and its hysteresis count. Carried across calls:
  the table, so one RL step's measurements are the next one's prior, and the exploration
  budgets, so a cell the tail visits for a few steps per call can still afford a trial.
There is no threshold to latch: a batch bucket at max_batch is a cell like any other.

Outputs do not depend on any of this: every plan is verified losslessly, so the policy only
decides how fast the same distribution is sampled (greedy: the same tokens).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

from tlt_core.adaptive.arm_table import ArmTable, Estimate
from tlt_core.adaptive.buckets import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, StepBuckets
from tlt_core.adaptive.calibration_cache import CalibrationCache
from tlt_core.adaptive.cost_model import CostModel, calibrate
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.tree import Strategy
from tlt_core.engine.engine import RolloutEngine
from tlt_core.engine.hooks import StepOutcome
from tlt_core.engine.records import Request

# Sampled chains (tlt_core.drafting.sampled_chain): at T > 0 their tokens are accepted with
# 1 - TV(target, drafter) instead of the target's probability of an argmax token. The short
# ones are for a few rows, where a step verifying 7 tokens a row is already bound by the
# arithmetic on a CPU (SmolLM2 at T = 1 on 2 cores: sampled(3) 1.27x plain at 4 rows, sampled(4)
# 1.07x; docs/results.md).
SAMPLED_PLANS = (SampledChain(2), SampledChain(3), SampledChain(4), SampledChain(6))
DEFAULT_PLANS = (Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(6, 1, 7), Strategy(8, 1, 9),
                 Strategy(4, 2, 8), Strategy(6, 4, 16))
PLAIN = 0  # the arm index of plain decoding
UNMEASURED_STEP_FACTOR = 3.0  # an unmeasured arm's step, in the best arm's steps (worst case)
CONTEXT_GRAIN = 16  # tokens of context a prediction is held for (a step's cost barely moves)
# Plain steps a cell measures before SD runs there as the mode: without them plain decoding's
# estimate in the cell is a prediction and a ratio borrowed from other batch sizes, and the
# mode's switch back to plain would compare measured SD against a guess. Carried in the table,
# so a cell pays them once, not per call.
BASELINE_STEPS = 2

# tokens per second of a plan (None: plain decoding) at a running batch and mean context
Predict = Callable[[int, int, Optional[DraftPlan]], float]


def builtin_plans(temperature: float, sampled_drafts: bool) -> tuple[DraftPlan, ...]:
    """The adaptive loop's built-in plans for rollouts at `temperature`: the sampled chains
    alone at T > 0 under sampled_drafts, else the deterministic chains and trees.

    At T > 0 the deterministic plans only cost the loop: their draft tokens are accepted with
    the target's probability of them, so beside sampled chains they lose (SmolLM2 at T = 1,
    one row: (5,4,16) 0.74x plain, (5,4,12) 0.84x, sampled chains 1.2-1.5x), and every one
    the loop explores, or calibration times, spends seconds on a plan it will not run. At
    T = 0 a sampled chain is the deterministic chain of its depth."""
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    return SAMPLED_PLANS if sampled_drafts and temperature > 0 else DEFAULT_PLANS


def flat(batch: int, context: int, plan: DraftPlan | None) -> float:
    """No prediction: every arm alike until measured (plain first on ties)."""
    return 1.0


@dataclass
class AdaptiveStats:
    spec_steps: int = 0
    plain_steps: int = 0
    explorations: int = 0  # steps of an arm other than the best, to measure it
    switches: int = 0  # plain <-> SD mode changes
    catch_up_s: float = 0.0  # the drafter's catch-ups, paid by the steps that turned SD on

    @property
    def sd_on_share(self) -> float:
        total = self.spec_steps + self.plain_steps
        return self.spec_steps / total if total else 0.0


@dataclass(frozen=True)
class _Choice:
    cell: int
    arm: int
    explored: bool
    exploit_rate: float  # the estimate of the arm the mode would have run (tokens / s)
    predicted: float  # the chosen arm's predicted rate at the step (tokens / s)


class AdaptivePolicy:
    def __init__(self, plans: Sequence[DraftPlan], buckets: StepBuckets = StepBuckets(),
                 table: ArmTable | None = None, *, predict: Predict = flat, hysteresis: int = 8,
                 tolerance: float = 0.03, confidence: float = 1.0,
                 cost_model: CostModel | None = None):
        self.plans = tuple(plans)
        if not self.plans:
            raise ValueError("plans: need at least one draft plan to adapt over")
        keys = [plan.key for plan in self.plans]
        if len(set(keys)) != len(keys):
            raise ValueError(f"plans: duplicate keys in {keys}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis: must be an int >= 1 (steps), got {hysteresis!r}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance: must be in [0, 1), got {tolerance}")
        if confidence < 0:
            raise ValueError(f"confidence: must be >= 0, got {confidence}")
        self.arms: tuple[DraftPlan | None, ...] = (None,) + self.plans
        self.buckets = buckets
        shape = (len(buckets.batch_edges), len(buckets.context_edges) + 1, len(self.arms))
        self.table = table if table is not None else ArmTable(*shape)
        if (self.table.groups, self.table.columns, self.table.arms) != shape:
            raise ValueError(f"table: has {self.table.groups} x {self.table.columns} cells x "
                             f"{self.table.arms} arms; the buckets have {shape[0]} x {shape[1]} "
                             f"cells and the policy {shape[2]} arms (plain and the plans)")
        self.hysteresis, self.tolerance, self.confidence = hysteresis, tolerance, confidence
        self.cost_model = cost_model
        self.predict = lru_cache(maxsize=4096)(predict)  # a few (batch, context) per step
        self.stats = AdaptiveStats()
        self._arm = {plan.key: index + 1 for index, plan in enumerate(self.plans)}
        self._budget = [0.0] * buckets.cells  # exploration seconds each cell may spend
        self._drafted = False  # whether a speculative step has been observed
        self.start_call()

    @classmethod
    def from_calibration(cls, engine: RolloutEngine, plans: Sequence[DraftPlan] = DEFAULT_PLANS,
                         calibration_requests: Sequence[Request] = (), *,
                         batch_edges: Sequence[int] = DEFAULT_BATCH_EDGES,
                         context_edges: Sequence[int] = DEFAULT_CONTEXT_EDGES,
                         window: int = 32, prior_weight: float = 2.0, hysteresis: int = 8,
                         tolerance: float = 0.03, max_tokens: int = 16,
                         fallback_model: CostModel | None = None,
                         cache: CalibrationCache | None = None) -> AdaptivePolicy:
        """Calibrates engine's step costs (CostModel) on calibration_requests at every other
        batch edge up to max_batch, and builds the policy on them (from_cost_model): the cost
        model predicts each arm's rate at a step's batch and context, fallback_model where
        calibration timed no batch. cache: read the calibration from there when an earlier
        run stored this one, else store it there."""
        plans = tuple(plans)
        if not plans:
            raise ValueError("plans: need at least one draft plan to adapt over")
        if engine.drafter is None:
            plans = tuple(p for p in plans if not p.uses_drafter)
            if not plans:
                raise ValueError("plans: an engine without a drafter can only use plans that "
                                 "need none (SuffixMatch)")
        max_batch = engine.config.max_batch
        StepBuckets.covering(max_batch, batch_edges, context_edges)  # bad edges fail first
        edges = [min(edge, max_batch) for edge in batch_edges if edge < max_batch] + [max_batch]
        # calibrate at every other edge and the largest (rates are interpolated between)
        measured = sorted(set(edges[::2]) | {max_batch})
        model = (cache.calibrate if cache is not None else calibrate)(
            engine, plans, measured, calibration_requests, max_tokens=max_tokens)
        return cls.from_cost_model(model, plans, max_batch, batch_edges=batch_edges,
                                   context_edges=context_edges, window=window,
                                   prior_weight=prior_weight, hysteresis=hysteresis,
                                   tolerance=tolerance, fallback_model=fallback_model)

    @classmethod
    def from_cost_model(cls, model: CostModel, plans: Sequence[DraftPlan], max_batch: int, *,
                        batch_edges: Sequence[int] = DEFAULT_BATCH_EDGES,
                        context_edges: Sequence[int] = DEFAULT_CONTEXT_EDGES,
                        window: int = 32, prior_weight: float = 2.0, hysteresis: int = 8,
                        tolerance: float = 0.03, fallback_model: CostModel | None = None
                        ) -> AdaptivePolicy:
        """A policy predicting with a cost model already measured (one calibration shared by
        several policies on engines of the same model and config). fallback_model: the
        prediction where `model` timed no batch (a benchmark's rates for every plan:
        tlt_core.adaptive.measured_plans); with neither, no prediction: every arm alike until
        measured."""
        buckets = StepBuckets.covering(max_batch, batch_edges, context_edges)
        table = ArmTable(len(buckets.batch_edges), len(buckets.context_edges) + 1,
                         len(plans) + 1, window=window, prior_weight=prior_weight)
        predictor = model if model.batches else fallback_model

        def predict(batch: int, context: int, plan: DraftPlan | None) -> float:
            return max(predictor.rate(batch, plan, context), 1e-9)

        return cls(plans, buckets, table,
                   predict=predict if predictor is not None and predictor.batches else flat,
                   hysteresis=hysteresis, tolerance=tolerance, cost_model=model)

    # ---- PlanPolicy --------------------------------------------------------------------------

    def start_call(self) -> None:
        self._sd: bool | None = None  # the mode; None until the call's first step
        self._pending = 0  # consecutive steps that preferred the other mode
        self._chosen: deque[_Choice] = deque()  # choices whose outcomes are still to come

    def choose(self, batch: int, context: int) -> DraftPlan | None:
        cell = self.buckets.cell(batch, context)
        near = context - context % CONTEXT_GRAIN  # the prediction's cache hits 15 steps of 16
        predicted = [self.predict(batch, near, plan) for plan in self.arms]
        estimates = [self.table.estimate(cell, arm, predicted[arm])
                     for arm in range(len(self.arms))]
        exploit = self._exploit(estimates)
        arm = self._explore(cell, estimates, exploit)
        explored = arm is not None
        if arm is None:
            arm = exploit
        self._chosen.append(_Choice(cell, arm, explored, estimates[exploit].rate,
                                    predicted[arm]))
        self.stats.explorations += explored
        if arm == PLAIN:
            self.stats.plain_steps += 1
        else:
            self.stats.spec_steps += 1
        return self.arms[arm]

    def observe(self, outcome: StepOutcome) -> None:
        choice = self._chosen.popleft() if self._chosen else None
        arm = PLAIN if outcome.plan is None else self._arm.get(outcome.plan.key)
        if choice is None or arm != choice.arm:
            return  # not a step this policy chose
        measured_s = outcome.seconds - outcome.catch_up_s
        # The policy's first speculative step (in RL training, the process's first) pays
        # one-time costs besides the catch-up (on SmolLM2 at 32 rows, 2-5x a steady step; a
        # later switch from plain to SD, none): to the budget, not the table, which would lend
        # that rate to every cell where the arm has not run.
        first_draft = arm != PLAIN and not self._drafted
        self._drafted |= arm != PLAIN
        if measured_s > 0 and not first_draft:
            self.table.add(choice.cell, arm, outcome.emitted, measured_s, choice.predicted)
        budget = self.tolerance * outcome.seconds - outcome.catch_up_s
        if choice.explored and choice.exploit_rate > 0:
            budget -= measured_s - outcome.emitted / choice.exploit_rate
        # saved up to one worst-case trial: exploration spreads out instead of bursting after
        # a long quiet stretch (the budget carries from call to call)
        cap = UNMEASURED_STEP_FACTOR * (self.table.mean_step_s(choice.cell, arm)
                                        or outcome.seconds)
        self._budget[choice.cell] = min(self._budget[choice.cell] + budget, cap)
        self.stats.catch_up_s += outcome.catch_up_s

    # ---- the decision ------------------------------------------------------------------------

    def _explore(self, cell: int, estimates: list[Estimate], exploit: int) -> int | None:
        """The arm worth measuring now, if any: the highest upper bound above the estimate of
        the arm the loop would run (`exploit`) whose worst-case loss the cell's budget
        covers."""
        exploit_rate = estimates[exploit].rate
        if exploit_rate <= 0:
            return None
        if exploit != PLAIN and self.table.steps(cell, PLAIN) < BASELINE_STEPS:
            return PLAIN  # the mode's baseline, measured in every cell it speculates in
        bounds = [e.bound(self.confidence, self.table.prior_weight) for e in estimates]
        candidates = [arm for arm in range(len(self.arms))
                      if arm != exploit and bounds[arm][1] > exploit_rate]
        if not candidates:
            return None
        arm = max(candidates, key=lambda a: bounds[a][1])
        step_s = self.table.mean_step_s(cell, arm)
        if step_s is None:
            exploit_step = self.table.mean_step_s(cell, exploit)
            if exploit_step is None:
                return None  # nothing measured here yet: no basis for a worst case
            step_s = UNMEASURED_STEP_FACTOR * exploit_step
        worst_loss = step_s * max(0.0, 1.0 - max(bounds[arm][0], 0.0) / exploit_rate)
        return arm if self._budget[cell] >= worst_loss else None

    def _exploit(self, estimates: list[Estimate]) -> int:
        """The best arm within the call's mode. The mode turns to SD only on evidence: once the
        best SD arm's lower confidence bound has beaten plain decoding's estimate for
        `hysteresis` consecutive steps (the call's first step needs no wait); a prediction
        alone, however favourable, is tried through exploration, which the budget bounds. It
        turns back to plain at once when the best SD arm's upper bound falls below plain's
        estimate, else after `hysteresis` steps whose estimates prefer plain."""
        sd_best = max(range(1, len(self.arms)), key=lambda arm: (estimates[arm].rate, -arm))
        lower, upper = estimates[sd_best].bound(self.confidence, self.table.prior_weight)
        plain_rate = estimates[PLAIN].rate
        if self._sd is None:
            self._sd = lower > plain_rate
        elif not self._sd:
            self._pending = self._pending + 1 if lower > plain_rate else 0
        elif upper < plain_rate:
            self._pending = self.hysteresis
        else:
            self._pending = self._pending + 1 if plain_rate > estimates[sd_best].rate else 0
        if self._pending >= self.hysteresis:
            self._sd, self._pending = not self._sd, 0
            self.stats.switches += 1
        return sd_best if self._sd else PLAIN

    # ---- reading and checkpoints -------------------------------------------------------------

    def best(self, batch: int, context: int) -> DraftPlan | None:
        """The arm the table believes best at this batch and context (no exploration, no
        hysteresis): None for plain decoding."""
        cell = self.buckets.cell(batch, context)
        rates = [self.table.estimate(cell, arm, self.predict(batch, context, plan)).rate
                 for arm, plan in enumerate(self.arms)]
        return self.arms[max(range(len(self.arms)), key=lambda arm: (rates[arm], -arm))]

    def sd_batch_max(self, context: int = 0) -> int:
        """The largest batch-bucket edge whose best arm at `context` is an SD plan (0: none):
        where the table would speculate, for reports."""
        edges = [edge for edge in self.buckets.batch_edges if self.best(edge, context) is not None]
        return max(edges, default=0)

    def state_dict(self) -> dict:
        return {"arms": ["plain", *self._arm], "table": self.table.state_dict(),
                "budget": list(self._budget)}

    def load_state_dict(self, state: dict) -> None:
        arms = ["plain", *self._arm]
        if list(state.get("arms", [])) != arms:
            raise ValueError(f"state: saved for arms {state.get('arms')}, this policy has {arms}")
        budget = [float(seconds) for seconds in state["budget"]]
        if len(budget) != self.buckets.cells or not all(map(math.isfinite, budget)):
            raise ValueError(f"state: 'budget' must be {self.buckets.cells} finite numbers")
        self.table.load_state_dict(state["table"])
        self._budget = budget
