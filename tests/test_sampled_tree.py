"""Sampled trees (tlt_core.drafting.sampled_tree): K first tokens drawn i.i.d. from the drafter's
distribution after the root, each growing its own sampled chain, verified by the sampled-draft
rule's multi-draft recursion. Lossless in distribution: the chi-square test of
tests/test_sampled_drafts.py runs them beside the chains. Here: greedy rows token for token in
float32, more tokens per step than the chain of the same depth, the tree's layout, drafts a
function of each row's own seed, and the key a plan is kept by."""

import dataclasses

import pytest
import torch

from tlt_core.bench.speculative import parse_strategy
from tlt_core.drafting.plan_keys import plan_from_key
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.sampled_tree import SampledTree, sampled_tree
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams

from tests.speculative_fixtures import (PROMPTS, same_seed_draft_context, tiny_target,
                                        train_drafter)
from tests.test_speculative import SAMPLED_VOCAB


def test_more_branches_accept_more_than_the_chain():
    """The first level is tried K times against the residual: more tokens per step than the
    sampled chain of the same depth on the same requests, with a drafter far from the target
    (a few training steps), where a single draw is often rejected."""
    target = tiny_target(SAMPLED_VOCAB, seed=4, sharpen=1.0)
    drafter = train_drafter(target, steps=3)
    params = SamplingParams(temperature=1.0, max_tokens=12, n=2000, seed=3)
    engine = RolloutEngine(target, EngineConfig(max_batch=512, max_len=24), drafter)
    requests = [Request([1, 2, 0], params)]
    chain = engine.generate(requests, strategy=SampledChain(3)).acceptance_length
    tree = engine.generate(requests, strategy=SampledTree(3, 3)).acceptance_length
    print(f"acceptance: sampled(3) {chain:.3f}, sampled(3,3) {tree:.3f}")
    assert tree > chain + 0.1, (chain, tree)


def test_greedy_rows_equal_plain_decoding(target, drafter):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    requests = [Request(p, params) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), drafter)
    plain = engine.generate(requests)
    tree = engine.generate(requests, strategy=SampledTree(4, 2))
    for a, b in zip(plain.rollouts, tree.rollouts, strict=True):
        assert b.tokens.tolist() == a.tokens.tolist()
    assert tree.acceptance_length > 1.0


def test_tree_layout_and_drafts_are_a_function_of_each_rows_seed(target, drafter):
    context = same_seed_draft_context(target, drafter)
    with torch.no_grad():
        tree = sampled_tree(context, 3, 2)
    assert torch.equal(tree.tokens[0], tree.tokens[2])  # same seed and input, same drafts
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 2, 3, 4]  # two chains of three
    assert tree.num_nodes.tolist() == [7, 7, 7]
    assert tree.draft_probs.shape == (3, 7, target.config.vocab_size)
    # the root and the inner nodes hold the q their children were drawn from
    assert torch.allclose(tree.draft_probs[:, :5].sum(-1), torch.ones(3, 5))
    children = tree.tokens[:, 1:]
    drawn_from = tree.draft_probs[:, tree.parents[0, 1:].long()]  # (B, 6, V)
    assert bool((drawn_from.gather(2, children[..., None]) > 0).all())
    with pytest.raises(ValueError, match="sampling"):
        SampledTree(3, 2).draft(dataclasses.replace(context, sampling=None))


def test_keys_and_bad_shapes():
    plan = SampledTree(4, 2)
    assert plan.key == "sampled(4,2)" and plan.num_verify_tokens == 9 and plan.fed_nodes == 6
    assert not plan.is_chain and plan.uses_drafter
    assert plan_from_key(plan.key) == plan
    assert parse_strategy("s4,2") == plan and parse_strategy("sampled(4,2)") == plan
    assert parse_strategy("s4") == SampledChain(4)
    with pytest.raises(ValueError, match="branches"):
        SampledTree(4, 1)
    with pytest.raises(ValueError, match="depth"):
        SampledTree(0, 2)
    with pytest.raises(ValueError, match="branches"):
        SampledTree(64, 16)  # 1,025 nodes: more than the verifier takes
