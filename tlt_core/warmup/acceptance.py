"""The warm-up's measure of a drafter: its acceptance length (tokens a row emits per speculative
step) on held-out prompts the training never saw, with the engine exactly as a rollout runs it,
overall and by context position, at two temperatures (EVAL_SETTINGS):
- "t0", greedy: a chain and a tree, the deterministic drafts greedy rollouts use;
- "t1", temperature 1 (RL's usual sampling): the deterministic chain, whose tokens are accepted
  with the target's own probability, the sampled chain of the same depth
  (tlt_core.drafting.sampled_chain), accepted with 1 - TV(p, q): the plan that tells how close
  the drafter's distribution is to the target's, which greedy acceptance cannot; and the
  sampled tree of two such chains (tlt_core.drafting.sampled_tree), whose first level is tried
  twice.
Seeded (OfflineConfig.seed), so a drafter's T = 1 numbers are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.sampled_tree import SampledTree
from tlt_core.drafting.tree import Strategy
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.transformer import Transformer
from tlt_core.warmup.config import OfflineConfig


@dataclass(frozen=True)
class EvalSetting:
    """One temperature the held-out prompts are answered at, and the plans that draft them."""

    key: str  # its key in the results: "t0", "t1"
    temperature: float
    plans: tuple[DraftPlan, ...]


EVAL_SETTINGS = (
    EvalSetting("t0", 0.0, (Strategy(6, 1, 7), Strategy(5, 4, 16))),  # a chain and a tree
    EvalSetting("t1", 1.0, (Strategy(6, 1, 7), SampledChain(6), SampledTree(6, 2))),
)
HEADLINE = ("t0", Strategy(6, 1, 7).key)  # the one number: greedy chain acceptance


@torch.no_grad()
def held_out_acceptance(target: Transformer, drafter: Drafter, prompts: Sequence[Sequence[int]],
                        config: OfflineConfig, stop_ids: Sequence[int] = ()
                        ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict]]]:
    """Acceptance length (tokens a row emits per speculative step) of `drafter` on `prompts`:
    ({setting key: {plan key: length}}, {setting key: {plan key: {context bucket: length}}})
    for every EVAL_SETTINGS temperature and plan."""
    engine = RolloutEngine(target, EngineConfig(
        max_batch=len(prompts), max_len=max(len(p) for p in prompts) + config.eval_max_tokens,
        seed=config.seed), drafter)
    overall, by_position = {}, {}
    for setting in EVAL_SETTINGS:
        params = SamplingParams(temperature=setting.temperature,
                                max_tokens=config.eval_max_tokens, stop_ids=tuple(stop_ids))
        requests = [Request(p, params) for p in prompts]
        overall[setting.key], by_position[setting.key] = {}, {}
        for plan in setting.plans:
            result = engine.generate(requests, strategy=plan)
            overall[setting.key][plan.key] = result.acceptance_length
            by_position[setting.key][plan.key] = result.acceptance_by_position
    return overall, by_position
