"""What `tlt train` trains on: the embedded task and model by default, or a local Hugging Face
checkpoint with a JSONL / Parquet prompt file.

Both give `GRPOTrainer` its inputs: the policy, its drafter (or None: the adaptive loop then uses
model-free drafts only), prompts with reference answers, the reward function, and the
tokenizer's decode and stop ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tlt_core.rewards import RewardFn, math_reward
from tlt_core.train import Prompt


@dataclass
class TrainInputs:
    policy: torch.nn.Module
    drafter: object | None
    prompts: list[Prompt]
    calibration: list[Prompt]
    reward_fn: RewardFn
    decode: Callable[[list[int]], str]
    stop_ids: tuple[int, ...]
    description: str
    bad_rows: list[tuple[int, str]]


def embedded_reward(prompt: str, response: str, reference: str) -> float:
    """The embedded task's checker: the answer after the one '#' marker, exactly."""
    from tlt_core.task import parse_answer

    return float(parse_answer(response) == reference)


def embedded_inputs(num_prompts: int = 512, seed: int = 2024, progress: bool = True) -> TrainInputs:
    """The warm embedded model and its warmed-up drafter (trained and cached on first use, a
    few minutes on 2 cores), on fresh problems of the embedded task."""
    from tlt_core.drafter_training import load_or_warm_up_drafter
    from tlt_core.embedded import EMBEDDED_MODEL_CONFIG
    from tlt_core.task import CharTokenizer, TaskConfig, generate_problems
    from tlt_core.warmup import WarmupConfig, cache_dir, load_or_train

    policy, _ = load_or_train(progress=progress)
    drafter, _ = load_or_warm_up_drafter(policy.eval(), cache_dir(WarmupConfig(), EMBEDDED_MODEL_CONFIG),
                                         progress=progress)
    tokenizer = CharTokenizer()

    def prompts(task_seed: int, count: int) -> list[Prompt]:
        return [Prompt(p.prompt, tuple(tokenizer.prompt_ids(p.prompt)), p.answer)
                for p in generate_problems(TaskConfig(seed=task_seed, num_problems=count))]

    return TrainInputs(policy, drafter, prompts(seed, num_prompts), prompts(seed + 1, 4),
                       embedded_reward, tokenizer.decode_response, (tokenizer.eos_id,),
                       f"embedded task ({num_prompts} problems), embedded model", [])


def checkpoint_inputs(model_path: str | Path, data_path: str | Path, *, drafter_path=None,
                      skip_bad_rows: bool = True, reward_fn: RewardFn = math_reward) -> TrainInputs:
    """A local Hugging Face checkpoint (its tokenizer.json included) and a prompt file."""
    from tlt_core.checkpoint import load_checkpoint
    from tlt_core.data import load_prompts
    from tlt_core.drafter import Drafter
    from tlt_core.tokenizer import CheckpointTokenizer

    policy = load_checkpoint(model_path)
    tokenizer = CheckpointTokenizer(model_path)
    data = load_prompts(data_path, on_bad_rows="skip" if skip_bad_rows else "error")
    prompts = [Prompt(e.prompt, tuple(tokenizer.encode(e.prompt)), e.answer) for e in data.examples]
    drafter = Drafter.load(drafter_path, policy) if drafter_path is not None else None
    return TrainInputs(policy, drafter, prompts, prompts[:4], reward_fn,
                       lambda ids: tokenizer.decode(ids), tuple(tokenizer.eos_ids),
                       f"{model_path} on {data_path} ({len(prompts)} prompts)", data.bad_rows)


def load_reward(spec: str) -> RewardFn:
    """'module:function' -> the function (a user's reward)."""
    import importlib

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"reward: expected 'module:function', got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward: cannot load {spec!r} ({error})") from error
    if not callable(function):
        raise ValueError(f"reward: {spec!r} is not callable")
    return function
