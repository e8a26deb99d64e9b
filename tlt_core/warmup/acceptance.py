"""The warm-up's measure of a drafter: its greedy acceptance length (tokens a row emits per
speculative step) on held-out prompts the training never saw, with the engine exactly as a
rollout runs it, for a chain and a tree plan (EVAL_STRATEGIES), overall and by context
position.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.transformer import Transformer
from tlt_core.warmup.config import OfflineConfig

EVAL_STRATEGIES = (Strategy(6, 1, 7), Strategy(5, 4, 16))  # a chain and a tree, as rollouts use


@torch.no_grad()
def held_out_acceptance(target: Transformer, drafter: Drafter, prompts: Sequence[Sequence[int]],
                        config: OfflineConfig, stop_ids: Sequence[int] = ()
                        ) -> tuple[dict[str, float], dict[str, dict]]:
    """Greedy acceptance length (tokens a row emits per speculative step) of `drafter` on
    `prompts`, per EVAL_STRATEGIES plan, overall and by context position."""
    params = SamplingParams(temperature=0.0, max_tokens=config.eval_max_tokens,
                            stop_ids=tuple(stop_ids))
    requests = [Request(p, params) for p in prompts]
    engine = RolloutEngine(target, EngineConfig(
        max_batch=len(requests), max_len=max(len(p) for p in prompts) + config.eval_max_tokens,
        seed=config.seed), drafter)
    overall, by_position = {}, {}
    for strategy in EVAL_STRATEGIES:
        result = engine.generate(requests, strategy=strategy)
        overall[strategy.key] = result.acceptance_length
        by_position[strategy.key] = result.acceptance_by_position
    return overall, by_position
