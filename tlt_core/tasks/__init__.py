"""Tasks: what an RL run trains on, independent of the algorithm that trains.

`data.py` reads prompt files (JSONL, JSON, CSV, Parquet, Hugging Face data sets; dotted field
paths for nested fields) into examples with reference answers; `rewards.py` the math-answer
verifier and safe scoring of user reward functions, which `reward_signatures.py` calls in
tlt_core's, TRL's or veRL's signature; `arithmetic_problems.py` generated word problems (a prompt file without a
download); `inputs.py` a run's inputs as one record (`TrainInputs`: policy, drafter, tokenized
`Prompt`s, reward). It knows nothing of advantages, losses or the driver (tlt_core.rl).
"""

from tlt_core.tasks.data import DataError, Dataset, Example, load_prompts
from tlt_core.tasks.inputs import Prompt, TrainInputs, checkpoint_inputs, load_reward
from tlt_core.tasks.rewards import RewardFn, RewardMix, Scored, math_answer, math_reward, score_all

__all__ = ["DataError", "Dataset", "Example", "Prompt", "RewardFn", "RewardMix", "Scored",
           "TrainInputs", "checkpoint_inputs", "load_prompts", "load_reward", "math_answer",
           "math_reward", "score_all"]
