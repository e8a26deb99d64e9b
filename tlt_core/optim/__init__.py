"""Optimisation helpers shared by every trainer (the policy, the drafter's warm-up, the
embedded model's pre-training): `schedule.py` the learning rate (linear warm-up, then constant
or cosine to a floor), a pure function of the step; `master_weights.py` AdamW with float32
master weights for bf16/fp16 parameters. It knows nothing of models, losses or data.
"""

from tlt_core.optim.master_weights import MasterWeightAdamW
from tlt_core.optim.schedule import LR_SCHEDULERS, learning_rate, lr_multiplier

__all__ = ["LR_SCHEDULERS", "MasterWeightAdamW", "learning_rate", "lr_multiplier"]
