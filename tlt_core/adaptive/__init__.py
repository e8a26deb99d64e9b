"""The adaptive rollout loop: speculate only where it pays, with the plan that pays most there.

`buckets.py` names the cells it learns in (running-batch bucket x context-length bucket);
`arm_table.py` keeps each arm's measured tokens per second per cell (plain decoding is an arm);
`cost_model.py` measures this engine's step costs at start, which seed the table's priors;
`measured_plans.py` reads the plans (the best per batch size) and rates a `tlt bench
speculative` file measured;
`policy.py` composes them into `AdaptivePolicy`, a PlanPolicy for `RolloutEngine.generate`
that exploits the best measured arm and explores only within a 3% budget. None of it changes
what is sampled: every plan is verified losslessly.
"""

from tlt_core.adaptive.arm_table import ArmTable
from tlt_core.adaptive.buckets import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, StepBuckets
from tlt_core.adaptive.cost_model import SD_OFF, CostModel, calibrate
from tlt_core.adaptive.measured_plans import MeasuredPlans, measured_plans
from tlt_core.adaptive.policy import (DEFAULT_PLANS, SAMPLED_PLANS, AdaptivePolicy, AdaptiveStats,
                                      builtin_plans)

__all__ = ["AdaptivePolicy", "AdaptiveStats", "ArmTable", "CostModel", "DEFAULT_BATCH_EDGES",
           "DEFAULT_CONTEXT_EDGES", "DEFAULT_PLANS", "MeasuredPlans", "SAMPLED_PLANS", "SD_OFF",
           "StepBuckets", "builtin_plans", "calibrate", "measured_plans"]
