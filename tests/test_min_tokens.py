"""SamplingParams.min_tokens: a row's stop ids have probability 0 until it holds min_tokens
tokens, in plain, speculative and fixed-shape steps alike, so speculation stays lossless: greedy
rows equal a naive loop that masks the stops (float32), sampled rows follow the masked
distribution (chi-square), and the log-probs are the masked distribution's."""

import pytest
import torch
from scipy import stats

from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.engine.rows import RowState
from tlt_core.ops import reference
from tests.speculative_fixtures import PROMPTS, SwitchingPolicy, tiny_target, train_drafter

PLANS = (Strategy(4, 1, 5), Strategy(3, 2, 6), SampledChain(3))


def greedy_masked(model, prompt, stop_ids, min_tokens, max_tokens) -> list[int]:
    """Greedy decoding by full-sequence passes, the stops masked before min_tokens."""
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1]
            if len(out) < min_tokens:
                logits[list(stop_ids)] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            if out[-1] in stop_ids:
                break
    return out


def frequent_greedy_tokens(model, count: int) -> tuple[int, ...]:
    """The tokens greedy decoding of PROMPTS emits most: as stop ids they end rows early, so
    masking them changes the output."""
    tallies = torch.zeros(model.config.vocab_size, dtype=torch.int64)
    for prompt in PROMPTS:
        for token in greedy_masked(model, prompt, (), 0, 12):
            tallies[token] += 1
    return tuple(int(t) for t in tallies.topk(count).indices)


@pytest.fixture(scope="module")
def drafter(target):
    return train_drafter(target)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed_shapes"])
def test_greedy_rows_equal_a_loop_that_masks_the_stops(target, drafter, graphs):
    stops = frequent_greedy_tokens(target, 2)
    lengths = [(0, 12), (5, 12), (12, 12), (1, 3), (7, 9), (3, 20), (0, 1), (9, 16), (2, 5)]
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=n, min_tokens=m,
                                          stop_ids=stops))
                for p, (m, n) in zip(PROMPTS, lengths)]
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48, graphs=graphs), drafter)
    plain = engine.generate(requests)
    stopped_early = 0
    for rollout, (m, n) in zip(plain.rollouts, lengths, strict=True):
        want = greedy_masked(target, PROMPTS[rollout.request_index], stops, m, n)
        assert rollout.tokens.tolist() == want
        assert not set(want[:m]) & set(stops) and len(want) >= min(m + 1, n)
        stopped_early += len(want) < n
    assert stopped_early  # the stops are live past min_tokens
    for strategy in PLANS + (SwitchingPolicy(PLANS),):
        spec = engine.generate(requests, strategy=strategy)
        for a, b in zip(plain.rollouts, spec.rollouts, strict=True):
            assert (b.tokens.tolist(), b.finish_reason) == (a.tokens.tolist(), a.finish_reason)
            torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_logprobs_are_the_masked_distribution(target, drafter):
    """Every stop id is masked (min_tokens = max_tokens): no row stops, each decodes exactly
    max_tokens tokens, and each log-prob is the one its token has once the stops' mass is
    gone."""
    stops = frequent_greedy_tokens(target, 3)
    params = SamplingParams(temperature=1.0, max_tokens=10, min_tokens=10, stop_ids=stops, n=4)
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=32), drafter)
    for strategy in (None, SampledChain(3), Strategy(3, 2, 6)):
        result = engine.generate([Request(p, params) for p in PROMPTS[:4]], strategy=strategy)
        for rollout in result.rollouts:
            tokens = rollout.tokens.tolist()
            assert len(tokens) == 10 and not set(tokens) & set(stops)
            ids = list(rollout.prompt_ids) + tokens
            with torch.no_grad():
                logits = target(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0]
            logits = logits[len(rollout.prompt_ids) - 1:-1]  # (10, V) each token's logits
            logits[:, list(stops)] = float("-inf")
            want = logits.log_softmax(-1).gather(1, rollout.tokens[:, None])[:, 0]
            torch.testing.assert_close(rollout.logprobs, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_sampled_rows_follow_the_masked_distribution():
    """x1 x2 x3 after a prompt, stop id 0 masked for the first two tokens: each plan's counts
    against the exact masked probabilities (chi-square, 20000 samples)."""
    vocab, samples, stop = 4, 20000, 0
    target = tiny_target(vocab, seed=4, sharpen=3.0)
    drafter = train_drafter(target, steps=60)
    prompt = [1, 2, 3]
    probs = torch.ones(1, dtype=torch.float64)
    prefixes = [prompt]
    for position in range(3):
        with torch.no_grad():
            ids = torch.tensor(prefixes)
            logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -1]
        if position < 2:
            logits[:, stop] = float("-inf")
        w, S = reference.processed_target_probs(logits, 1.0, 0, 1.0)
        probs = (probs[:, None] * (w / S[:, None]).double()).reshape(-1)
        prefixes = [p + [x] for p in prefixes for x in range(vocab)]
    params = SamplingParams(temperature=1.0, max_tokens=3, min_tokens=2, stop_ids=(stop,),
                            n=samples, seed=7)
    engine = RolloutEngine(target, EngineConfig(max_batch=512, max_len=8), drafter)
    for strategy in (None, Strategy(3, 2, 5), SampledChain(3)):
        result = engine.generate([Request(prompt, params)], strategy=strategy)
        codes = torch.stack([r.tokens for r in result.rollouts])  # (samples, 3)
        counts = torch.bincount((codes * torch.tensor([vocab ** 2, vocab, 1])).sum(1),
                                minlength=vocab ** 3)
        keep = probs > 0
        assert int(counts[~keep].sum()) == 0, "a stop id was sampled before min_tokens"
        expected = probs[keep] / probs[keep].sum() * samples
        assert stats.chisquare(counts[keep].double(), expected).pvalue > 1e-3, strategy


def test_rows_carry_their_masks_when_they_move():
    rows = RowState(3, torch.device("cpu"))
    rows.admit(2, 5, SamplingParams(max_tokens=9, min_tokens=4, stop_ids=(7, 3)), 6)
    rows.move(2, 0)
    assert int(rows.stops_from[0]) == 6 + 4 - 1
    assert rows.masked_stops[0].tolist() == [3, 7] + [3] * 6
    logits = torch.zeros(1, 2, 10)
    rows.mask_stops(logits, torch.tensor([[8, 9]]), slice(0, 1))  # position 9: stops allowed
    assert logits[0, 0, [3, 7]].isneginf().all() and not logits[0, 1].isinf().any()
    assert not logits[0, 0, [0, 1, 2, 4, 5, 6, 8, 9]].isinf().any()


def test_bad_min_tokens_fail_clearly(target):
    for bad, pattern in [(dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9), "min_tokens"),
                         (dict(min_tokens=1.5), "min_tokens"),
                         (dict(min_tokens=1, stop_ids=tuple(range(9))), "stop_ids")]:
        with pytest.raises(ValueError, match=pattern):
            SamplingParams(max_tokens=8, **bad)
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=32))
    with pytest.raises(ValueError, match=r"params\.stop_ids: token id 99"):
        engine.generate([Request([1, 2], SamplingParams(max_tokens=4, min_tokens=2,
                                                        stop_ids=(99,)))])
