"""Sampled chain drafts (tlt_core.drafting.sampled_chain): each draft token drawn from the
drafter's own distribution and verified by the sampled-draft rule — lossless in distribution
(chi-square against the exact continuation distribution, with the full and a reduced draft
vocabulary), greedy rows token for token, drafts a function of each row's own seed."""

import dataclasses

import pytest
import torch

from tlt_core.adaptive.policy import DEFAULT_PLANS, SAMPLED_PLANS, AdaptivePolicy, builtin_plans
from tlt_core.drafting.sampled_chain import SampledChain, sampled_chain
from tlt_core.drafting.sampled_tree import SampledTree
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.rl.driver import TrainConfig, _adaptive_plans

from tests.speculative_fixtures import (PROMPTS, same_seed_draft_context, tiny_target,
                                        train_drafter)
from tests.test_speculative import (CONTINUATION, SAMPLED_VOCAB, SAMPLES, chi_square_pvalue,
                                    exact_continuation_probs)


@pytest.mark.parametrize("temperature,top_p,reduced,tree", [
    (1.0, 1.0, False, SampledTree(2, 3)), (0.7, 0.9, False, SampledTree(2, 2)),
    (1.0, 1.0, True, SampledTree(3, 2))], ids=str)
def test_sampled_drafts_match_the_target_distribution(temperature, top_p, reduced, tree):
    """Sampled chains, and sampled trees (tlt_core.drafting.sampled_tree), whose K first tokens
    are often equal in this 4-token vocabulary."""
    target = tiny_target(SAMPLED_VOCAB, seed=4, sharpen=3.0)
    config = dict(draft_vocab=3, draft_to_target=[0, 1, 3]) if reduced else {}
    drafter = train_drafter(target, steps=60, **config)
    prompt = [1, 2, 0]
    probs = exact_continuation_probs(target, prompt, temperature, top_p)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=CONTINUATION,
                            n=SAMPLES, seed=17)
    engine = RolloutEngine(target, EngineConfig(max_batch=512, max_len=12), drafter)
    for plan in (SampledChain(2), SampledChain(3), tree):
        result = engine.generate([Request(prompt, params)], strategy=plan)
        codes = torch.stack([r.tokens for r in result.rollouts])  # (SAMPLES, 3)
        cell = (codes * torch.tensor([SAMPLED_VOCAB ** 2, SAMPLED_VOCAB, 1])).sum(1)
        counts = torch.bincount(cell, minlength=SAMPLED_VOCAB ** CONTINUATION)
        assert chi_square_pvalue(counts, probs) > 1e-3, plan
        assert result.acceptance_length > 1.2, plan  # the drafts were used


def test_greedy_rows_draft_the_argmax_chain(target, drafter):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    requests = [Request(p, params) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter)
    plain = engine.generate(requests)
    sampled = engine.generate(requests, strategy=SampledChain(4))
    chain = engine.generate(requests, strategy=Strategy(4, 1, 5))
    for a, b in zip(plain.rollouts, sampled.rollouts, strict=True):
        assert b.tokens.tolist() == a.tokens.tolist()
    assert sampled.acceptance_length == pytest.approx(chain.acceptance_length)


def test_drafts_are_a_function_of_each_rows_seed(target, drafter):
    context = same_seed_draft_context(target, drafter)
    with torch.no_grad():
        tree = sampled_chain(context, 4)
    assert torch.equal(tree.tokens[0], tree.tokens[2])  # same seed and input, same drafts
    assert tree.draft_probs.shape == (3, 5, target.config.vocab_size)
    assert torch.allclose(tree.draft_probs[:, :4].sum(-1), torch.ones(3, 4))
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="depth"):
        SampledChain(0)
    with pytest.raises(ValueError, match="sampling"):
        SampledChain(2).draft(dataclasses.replace(context, sampling=None))


def test_the_adaptive_loop_and_grpo_take_sampled_chains(target, drafter):
    plans = SAMPLED_PLANS + (Strategy(3, 1, 4),)
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter)
    calibration = [Request(p, SamplingParams(max_tokens=8)) for p in PROMPTS[:2]]
    policy = AdaptivePolicy.from_calibration(engine, plans, calibration)
    result = engine.generate([Request(p, SamplingParams(temperature=1.0, max_tokens=16))
                              for p in PROMPTS], strategy=policy)
    assert {s.plan_key for s in result.spec_steps} <= {p.key for p in plans}
    assert TrainConfig(sampled_drafts=True).sampled_drafts


def test_sampled_drafts_replace_the_deterministic_plans_at_t_above_0():
    assert builtin_plans(1.0, sampled_drafts=True) == SAMPLED_PLANS
    assert all(isinstance(plan, SampledChain) for plan in SAMPLED_PLANS)
    assert builtin_plans(0.0, sampled_drafts=True) == DEFAULT_PLANS  # greedy: the same chains
    assert builtin_plans(1.0, sampled_drafts=False) == DEFAULT_PLANS
    with pytest.raises(ValueError, match="temperature"):
        builtin_plans(-0.5, sampled_drafts=True)
    plans, _ = _adaptive_plans(TrainConfig(temperature=0.7, sampled_drafts=True))
    assert plans == SAMPLED_PLANS + (SuffixMatch(8), SuffixMatch(16))
    plans, _ = _adaptive_plans(TrainConfig(sampled_drafts=False, suffix_drafts=False))
    assert plans == DEFAULT_PLANS
