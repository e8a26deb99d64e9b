"""Model-free drafts (tlt_core/model_free.py) and the engine's lazy drafter sync. (Sampled
outputs with model-free drafts: test_speculative's distribution test.)"""

import pytest

from tests.speculative_fixtures import PROMPTS
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model_free import ModelFree, SuffixDrafts
from tlt_core.speculative import Strategy


def test_proposals_come_from_siblings_and_history_deterministically():
    drafts = SuffixDrafts(ngram=2)
    ahead, behind, other = [5, 6, 7, 8, 9], [5, 6], [5, 6, 1, 1]
    drafts.track("ahead", (1, 2), ahead)
    drafts.track("behind", (1, 2), behind)
    drafts.track("other", (3, 4), other)  # another prompt: never a sibling
    assert drafts.propose("behind", 3) == [7, 8, 9]
    behind.append(7)  # live lists are read, not copied
    assert drafts.propose("behind", 5) == [8, 9]
    assert drafts.propose("ahead", 3) == []  # nobody is ahead of it
    assert drafts.propose("other", 3) == []
    drafts.new_round()  # the rollout's responses become history
    fresh = [5]
    drafts.track("fresh", (1, 2), fresh)
    assert drafts.propose("fresh", 4) == [6, 7, 8, 9]  # the first history sequence, 'ahead'
    drafts.add_history((7, 8), [[9, 9, 9]])
    newcomer = []
    drafts.track("newcomer", (7, 8), newcomer)
    assert drafts.propose("newcomer", 2) == [9, 9]  # after the prompt's last two tokens
    with pytest.raises(ValueError, match="ngram"):
        SuffixDrafts(ngram=0)
    with pytest.raises(ValueError, match="depth"):
        ModelFree(0)


def _group_requests(n, max_tokens=24, temperature=0.0):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    return [Request(p, params) for p in PROMPTS[:3] for _ in range(n)]


def test_sibling_drafts_are_accepted_and_greedy_outputs_stay_identical(target):
    requests = _group_requests(4)
    # two rows at a time: later siblings find earlier, finished ones
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=48))
    plain = [r.tokens.tolist() for r in engine.generate(requests).rollouts]
    engine.model_free.new_round()  # forget the plain rollout: siblings only
    engine.model_free.new_round()
    result = engine.generate(requests, ModelFree(8))  # no drafter needed
    assert [r.tokens.tolist() for r in result.rollouts] == plain
    assert result.acceptance_length > 3.0
    # the previous rollout's responses (history) draft the whole answer at once
    again = engine.generate(requests, ModelFree(8))
    assert [r.tokens.tolist() for r in again.rollouts] == plain
    assert again.acceptance_length >= result.acceptance_length


@pytest.mark.parametrize("plan", [Strategy(4, 1, 5), Strategy(3, 2, 6)])
def test_lazy_drafter_sync_drafts_exactly_as_eager(target, drafter, plan):
    requests = _group_requests(3, max_tokens=30)
    calls = []

    def policy(batch):  # off for a while (backlog), then learned and model-free steps mixed
        calls.append(batch)
        step = len(calls)
        return None if step < 6 or step % 5 == 0 else (ModelFree(4) if step % 3 == 0 else plan)

    results = {}
    for sync in ("eager", "lazy"):
        engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64, drafter_sync=sync,
                                                    draft_backlog=64), drafter)
        calls.clear()
        results[sync] = engine.generate(requests, policy)
    eager, lazy = results["eager"], results["lazy"]
    assert [r.tokens.tolist() for r in eager.rollouts] == [r.tokens.tolist() for r in lazy.rollouts]
    assert [(s.strategy, s.accepted) for s in eager.spec_steps] == \
        [(s.strategy, s.accepted) for s in lazy.spec_steps]


def test_a_full_backlog_is_flushed_and_drafts_stay_the_same(target, drafter):
    requests = _group_requests(2, max_tokens=40)
    policy = lambda batch: Strategy(3, 1, 4) if batch <= 2 else None  # noqa: E731
    outs = []
    for backlog in (64, 1000):
        engine = RolloutEngine(target, EngineConfig(max_batch=6, max_len=64, spec_reserve=8,
                                                    draft_backlog=backlog), drafter)
        outs.append(engine.generate(requests, policy))
    assert [r.tokens.tolist() for r in outs[0].rollouts] == [r.tokens.tolist() for r in outs[1].rollouts]
    assert [s.accepted for s in outs[0].spec_steps] == [s.accepted for s in outs[1].spec_steps]


def test_bad_sync_settings_are_named():
    with pytest.raises(ValueError, match="drafter_sync"):
        EngineConfig(drafter_sync="sometimes")
    with pytest.raises(ValueError, match="draft_backlog"):
        EngineConfig(draft_backlog=8, spec_reserve=16)
