"""What every adapter does around the engine, whatever the framework: the GRPO groups in a
framework's batch of repeated prompts, and the adaptive policy calibrated on them.

RL frameworks (TRL's RepeatSampler, veRL's `repeat(interleave=True)`) hand a generator each
prompt repeated once per sample, consecutively. One `Request(n=run length)` per run keeps a
GRPO group together in the engine: siblings share suffix-match drafts, and rows come back in
the order they went in (the engine orders samples by request, then sample).
"""

from __future__ import annotations

from typing import Sequence

from tlt_core.adaptive.policy import DEFAULT_PLANS, AdaptivePolicy
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.engine.engine import RolloutEngine
from tlt_core.engine.records import Request, SamplingParams

CALIBRATION_PROMPTS = 4  # distinct prompts the calibration runs at every batch size
CALIBRATION_TOKENS = 16


def prompt_groups(prompt_ids: Sequence[Sequence[int]]) -> list[tuple[tuple[int, ...], int]]:
    """Consecutive equal prompts as (prompt, count): a framework's groups of samples."""
    groups: list[tuple[tuple[int, ...], int]] = []
    for ids in prompt_ids:
        key = tuple(int(token) for token in ids)
        if groups and groups[-1][0] == key:
            groups[-1] = (key, groups[-1][1] + 1)
        else:
            groups.append((key, 1))
    return groups


def default_plans() -> tuple[DraftPlan, ...]:
    """What the adaptive policy chooses among unless told: the shipped drafter plans and
    suffix matching over the group's siblings."""
    return DEFAULT_PLANS + (SuffixMatch(8),)


def calibrated_policy(engine: RolloutEngine, plans: Sequence[DraftPlan],
                      prompt_ids: Sequence[Sequence[int]], temperature: float) -> AdaptivePolicy:
    """An AdaptivePolicy over plans, its step costs calibrated on engine with the first
    CALIBRATION_PROMPTS distinct prompts (the engine's weights must be the ones it will run
    with). No stop ids: calibration times steps at each batch size, so rows must not end."""
    params = SamplingParams(temperature=temperature, max_tokens=CALIBRATION_TOKENS)
    calibration = [Request(ids, params)
                   for ids, _ in prompt_groups(prompt_ids)][:CALIBRATION_PROMPTS]
    return AdaptivePolicy.from_calibration(engine, plans, calibration)
