"""Reinforcement learning on the primitives: GRPO's and PPO's math, a minimal driver, rewards
and data.

The math, each tested against hand-derived numbers: `advantages.py` (group advantages and their
scalings, GAE, whitening, the overlong penalty, dynamic sampling's group test), `losses.py`
(the clipped surrogate, the value loss, KL estimators, loss aggregation, response log-probs),
`critic.py` (PPO's value model), `schedule.py` (the learning rate), `evaluation.py` (pass@k).
`driver.py` is `RLDriver`, one GRPO or PPO step at a time over the worker group (adaptive SD,
spot-trained drafter, refresh, watchdog, held-out evaluation); `rewards.py`
the math-answer verifier and safe scoring of user reward functions; `data.py` prompt files;
`inputs.py` what a run trains on; `metrics.py` the stable names of a step's metrics and where
they are written; `wandb_logger.py` those metrics as a Weights & Biases run (optional: the
wandb package); `report.py` a run's summary and plots; `checkpoint_io.py` checkpoints as
folders of safetensors and JSON (atomic, no pickle); `folder_lock.py` a folder one process
writes at a time; `policy_folder.py` a trained policy as a Hugging Face folder transformers
loads; `drafter_warmup.py` the offline drafter training before RL.
"""

from tlt_core.rl.checkpoint_io import (latest_checkpoint, read_state, write_checkpoint,
                                       write_state)
from tlt_core.rl.data import DataError, Dataset, Example, load_prompts
from tlt_core.rl.driver import RLDriver, Prompt, TrainConfig, TrainState
from tlt_core.rl.advantages import gae, group_advantages
from tlt_core.rl.critic import ValueModel
from tlt_core.rl.evaluation import pass_at_k
from tlt_core.rl.losses import LossParts, ppo_clip_loss, response_logprobs, token_weights
from tlt_core.rl.inputs import TrainInputs, checkpoint_inputs, load_reward
from tlt_core.rl.metrics import METRICS, RECORD_FIELDS, MetricsWriter
from tlt_core.rl.policy_folder import SpecialTokenIds, write_policy_folder
from tlt_core.rl.rewards import RewardFn, Scored, math_answer, math_reward, score_all

__all__ = ["DataError", "Dataset", "Example", "RLDriver", "LossParts", "METRICS",
           "MetricsWriter", "Prompt", "RECORD_FIELDS", "RewardFn", "Scored", "SpecialTokenIds",
           "TrainConfig", "TrainInputs", "TrainState", "ValueModel", "checkpoint_inputs", "gae",
           "group_advantages", "pass_at_k", "token_weights",
           "latest_checkpoint", "load_prompts", "load_reward", "math_answer", "math_reward",
           "ppo_clip_loss", "read_state", "response_logprobs", "score_all", "write_checkpoint",
           "write_policy_folder", "write_state"]
