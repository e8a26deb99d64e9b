"""Rewards: the math-answer verifier, and running user reward functions safely.

`math_answer(text)` finds a response's final answer: the last `\\boxed{...}` if there is one,
else the number after the last `####` / `#` answer marker, else the last number in the text.
`normalize_answer` makes "1,000", "1000.0", "+1000" and "01000" the same answer (numbers compare
as exact fractions; anything else by its whitespace- and `$`-stripped text). `math_reward` is
1.0 when the two agree, else 0.0.

A reward function is any `fn(prompt: str, response: str, reference: str) -> float`.
`score_all` runs it over a batch: an exception or a non-finite value in one sample is recorded
against that sample (reward 0.0 and the error's text), never fatal to the run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:/\d+)?")


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def math_answer(text: str) -> str | None:
    """The final answer in a response, or None when it has none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    marker = text.rfind("#")
    if marker >= 0:
        match = _NUMBER.search(text, marker)
        if match:
            return match.group()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    text = answer.strip().strip("$").strip()
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    compact = text.replace(",", "").replace(" ", "")
    try:
        if "/" in compact:
            numerator, denominator = compact.split("/")
            value = Fraction(int(numerator), int(denominator))
        else:
            value = Fraction(compact)
        return str(value)
    except (ValueError, ZeroDivisionError):
        return " ".join(text.split())


def math_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 if the response's final answer equals the reference answer, else 0.0."""
    answer = math_answer(response)
    return float(answer is not None and normalize_answer(answer) == normalize_answer(reference))


@dataclass(frozen=True)
class Scored:
    reward: float
    error: str | None = None  # why this sample's reward function failed, if it did


def score_all(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
              references: Sequence[str]) -> list[Scored]:
    out = []
    for prompt, response, reference in zip(prompts, responses, references):
        try:
            value = float(fn(prompt, response, reference))
            if not math.isfinite(value):
                raise ValueError(f"the reward is {value}")
            out.append(Scored(value))
        except Exception as error:  # noqa: BLE001 - a user's function may raise anything
            out.append(Scored(0.0, f"{type(error).__name__}: {error}"))
    return out
