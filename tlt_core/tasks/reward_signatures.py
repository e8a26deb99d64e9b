"""Reward functions written for other RL frameworks, told apart by their parameters and called
the way each framework calls them, so `score_all` scores any of them.

Three signatures (the first that fits, by `inspect.signature`'s parameter names):
- veRL's, any function with parameters `solution_str` and `ground_truth`:
  `compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a number or
  a dict with a "score" (its other entries, veRL's extra metrics, are not used). One sample a
  call, by keyword as veRL's reward manager calls it: `solution_str` is the response,
  `ground_truth` the reference answer as tlt_core reads it (GSM8K's "... #### 72" is "72"), and
  `data_source` and `extra_info` the data row's fields of those names (None where the row has
  none), each passed only when the function takes it.
- TRL's, any function with a parameter `completions`: `f(prompts, completions, **kwargs)`
  returning one number per sample, a batch a call. As in TRL, a sample whose prompt was chat
  messages has its prompt as those messages and its completion as
  `[{"role": "assistant", "content": response}]`; other prompts and completions are strings.
  Every other field of the data rows comes as a keyword argument holding one value per sample
  (None where a row lacks it): `answer`, `solution`, ... TRL's trainer-only arguments
  (`completion_ids`, `trainer_state`, `log_metric`, `environments`) are not passed. A function
  without `**kwargs` gets only the fields it names.
- tlt_core's: `f(prompt, response, reference)`, three positional parameters, one sample a call.
Anything else is refused with a ValueError naming the function and these three forms.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

VERL, TRL, TLT = "verl", "trl", "tlt"
# TRL's own arguments, and the columns TRL does not pass on: data fields of these names are not
# passed as keyword columns
TRL_RESERVED = frozenset({"prompt", "completion", "prompts", "completions", "completion_ids",
                          "trainer_state", "log_extra", "log_metric", "environments"})
FORMS = ("f(prompt, response, reference), TRL's f(prompts, completions, **kwargs) or veRL's "
         "compute_score(data_source, solution_str, ground_truth, extra_info=None)")


@dataclass(frozen=True)
class RewardBatch:
    """What a reward function may be given about each sample of a batch."""

    prompts: Sequence[str]  # the prompt text (a chat prompt's last user message)
    responses: Sequence[str]
    references: Sequence[str]  # the reference answer
    messages: Sequence[tuple[dict, ...] | None]  # the prompt as chat messages, where it was
    rows: Sequence[Mapping[str, Any]]  # the data row each sample came from ({} for none)

    def sample(self, index: int) -> RewardBatch:
        """The batch of sample `index` alone."""
        return RewardBatch(*([field[index]] for field in (
            self.prompts, self.responses, self.references, self.messages, self.rows)))


def reward_name(fn: Callable) -> str:
    """module.qualname of a function (or of a callable object's class): what errors name."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None)
    return f"{module}.{target.__qualname__}" if module else target.__qualname__


def reward_signature(fn: Callable) -> str:
    """VERL, TRL or TLT: which of the module docstring's signatures fn has."""
    if not callable(fn):
        raise ValueError(f"reward: {fn!r} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as ours
        return TLT
    names = set(signature.parameters)
    if {"solution_str", "ground_truth"} <= names:
        return VERL
    if "completions" in names:
        return TRL
    try:
        signature.bind(None, None, None)
    except TypeError:
        raise ValueError(f"reward: {reward_name(fn)}{signature} has none of the signatures a "
                         f"reward function may have: {FORMS}") from None
    return TLT


def call_per_sample(fn: Callable, signature: str, batch: RewardBatch, index: int) -> Any:
    """fn's raw value for sample `index` (VERL and TLT signatures)."""
    if signature == TLT:
        return fn(batch.prompts[index], batch.responses[index], batch.references[index])
    row = batch.rows[index]
    value = fn(**_accepted(fn, {"data_source": row.get("data_source"),
                                "solution_str": batch.responses[index],
                                "ground_truth": batch.references[index],
                                "extra_info": row.get("extra_info")}))
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' (keys: {sorted(value)})")
        return value["score"]
    return value


class RewardCountError(ValueError):
    """A batched (TRL-signature) reward function returned other than one value per sample."""


def call_batched(fn: Callable, batch: RewardBatch) -> list:
    """fn's raw values for the whole batch (TRL signature), one per sample; RewardCountError
    when it returns another count (or no list)."""
    chat = [messages is not None for messages in batch.messages]
    prompts = [list(messages) if is_chat else text
               for text, messages, is_chat in zip(batch.prompts, batch.messages, chat)]
    completions = [[{"role": "assistant", "content": response}] if is_chat else response
                   for response, is_chat in zip(batch.responses, chat)]
    keys = dict.fromkeys(key for row in batch.rows for key in row if key not in TRL_RESERVED)
    columns = {key: [row.get(key) for row in batch.rows] for key in keys}
    values = fn(**_accepted(fn, {"prompts": prompts, "completions": completions, **columns}))
    if not isinstance(values, (list, tuple)) or len(values) != len(batch.responses):
        got = (f"{len(values)} values" if isinstance(values, (list, tuple))
               else f"a {type(values).__name__}")
        raise RewardCountError(f"returned {got} for {len(batch.responses)} completions (TRL's "
                         "reward functions return a list, one value per completion)")
    return list(values)


def _accepted(fn: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments fn takes by name: all of them when it has **kwargs."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return arguments
    return {name: value for name, value in arguments.items() if name in parameters}
