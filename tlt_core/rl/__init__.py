"""Reinforcement learning on the primitives: GRPO's math, a minimal driver, rewards and data.

`grpo.py` holds the math (group advantages, the PPO-clip loss with a k3 KL, response
log-probs), tested against hand-derived numbers; `driver.py` is `GRPODriver`, one GRPO step at
a time over the worker group (adaptive SD, spot-trained drafter, refresh, watchdog); `rewards.py`
the math-answer verifier and safe scoring of user reward functions; `data.py` prompt files;
`inputs.py` what a run trains on; `metrics.py` the stable names of a step's metrics and where
they are written; `report.py` a run's summary and plots; `checkpoint_io.py` checkpoints as
folders of safetensors and JSON (atomic, no pickle); `folder_lock.py` a folder one process
writes at a time; `policy_folder.py` a trained policy as a Hugging Face folder transformers
loads; `drafter_warmup.py` the offline drafter training before RL.
"""

from tlt_core.rl.checkpoint_io import (latest_checkpoint, read_state, write_checkpoint,
                                       write_state)
from tlt_core.rl.data import DataError, Dataset, Example, load_prompts
from tlt_core.rl.driver import GRPODriver, Prompt, TrainConfig, TrainState
from tlt_core.rl.grpo import LossParts, group_advantages, ppo_clip_loss, response_logprobs
from tlt_core.rl.inputs import TrainInputs, checkpoint_inputs, load_reward
from tlt_core.rl.metrics import METRICS, RECORD_FIELDS, MetricsWriter
from tlt_core.rl.policy_folder import SpecialTokenIds, write_policy_folder
from tlt_core.rl.rewards import RewardFn, Scored, math_answer, math_reward, score_all

__all__ = ["DataError", "Dataset", "Example", "GRPODriver", "LossParts", "METRICS",
           "MetricsWriter", "Prompt", "RECORD_FIELDS", "RewardFn", "Scored", "SpecialTokenIds",
           "TrainConfig", "TrainInputs", "TrainState", "checkpoint_inputs", "group_advantages",
           "latest_checkpoint", "load_prompts", "load_reward", "math_answer", "math_reward",
           "ppo_clip_loss", "read_state", "response_logprobs", "score_all", "write_checkpoint",
           "write_policy_folder", "write_state"]
