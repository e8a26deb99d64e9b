"""The adaptive rollout loop: SD only where it pays, the draft plan chosen per batch bucket.

An `AdaptivePolicy` is a strategy policy for `RolloutEngine.generate`: before each step it asks
the SD switch whether to speculate at this running batch size and, if so, the bandit which plan
(learned-drafter shapes, model-free drafts); after each step the engine tells it how many tokens
the step emitted in how many seconds, the bandit's reward. `from_calibration` builds one whose
switch threshold and bandit priors come from a cost model measured on this engine at start.

Outputs do not depend on any of this: every plan is verified losslessly, so the policy only
decides how fast the same distribution is sampled (greedy: the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tlt_core.bandit import DEFAULT_BUCKET_EDGES, StrategyBandit
from tlt_core.cost_model import CostModel, calibrate
from tlt_core.model_free import ModelFree
from tlt_core.sd_switch import SDSwitch
from tlt_core.speculative import Strategy

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
    def __init__(self, plans: Sequence[object], switch: SDSwitch, bandit: StrategyBandit | None = None,
                 cost_model: CostModel | None = None):
        self.plans = tuple(plans)
        self.switch = switch
        self.bandit = bandit if bandit is not None else StrategyBandit(self.plans)
        if self.bandit.arms != self.plans:
            raise ValueError("bandit: its arms must be the policy's plans, in order")
        self.cost_model = cost_model
        self.stats = AdaptiveStats()
        self._index = {id(p): i for i, p in enumerate(self.plans)}

    @classmethod
    def from_calibration(cls, engine, plans: Sequence[object] = DEFAULT_PLANS,
                         calibration_requests=(), *, bucket_edges=DEFAULT_BUCKET_EDGES,
                         epsilon: float = 0.1, window: int = 32, prior_weight: float = 2.0,
                         seed: int = 0, margin: float = 0.05, hysteresis: float = 2.0,
                         max_tokens: int = 16) -> AdaptivePolicy:
        """Calibrates engine's step costs (CostModel) and builds the policy on them: the switch
        on at the cost model's threshold (off above hysteresis x it), the bandit's arms seeded
        with the predicted tokens per second."""
        if hysteresis < 1:
            raise ValueError(f"hysteresis: must be >= 1, got {hysteresis}")
        plans = tuple(plans)
        if engine.drafter is None:
            plans = tuple(p for p in plans if isinstance(p, ModelFree))
            if not plans:
                raise ValueError("plans: an engine without a drafter can only use ModelFree plans")
        edges = [e for e in bucket_edges if e <= engine.config.max_batch] or [1]
        # calibrate at every other edge and the largest (rates are interpolated between)
        measured = sorted(set(edges[::2]) | {edges[-1]})
        model = calibrate(engine, plans, measured, calibration_requests, max_tokens=max_tokens)
        on_at = model.threshold(plans, margin)
        bandit = StrategyBandit(plans, bucket_edges=edges, epsilon=epsilon, window=window,
                                prior_weight=prior_weight, seed=seed)
        bandit.seed_priors(model.rate)
        return cls(plans, SDSwitch(on_at, int(on_at * hysteresis)), bandit, model)

    def __call__(self, batch: int):
        if not self.switch.update(batch):
            self.stats.plain_steps += 1
            return None
        self.stats.spec_steps += 1
        return self.plans[self.bandit.select(batch)]

    def observe(self, batch: int, plan, emitted: int, seconds: float) -> None:
        if plan is not None and seconds > 0:
            self.bandit.update(batch, self._index[id(plan)], emitted / seconds)

    def state_dict(self) -> dict:
        return {"bandit": self.bandit.state_dict(), "switch": self.switch.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.bandit.load_state_dict(state["bandit"])
        self.switch.load_state_dict(state["switch"])
