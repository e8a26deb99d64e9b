"""Reinforcement learning on the primitives: GRPO's and PPO's math and a minimal driver.

The math, each tested against hand-derived numbers: `advantages.py` (group advantages and their
scalings, GAE, whitening, the overlong penalty, dynamic sampling's group test), `losses.py`
(the clipped surrogate, the value loss, KL estimators, loss aggregation, response log-probs),
`critic.py` (PPO's value model), `evaluation.py` (pass@k). `driver.py` is `RLDriver`, one GRPO
or PPO step at a time over the worker group (adaptive SD, spot-trained drafter, refresh,
watchdog, held-out evaluation). What a run trains on (prompts, rewards) is tlt_core.tasks; the
learning rate and master weights tlt_core.optim; checkpoints tlt_core.persistence; a run's
metrics, report and policy folder tlt_core.outputs.
"""

from tlt_core.rl.advantages import gae, group_advantages
from tlt_core.rl.critic import ValueModel
from tlt_core.rl.driver import RLDriver, TrainConfig, TrainState
from tlt_core.rl.evaluation import pass_at_k
from tlt_core.rl.losses import LossParts, ppo_clip_loss, response_logprobs, token_weights

__all__ = ["LossParts", "RLDriver", "TrainConfig", "TrainState", "ValueModel", "gae",
           "group_advantages", "pass_at_k", "ppo_clip_loss", "response_logprobs",
           "token_weights"]
