"""A reduced draft vocabulary (EAGLE-3's d2t): the drafter scores V' target ids only, the tree
proposes only those, and verification stays lossless — greedy token for token, sampled in
distribution (chi-square) — while the head follows the target's own head as it trains."""

import pytest
import torch

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import exportable
from tlt_core.drafting.tree import Strategy, draft_tree
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams

from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target, train_drafter
from tests.test_speculative import (CONTINUATION, SAMPLED_VOCAB, SAMPLES, chi_square_pvalue,
                                    exact_continuation_probs)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def reduced(target):
    """A drafter over the 3/4 of the ids the target's greedy outputs use most."""
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=48))
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = engine.generate([Request(p, params) for p in PROMPTS]).rollouts
    counts = torch.bincount(torch.cat([r.tokens for r in outputs]), minlength=VOCAB)
    keep = counts.argsort(descending=True)[:VOCAB * 3 // 4]
    torch.manual_seed(5)
    return train_drafter(target, draft_vocab=keep.numel(), draft_to_target=keep)


def test_reduced_drafter_scores_and_proposes_only_its_ids(target, reduced):
    assert reduced.vocab_size == VOCAB * 3 // 4
    hidden = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        logits = reduced.logits(hidden)
        full = torch.nn.functional.linear(hidden, target.lm_head.weight).float()
    assert logits.shape == (3, reduced.vocab_size)
    assert torch.allclose(logits, full[:, reduced.draft_to_target])  # the target's own rows
    cache = reduced.new_cache(3, 48)
    cache.set_lengths(2)
    with torch.no_grad():
        tree = draft_tree(reduced, cache, torch.tensor([3, 4, 5]), hidden, Strategy(4, 3, 10))
    drafted = tree.tokens[:, 1:]
    assert bool(torch.isin(drafted, reduced.draft_to_target).all())


@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_speculative_with_a_reduced_vocabulary_equals_plain(target, reduced, batch):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [Request(p, params) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=batch, max_len=48), reduced)
    plain = engine.generate(requests)
    for strategy in (Strategy(4, 1, 5), Strategy(5, 4, 16)):
        spec = engine.generate(requests, strategy=strategy)
        for a, b in zip(plain.rollouts, spec.rollouts, strict=True):
            assert b.tokens.tolist() == a.tokens.tolist(), strategy
        assert spec.acceptance_length > 1.5, (strategy, spec.acceptance_length)


def test_sampled_speculative_with_a_reduced_vocabulary_matches_the_target():
    """Half the ids are out of the draft vocabulary, the likeliest included: those can only
    be sampled from the residual, and the distribution must still be the target's."""
    target = tiny_target(SAMPLED_VOCAB, seed=4, sharpen=3.0)
    prompt = [1, 2, 0]
    with torch.no_grad():
        likeliest = int(target(torch.tensor([prompt]), torch.arange(3)[None]).logits[0, -1]
                        .argmax())
    keep = [i for i in range(SAMPLED_VOCAB) if i != likeliest][:SAMPLED_VOCAB // 2]
    drafter = train_drafter(target, steps=60, draft_vocab=len(keep), draft_to_target=keep)
    probs = exact_continuation_probs(target, prompt, 1.0, 1.0)
    params = SamplingParams(temperature=1.0, max_tokens=CONTINUATION, n=SAMPLES, seed=13)
    engine = RolloutEngine(target, EngineConfig(max_batch=512, max_len=8), drafter)
    for strategy in (Strategy(3, 2, 5), Strategy(3, 1, 4)):
        result = engine.generate([Request(prompt, params)], strategy=strategy)
        codes = torch.stack([r.tokens for r in result.rollouts])
        cell = (codes * torch.tensor([SAMPLED_VOCAB ** 2, SAMPLED_VOCAB, 1])).sum(1)
        counts = torch.bincount(cell, minlength=SAMPLED_VOCAB ** CONTINUATION)
        assert chi_square_pvalue(counts, probs) > 1e-3, strategy
        assert result.acceptance_length > 1.05  # drafts in its vocabulary were accepted


def test_head_rows_follow_the_target_head(target):
    twin = tiny_target()
    drafter = Drafter(twin, DrafterConfig(draft_vocab=4), [7, 1, 3, 0])
    assert drafter.draft_to_target.tolist() == [0, 1, 3, 7]  # kept ascending
    hidden = torch.randn(2, twin.config.hidden_size)
    with torch.no_grad():
        before = drafter.logits(hidden)
        twin.lm_head.weight.mul_(2.0)  # an optimizer step writes the head in place
        after = drafter.logits(hidden)
    assert torch.allclose(after, 2 * before, rtol=1e-5, atol=1e-5)


def test_a_reduced_drafter_trains_after_drafting_in_inference_mode():
    """The spot trainer's backward pass after a rollout (inference mode) gathered the head's
    rows: the rows must be a normal tensor autograd can save."""
    twin = tiny_target()
    drafter = Drafter(twin, DrafterConfig(draft_vocab=4), [7, 1, 3, 0])
    hidden = torch.randn(2, twin.config.hidden_size)
    with torch.inference_mode():
        drafted = drafter.logits(hidden)  # gathers and packs the rows
    trained = drafter.logits(hidden.requires_grad_())
    trained.sum().backward()
    assert hidden.grad is not None
    assert torch.equal(trained.detach(), drafted)


def test_save_load_keeps_the_draft_vocabulary(target, reduced, tmp_path):
    reduced.save(tmp_path / "d")
    again = Drafter.load(tmp_path / "d", target)
    assert again.config.draft_vocab == reduced.config.draft_vocab
    assert torch.equal(again.draft_to_target, reduced.draft_to_target)
    hidden = torch.randn(2, target.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(again.logits(hidden), reduced.logits(hidden))


def test_bad_draft_vocabularies_are_refused(target):
    with pytest.raises(ValueError, match="draft_vocab"):
        DrafterConfig(draft_vocab=0)
    with pytest.raises(ValueError, match="draft_vocab"):
        Drafter(target, DrafterConfig(draft_vocab=VOCAB + 1))
    with pytest.raises(ValueError, match="draft_to_target"):
        Drafter(target, DrafterConfig(draft_vocab=2), [1, 1])
    with pytest.raises(ValueError, match="draft_to_target"):
        Drafter(target, DrafterConfig(draft_vocab=2), [0, VOCAB])
    with pytest.raises(ValueError, match="draft_to_target"):
        Drafter(target, DrafterConfig(draft_vocab=2), [0, 1, 2])
    with pytest.raises(ValueError, match="draft_to_target"):
        Drafter(target, DrafterConfig(), [0, 1])
    drafter = Drafter(target, DrafterConfig(draft_vocab=2), [0, 1])
    assert exportable(drafter) is None  # a reduced vocabulary exports (with a token map)
    with pytest.raises(ValueError, match="topk"):
        cache = drafter.new_cache(1, 16)
        draft_tree(drafter, cache, torch.tensor([1]), torch.randn(1, target.config.hidden_size),
                   Strategy(2, 3, 4))
