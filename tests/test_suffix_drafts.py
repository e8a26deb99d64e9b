"""Suffix-match drafts (tlt_core/drafting/suffix_index.py, suffix_match.py): proposals from
siblings and history, deterministic; accepted, and greedy outputs unchanged. (Sampled outputs
with suffix-match drafts: test_speculative's distribution test.)"""

import pytest

from tests.speculative_fixtures import PROMPTS
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.suffix_index import SuffixIndex


def test_proposals_come_from_siblings_and_history_deterministically():
    drafts = SuffixIndex(ngram=2)
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
        SuffixIndex(ngram=0)
    with pytest.raises(ValueError, match="depth"):
        SuffixMatch(0)


def _group_requests(n, max_tokens=24, temperature=0.0):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    return [Request(p, params) for p in PROMPTS[:3] for _ in range(n)]


def test_sibling_drafts_are_accepted_and_greedy_outputs_stay_identical(target):
    requests = _group_requests(4)
    # two rows at a time: later siblings find earlier, finished ones
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=48))
    plain = [r.tokens.tolist() for r in engine.generate(requests).rollouts]
    engine.suffix_index.new_round()  # forget the plain rollout: siblings only
    engine.suffix_index.new_round()
    result = engine.generate(requests, SuffixMatch(8))  # no drafter needed
    assert [r.tokens.tolist() for r in result.rollouts] == plain
    assert result.acceptance_length > 3.0
    # the previous rollout's responses (history) draft the whole answer at once
    again = engine.generate(requests, SuffixMatch(8))
    assert [r.tokens.tolist() for r in again.rollouts] == plain
    assert again.acceptance_length >= result.acceptance_length
