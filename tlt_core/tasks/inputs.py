"""What the RL driver trains on, as one record: the policy, its drafter (or None: the adaptive
loop then uses suffix-match drafts only), prompts with reference answers (`Prompt`: the text the
reward function sees, the ids the model sees, the reference), the reward function,
and the tokenizer's text side. `checkpoint_inputs` builds it from a local Hugging Face
checkpoint and a prompt file; `tlt_core.embedded.train_inputs` from the embedded workload.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.drafting.export import load_drafter
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.placement import Placement
from tlt_core.model.prompt_format import load_prompt_format
from tlt_core.model.tokenizer import CheckpointTokenizer
from tlt_core.tasks.data import load_prompts
from tlt_core.tasks.reward_signatures import reward_signature
from tlt_core.tasks.rewards import RewardFn, math_reward


@dataclass(frozen=True)
class Prompt:
    text: str  # what the reward function sees
    ids: tuple[int, ...]  # what the model sees
    reference: str  # the reference answer
    # what TRL- and veRL-style reward functions may read besides (tasks.reward_signatures):
    # the prompt as chat messages (None: it was text) and the data row it came from
    messages: tuple[dict, ...] | None = field(default=None, compare=False, repr=False)
    row: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class TrainInputs:
    policy: torch.nn.Module
    # Any drafter load_drafter reads; the spot trainer trains a Drafter, an Eagle3Drafter
    # (a published EAGLE-3 drafter) drafts as loaded.
    drafter: Drafter | Eagle3Drafter | None
    prompts: list[Prompt]
    calibration: list[Prompt]  # a few prompts like the workload's, for the cost model
    reward_fn: RewardFn
    detokenize: Callable[[list[int]], str]
    stop_ids: tuple[int, ...]
    description: str
    bad_rows: list[tuple[int, str]]  # (line, why) of the data rows skipped
    # The checkpoint's tokenizer, saved with each policy folder; None for the embedded model
    # (its character tokenizer is not a Hugging Face one).
    tokenizer: CheckpointTokenizer | None = None
    evaluation: list[Prompt] = field(default_factory=list)  # held-out prompts (eval_every)


def checkpoint_inputs(model_path: str | Path, data_path: str | Path, *, drafter_path=None,
                      skip_bad_rows: bool = True, reward_fn: RewardFn = math_reward,
                      placement: Placement | None = None, chat_template: str | Path = "auto",
                      system_prompt: str | None = None, prompt_key: str | None = None,
                      answer_key: str | None = None, split: str | None = None,
                      eval_data_path: str | Path | None = None) -> TrainInputs:
    """A local Hugging Face checkpoint (its tokenizer and chat template included) and a prompt
    data set (tlt_core.tasks.data.load_prompts), in `placement` (default: float32 on the CPU);
    held-out prompts from `eval_data_path` (same fields) when given.
    Prompts go through the prompt format `chat_template` names (tlt_core.model.prompt_format);
    a messages-style prompt needs a template."""
    placement = placement or Placement(torch.device("cpu"), torch.float32, "default")
    prompt_format = load_prompt_format(model_path, chat_template, system_prompt)
    tokenizer = prompt_format.tokenizer
    def read(path) -> tuple[list[Prompt], object]:
        data = load_prompts(path, prompt_key=prompt_key, answer_key=answer_key, split=split,
                            on_bad_rows="skip" if skip_bad_rows else "error")
        return [Prompt(e.prompt, tuple(prompt_format.encode(list(e.messages) if e.messages
                                                            else e.prompt)), e.answer,
                       e.messages, e.row)
                for e in data.examples], data

    prompts, data = read(data_path)
    evaluation = read(eval_data_path)[0] if eval_data_path is not None else []
    policy = load_checkpoint(model_path, dtype=placement.dtype, device=placement.device)
    drafter = load_drafter(drafter_path, policy).eval() if drafter_path is not None else None
    fields = f"fields {data.prompt_key!r} / {data.answer_key!r}"
    return TrainInputs(policy, drafter, prompts, prompts[:4], reward_fn,
                       lambda ids: tokenizer.decode(ids), tuple(tokenizer.eos_ids),
                       f"{model_path} on {data_path} ({len(prompts)} prompts, {fields}; "
                       f"{prompt_format.describe()}; {placement.describe()})", data.bad_rows,
                       tokenizer, evaluation)


def load_reward(spec: str) -> Callable:
    """'module:function' -> the function (a user's reward, which the user asked us to import),
    in one of the signatures tasks.reward_signatures knows (ValueError naming it otherwise)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"reward: expected 'module:function', got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward: cannot load {spec!r} ({error})") from error
    if not callable(function):
        raise ValueError(f"reward: {spec!r} is not callable")
    reward_signature(function)
    return function
