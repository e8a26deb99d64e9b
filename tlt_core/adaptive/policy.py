"""The adaptive rollout loop: SD only where it pays, the draft plan chosen per batch bucket.

An `AdaptivePolicy` is a `tlt_core.engine.PlanPolicy`: before each step it asks the SD switch
whether to speculate at this running batch size and, if so, the bandit which plan (learned-
drafter shapes, suffix-match drafts); after each step the engine tells it the `StepOutcome`,
whose tokens emitted per second are the bandit's reward. `from_calibration` builds one whose
switch threshold and bandit priors come from a cost model measured on this engine at start;
where calibration could time nothing (see `tlt_core.adaptive.cost_model`), the switch stays
off and the bandit, never asked, keeps no priors.

Outputs do not depend on any of this: every plan is verified losslessly, so the policy only
decides how fast the same distribution is sampled (greedy: the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tlt_core.adaptive.bandit import DEFAULT_BUCKET_EDGES, PlanBandit
from tlt_core.adaptive.cost_model import CostModel, calibrate
from tlt_core.adaptive.sd_switch import SDSwitch
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.tree import Strategy
from tlt_core.engine.engine import RolloutEngine
from tlt_core.engine.hooks import StepOutcome
from tlt_core.engine.records import Request

# Sampled chains (tlt_core.drafting.sampled_chain): at T > 0 their tokens are accepted with
# 1 - TV(target, drafter) instead of the target's probability of an argmax token.
SAMPLED_PLANS = (SampledChain(4), SampledChain(6))
DEFAULT_PLANS = (Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(6, 1, 7), Strategy(8, 1, 9),
                 Strategy(4, 2, 8), Strategy(6, 4, 16))


@dataclass
class AdaptiveStats:
    spec_steps: int = 0
    plain_steps: int = 0

    @property
    def sd_on_share(self) -> float:
        total = self.spec_steps + self.plain_steps
        return self.spec_steps / total if total else 0.0


class AdaptivePolicy:
    def __init__(self, plans: Sequence[DraftPlan], switch: SDSwitch,
                 bandit: PlanBandit | None = None, cost_model: CostModel | None = None):
        self.plans = tuple(plans)
        self.switch = switch
        self.bandit = bandit if bandit is not None else PlanBandit(self.plans)
        if [arm.key for arm in self.bandit.arms] != [plan.key for plan in self.plans]:
            raise ValueError("bandit: its arms must be the policy's plans, in order")
        self.cost_model = cost_model
        self.stats = AdaptiveStats()
        self._arm = {plan.key: index for index, plan in enumerate(self.plans)}

    @classmethod
    def from_calibration(cls, engine: RolloutEngine, plans: Sequence[DraftPlan] = DEFAULT_PLANS,
                         calibration_requests: Sequence[Request] = (), *,
                         bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
                         epsilon: float = 0.1, window: int = 32, prior_weight: float = 2.0,
                         seed: int = 0, margin: float = 0.05, hysteresis: float = 2.0,
                         max_tokens: int = 16) -> AdaptivePolicy:
        """Calibrates engine's step costs (CostModel) and builds the policy on them: the switch
        on at the cost model's threshold (off above hysteresis x it), the bandit's arms seeded
        with the predicted tokens per second."""
        if hysteresis < 1:
            raise ValueError(f"hysteresis: must be >= 1, got {hysteresis}")
        plans = tuple(plans)
        if not plans:
            raise ValueError("plans: need at least one draft plan to adapt over")
        if engine.drafter is None:
            plans = tuple(p for p in plans if not p.uses_drafter)
            if not plans:
                raise ValueError("plans: an engine without a drafter can only use plans that "
                                 "need none (SuffixMatch)")
        edges = [e for e in bucket_edges if e <= engine.config.max_batch] or [1]
        # calibrate at every other edge and the largest (rates are interpolated between)
        measured = sorted(set(edges[::2]) | {edges[-1]})
        model = calibrate(engine, plans, measured, calibration_requests, max_tokens=max_tokens)
        on_at = model.threshold(plans, margin)
        bandit = PlanBandit(plans, bucket_edges=edges, epsilon=epsilon, window=window,
                            prior_weight=prior_weight, seed=seed)
        if model.batches:  # else nothing was timed: on_at is 0, and the bandit is never asked
            bandit.seed_priors(model.rate)
        return cls(plans, SDSwitch(on_at, int(on_at * hysteresis)), bandit, model)

    def choose(self, batch: int) -> DraftPlan | None:
        if not self.switch.update(batch):
            self.stats.plain_steps += 1
            return None
        self.stats.spec_steps += 1
        return self.plans[self.bandit.select(batch)]

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.plan is not None and outcome.seconds > 0:
            self.bandit.update(outcome.batch, self._arm[outcome.plan.key],
                               outcome.emitted / outcome.seconds)

    def state_dict(self) -> dict:
        return {"bandit": self.bandit.state_dict(), "switch": self.switch.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.bandit.load_state_dict(state["bandit"])
        self.switch.load_state_dict(state["switch"])
