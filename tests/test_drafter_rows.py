"""The drafter's per-row state (tlt_core/engine/drafter_rows.py): the lazy sync drafts exactly
as the eager one, through the engine and through the contract itself (extend, follow, flush,
move_row, free_row), and both equal one drafter pass over each row's committed pairs."""

import pytest
import torch

from tests.speculative_fixtures import PROMPTS
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import DrafterRows, EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.engine.drafter_rows import SYNCS


def _group_requests(n, max_tokens=24, temperature=0.0):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    return [Request(p, params) for p in PROMPTS[:3] for _ in range(n)]


@pytest.mark.parametrize("plan", [Strategy(4, 1, 5), Strategy(3, 2, 6)])
def test_lazy_drafter_sync_drafts_exactly_as_eager(target, drafter, plan):
    requests = _group_requests(3, max_tokens=30)
    calls = []

    def policy(batch):  # off for a while (backlog), then learned and suffix-match steps mixed
        calls.append(batch)
        step = len(calls)
        return None if step < 6 or step % 5 == 0 else (SuffixMatch(4) if step % 3 == 0 else plan)

    results = {}
    for sync in ("eager", "lazy"):
        engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64, drafter_sync=sync,
                                                    draft_backlog=64), drafter)
        calls.clear()
        results[sync] = engine.generate(requests, policy)
    eager, lazy = results["eager"], results["lazy"]
    assert [r.tokens.tolist() for r in eager.rollouts] == [r.tokens.tolist() for r in lazy.rollouts]
    assert [(s.plan_key, s.accepted) for s in eager.spec_steps] == \
        [(s.plan_key, s.accepted) for s in lazy.spec_steps]


def test_a_full_backlog_is_flushed_and_drafts_stay_the_same(target, drafter):
    requests = _group_requests(2, max_tokens=40)
    policy = lambda batch: Strategy(3, 1, 4) if batch <= 2 else None  # noqa: E731
    outs = []
    for backlog in (64, 1000):
        engine = RolloutEngine(target, EngineConfig(max_batch=6, max_len=64, spec_reserve=8,
                                                    draft_backlog=backlog), drafter)
        outs.append(engine.generate(requests, policy))
    assert ([r.tokens.tolist() for r in outs[0].rollouts]
            == [r.tokens.tolist() for r in outs[1].rollouts])
    assert [s.accepted for s in outs[0].spec_steps] == [s.accepted for s in outs[1].spec_steps]


def test_bad_sync_settings_are_named():
    with pytest.raises(ValueError, match="drafter_sync"):
        EngineConfig(drafter_sync="sometimes")
    with pytest.raises(ValueError, match="draft_backlog"):
        EngineConfig(draft_backlog=8, spec_reserve=16)


def test_the_contract_lazy_equals_eager_equals_one_pass(target, drafter):
    """Prefill (extend), plain and suffix-match steps (follow), a finished row replaced by the
    last one (move_row, free_row), a backlog that outgrows its capacity, a flush, a learned
    step (extend): every row's committed slots and last output equal a single drafter pass
    over the row's pairs, lazy and eager alike."""
    torch.manual_seed(0)
    H, V = target.config.hidden_size, target.config.vocab_size
    rows = {sync: DrafterRows(drafter, 3, 40, sync=sync, backlog_capacity=8) for sync in SYNCS}
    pairs = [[], [], []]  # per row: the committed (x_{t+1}, f_t) in order

    def commit(counts, width, how, first_row=0):
        tokens = torch.randint(0, V, (len(counts), width))  # (B, T)
        features = torch.randn(len(counts), width, H)  # (B, T, H)
        for b, count in enumerate(counts):
            pairs[first_row + b] += [(int(tokens[b, i]), features[b, i]) for i in range(count)]
        for state in rows.values():
            if how == "extend":
                state.extend(first_row, tokens, [features], torch.tensor(counts), counts)
            else:
                state.follow(0, tokens, [features], torch.tensor(counts), counts)

    with torch.inference_mode():
        commit([5, 3, 4], 5, "extend")  # prefill of ragged prompts
        for _ in range(4):
            commit([1, 1, 1], 1, "follow")  # plain steps
        commit([3, 1, 2], 3, "follow")  # a suffix-match step: 7 of 8 backlog columns used
        for state in rows.values():  # row 0 finished: the last running row takes its place
            state.move_row(2, 0)
            state.free_row(2)
        pairs[0], pairs[2] = pairs[2], []
        commit([2, 1], 2, "follow")  # past the capacity bound: tightened, no flush needed
        for state in rows.values():
            state.flush(2)
        commit([3, 2], 3, "extend")  # a learned step's accepted path
        for row in range(2):
            n = len(pairs[row])
            tokens = torch.tensor([[token for token, _ in pairs[row]]])  # (1, n)
            features = torch.stack([feature for _, feature in pairs[row]])[None]  # (1, n, H)
            truth = drafter.new_cache(1, 40)
            hidden = drafter(tokens, drafter.features([features]), torch.arange(n)[None], truth)
            for sync, state in rows.items():
                assert int(state.cache.lengths[row]) == n, sync
                torch.testing.assert_close(state.cache.data[:, :, row, :, :n],
                                           truth.data[:, :, 0, :, :n], rtol=0, atol=1e-5)
                torch.testing.assert_close(state.last_hidden[row], hidden[0, -1], rtol=0,
                                           atol=1e-5)
    assert all(int(state.cache.lengths[2]) == 0 for state in rows.values())
    with pytest.raises(ValueError, match="sync"):
        DrafterRows(drafter, 1, 8, sync="sometimes")
