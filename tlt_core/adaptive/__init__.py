"""The adaptive rollout loop: speculate only where it pays, with the plan that pays most there.

`sd_switch.py` turns SD on at small running batches and off at large ones, with hysteresis;
`bandit.py` picks a draft plan per batch-size bucket (BEG-MAB, C++); `cost_model.py` measures
this engine's step costs at start, which seed both; `policy.py` composes them into
`AdaptivePolicy`, a PlanPolicy for `RolloutEngine.generate`. None of it changes what is
sampled: every plan is verified losslessly.
"""

from tlt_core.adaptive.bandit import DEFAULT_BUCKET_EDGES, PlanBandit
from tlt_core.adaptive.cost_model import SD_OFF, CostModel, calibrate
from tlt_core.adaptive.policy import DEFAULT_PLANS, AdaptivePolicy, AdaptiveStats
from tlt_core.adaptive.sd_switch import SDSwitch

__all__ = ["AdaptivePolicy", "AdaptiveStats", "CostModel", "DEFAULT_BUCKET_EDGES",
           "DEFAULT_PLANS", "PlanBandit", "SDSwitch", "SD_OFF", "calibrate"]
