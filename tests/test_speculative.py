"""Speculative rollout: lossless against plain decoding (greedy token for token, sampled in
distribution), exact log-probs, caches equal to caches rebuilt from the accepted prefix, and a
drafter that never touches the target's tensors."""

import hashlib

import pytest
import torch
from scipy import stats

from tlt_core.adaptive.policy import AdaptivePolicy
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.training import collect_records, eagle_loss, make_batch
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.ops import reference
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy, draft_tree

from tests.speculative_fixtures import PROMPTS, VOCAB, SwitchingPolicy, tiny_target, train_drafter

STRATEGIES = [Strategy(1, 1, 1), Strategy(4, 1, 4), Strategy(5, 4, 16), Strategy(6, 8, 32)]


def state_hash(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafters(target):
    torch.manual_seed(3)
    return {"trained": train_drafter(target), "random": Drafter(target).eval()}


# ---- greedy: token for token -------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", ["trained", "random"])
def test_greedy_speculative_equals_plain(target, drafters, batch, kind):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [Request(p, params) for p in PROMPTS]  # ragged prompts, more than the batch
    engine = RolloutEngine(target, EngineConfig(max_batch=batch, max_len=48), drafters[kind])
    plain = engine.generate(requests)
    for strategy in STRATEGIES:
        spec = engine.generate(requests, strategy=strategy)
        for a, b in zip(plain.rollouts, spec.rollouts, strict=True):
            assert b.tokens.tolist() == a.tokens.tolist(), strategy
            assert torch.allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
            assert b.finish_reason == a.finish_reason
        assert spec.spec_steps
        if kind == "trained" and strategy.depth > 1:
            assert spec.decode_steps < plain.decode_steps
            assert spec.acceptance_length > 1.5, (strategy, spec.acceptance_length)


def test_trained_drafter_beats_a_random_one(target, drafters):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [Request(p, params) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafters["trained"])
    trained = engine.generate(requests, strategy=Strategy(5, 4, 16)).acceptance_length
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafters["random"])
    random_ = engine.generate(requests, strategy=Strategy(5, 4, 16)).acceptance_length
    assert trained > random_ + 1.0


def test_stop_ids_and_max_tokens_cut_a_speculative_step(target, drafters):
    """Tokens a speculative step emits past a stop id or max_tokens are dropped, exactly where
    plain decoding would have stopped; mixed greedy and sampled rows share the batch."""
    plain_requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=m, stop_ids=(s,)))
                      for p, m, s in zip(PROMPTS, [5, 9, 17, 3, 12, 20, 7, 1, 11], range(9))]
    sampled = [Request(p, SamplingParams(temperature=1.0, max_tokens=10)) for p in PROMPTS[:3]]
    engine = RolloutEngine(target, EngineConfig(max_batch=6, max_len=48), drafters["trained"])
    plain = engine.generate(plain_requests + sampled)
    spec = engine.generate(plain_requests + sampled, strategy=Strategy(6, 1, 7))
    for a, b in zip(plain.rollouts[:9], spec.rollouts[:9], strict=True):
        assert (b.tokens.tolist(), b.finish_reason) == (a.tokens.tolist(), a.finish_reason)
    assert all(len(r.tokens) == 10 for r in spec.rollouts[9:])


def test_strategy_policy_switches_per_step(target, drafters):
    """A policy may turn speculation on and off between steps (the adaptive loop's hook)."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [Request(p, params) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=48), drafters["trained"])
    plain = engine.generate(requests)
    calls = []

    def policy(batch):
        calls.append(batch)
        return Strategy(4, 2, 6) if len(calls) % 2 else None

    mixed = engine.generate(requests, strategy=policy)
    assert [r.tokens.tolist() for r in mixed.rollouts] == [r.tokens.tolist() for r in plain.rollouts]
    assert 0 < len(mixed.spec_steps) < mixed.decode_steps == len(calls)


# ---- sampled: the same distribution ------------------------------------------------------------

SAMPLED_VOCAB, CONTINUATION, SAMPLES = 4, 3, 20000


def exact_continuation_probs(model, prompt, temperature, top_p) -> torch.Tensor:
    """p(x_1 x_2 x_3 | prompt) for every continuation (V^3 cells), under the processed
    target distribution, from full-sequence passes."""
    probs = torch.ones(1)
    prefixes = [list(prompt)]
    for _ in range(CONTINUATION):
        with torch.no_grad():
            ids = torch.tensor(prefixes)
            logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -1]
        w, S = reference.processed_target_probs(logits.double().float(), temperature, 0, top_p)
        step = (w / S[:, None]).double()  # (prefixes, V)
        probs = (probs[:, None] * step).reshape(-1)
        prefixes = [p + [x] for p in prefixes for x in range(SAMPLED_VOCAB)]
    return probs


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a continuation of probability 0 was sampled"
    expected = probs[keep] / probs[keep].sum() * counts.sum()  # float32 rounding of p
    return float(stats.chisquare(counts[keep].double(), expected).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_speculative_matches_the_target_distribution(temperature, top_p):
    target = tiny_target(SAMPLED_VOCAB, seed=4, sharpen=3.0)
    drafter = train_drafter(target, steps=60)
    prompt = [1, 2, 0]
    probs = exact_continuation_probs(target, prompt, temperature, top_p)
    # The test can see a 2% shift: moving 0.02 of mass between the two likeliest cells (the
    # hardest such shift to see) gives this noncentrality; demand 90% power at alpha = 1e-3.
    cells = int((probs > 0).sum())
    top2 = probs.topk(2).values
    noncentrality = SAMPLES * 0.02 ** 2 * float(1 / top2[0] + 1 / top2[1])
    critical = stats.chi2.ppf(1 - 1e-3, cells - 1)
    assert stats.ncx2.sf(critical, cells - 1, noncentrality) > 0.9
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=CONTINUATION,
                            n=SAMPLES, seed=11)
    engine = RolloutEngine(target, EngineConfig(max_batch=512, max_len=8), drafter)
    plans = (Strategy(3, 2, 5), Strategy(3, 1, 4), SuffixMatch(2))
    # The adaptive policy too, believing every arm equal, so it explores them all; its choices
    # follow the machine's timing, so only the distribution is asserted for it.
    adaptive = AdaptivePolicy(plans, hysteresis=1, tolerance=0.9)
    for strategy in (None,) + plans + (SwitchingPolicy(plans), adaptive):
        result = engine.generate([Request(prompt, params)], strategy=strategy)
        codes = torch.stack([r.tokens for r in result.rollouts])  # (SAMPLES, 3)
        cell = (codes * torch.tensor([SAMPLED_VOCAB ** 2, SAMPLED_VOCAB, 1])).sum(1)
        counts = torch.bincount(cell, minlength=SAMPLED_VOCAB ** CONTINUATION)
        assert chi_square_pvalue(counts, probs) > 1e-3, strategy
        if strategy is not None and strategy is not adaptive:
            assert result.acceptance_length > 1.2  # the drafter's proposals were used


def test_speculative_logprobs_equal_recomputation(target, drafters):
    params = SamplingParams(temperature=1.0, max_tokens=20, n=3)
    engine = RolloutEngine(target, EngineConfig(max_batch=5, max_len=48), drafters["trained"])
    result = engine.generate([Request(p, params) for p in PROMPTS[:4]], strategy=Strategy(5, 4, 16))
    for r in result.rollouts:
        ids = torch.tensor([list(r.prompt_ids) + r.tokens.tolist()])
        with torch.no_grad():
            logits = target(ids, torch.arange(ids.shape[1])[None]).logits[0]
        logp = torch.log_softmax(logits[len(r.prompt_ids) - 1:-1], -1)
        expected = logp.gather(1, r.tokens[:, None])[:, 0]
        assert torch.allclose(r.logprobs, expected, atol=1e-4, rtol=0)


# ---- caches and tensors ------------------------------------------------------------------------

def test_caches_after_acceptance_equal_rebuilt_caches(target, drafters):
    """After a speculative step, the target's cache equals a prefill of the committed tokens
    and the drafter's cache equals a drafter prefill of the pairs (f_t, x_{t+1}) built from the
    target's full-sequence features."""
    drafter = drafters["trained"]
    engine = RolloutEngine(target, EngineConfig(max_batch=3, max_len=48), drafter)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in PROMPTS[:3]]
    strategy = Strategy(5, 4, 16)
    with torch.inference_mode():  # the engine's steps by hand, as generate runs them
        run = engine._start(requests, strategy, None, None, None)
        engine._admit(run)
        for _ in range(3):
            engine._step(run)
    for row, sample in enumerate(run.running):
        sequence = list(sample.prompt_ids) + sample.tokens[:-1]  # the root is not cached yet
        n = len(sequence)
        assert int(engine.cache.lengths[row]) == n == int(engine.drafter_rows.cache.lengths[row])
        ids = torch.tensor([sequence])
        truth = RolloutEngine(target, EngineConfig(max_batch=1, max_len=48), drafter)
        with torch.no_grad():
            out = target(ids, torch.arange(n)[None], truth.cache, hidden_layers=[-1])
            following = torch.tensor([sequence[1:] + [sample.tokens[-1]]])
            drafter(following, drafter.features([out.hidden_states[0]]), torch.arange(n)[None],
                    truth.drafter_rows.cache)
        assert (engine.cache.data[:, :, row, :, :n] - truth.cache.data[:, :, 0, :, :n]).abs().max() < 1e-4
        assert (engine.drafter_rows.cache.data[:, :, row, :, :n]
                - truth.drafter_rows.cache.data[:, :, 0, :, :n]).abs().max() < 1e-4


def test_drafter_never_modifies_the_target(target):
    before = state_hash(target)
    drafter = train_drafter(target, steps=20, feature_layers=(0, -1))  # EAGLE-3 style fusion too
    assert not any(name.startswith(("model.", "lm_head")) for name in drafter.state_dict())
    assert all(p.grad is None for p in target.parameters())
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter)
    engine.generate([Request(p, SamplingParams(temperature=1.0, max_tokens=16)) for p in PROMPTS],
                    strategy=Strategy(5, 4, 16))
    assert state_hash(target) == before


def test_drafter_checkpoint_round_trip_drafts_the_same(target, drafters, tmp_path):
    drafter = drafters["trained"]
    drafter.save(tmp_path / "drafter", metadata={"note": "test"})
    again = Drafter.load(tmp_path / "drafter", target).eval()
    engine = RolloutEngine(target, EngineConfig(max_batch=3, max_len=48), drafter)
    cache = drafter.new_cache(3, 48)
    cache.set_lengths(2)
    twin = again.new_cache(3, 48)
    twin.set_lengths(2)
    roots, hidden = torch.tensor([3, 4, 5]), torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        a = draft_tree(drafter, cache, roots, hidden, Strategy(4, 3, 10))
        b = draft_tree(again, twin, roots, hidden, Strategy(4, 3, 10))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert engine.drafter is drafter


def test_eagle_loss_pairs_tokens_with_their_own_positions(target, drafters, monkeypatch):
    """The drafter's input at position t is (f_t, x_{t+1}) and its output is scored against the
    target at t + 1 — the pairing TLT's public code gets wrong. Checked on what eagle_loss
    actually feeds the drafter, and by the loss: a drafter that outputs the target's own next
    hidden state scores zero regression."""
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (12, 7, 9)]
    records = collect_records(target, sequences, (-1,))
    batch = make_batch(records)
    drafter = drafters["trained"]
    seen = {}

    def oracle(tokens, features, positions, cache=None, **_):
        seen.update(tokens=tokens, features=features, positions=positions)
        return drafter.feature_target(batch.last_hidden[:, 1:])  # exactly the target at t + 1

    monkeypatch.setattr(drafter, "forward", oracle)
    with torch.no_grad():
        loss, metrics = eagle_loss(drafter, batch)
    for b, record in enumerate(records):
        n = record.tokens.shape[0]
        assert torch.equal(seen["tokens"][b, :n - 1], record.tokens[1:])  # x_{t+1}
        assert torch.equal(seen["features"][b, :n - 1],
                           drafter.features([record.features[:n - 1, 0]]))  # f_t
        assert torch.equal(seen["positions"][b, :n - 1], torch.arange(n - 1))  # t
    assert metrics["regression"] == 0.0 and metrics["top1"] == 1.0


def test_bad_speculative_inputs_raise_clear_errors(target, drafters):
    with pytest.raises(ValueError, match="num_verify_tokens"):
        Strategy(2, 2, 10)  # only 2 + 4 nodes can be drafted
    with pytest.raises(ValueError, match="depth"):
        Strategy(0, 1, 2)
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=16))
    with pytest.raises(ValueError, match="drafter"):
        engine.generate([Request([1, 2])], strategy=Strategy(2, 1, 3))
    other = tiny_target(seed=9)
    with pytest.raises(ValueError, match="drafter"):
        RolloutEngine(other, EngineConfig(max_batch=2, max_len=16), drafters["random"])
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=16, spec_reserve=8),
                           drafters["random"])
    with pytest.raises(ValueError, match="spec_reserve"):
        engine.generate([Request([1, 2])], strategy=Strategy(6, 8, 32))
    with pytest.raises(ValueError, match="feature_layers"):
        Drafter(target, DrafterConfig((0, 7)))


def test_speculative_benchmark_rows(tmp_path):
    """tlt bench speculative's runner on a tiny model: one row per (batch, strategy), greedy
    SD checked against plain decoding inside, and a plot."""
    from tlt_core.bench import speculative as bench
    from tlt_core.embedded.task import CharTokenizer

    target = tiny_target(CharTokenizer().vocab_size, seed=5)
    drafter = Drafter(target).eval()
    rows = bench.run(target, drafter, batches=(1, 2), strategies=(Strategy(3, 1, 4),),
                     temperature=0.0, reps=1, max_tokens=12, progress=False)
    assert [(r.batch, r.plan) for r in rows] == [(1, "(3,1,4)"), (2, "(3,1,4)")]
    assert all(r.sd_tok_s > 0 and r.plain_tok_s > 0 and r.acceptance_length >= 1 for r in rows)
    for r in rows:  # what the result files name: the step in plain steps, the dtype
        assert r.speedup_vs_plain == pytest.approx(r.sd_tok_s / r.plain_tok_s)
        assert r.step_x_plain == pytest.approx(
            (r.draft_ms + r.verify_ms + r.accept_ms) / r.plain_step_ms)
        assert r.dtype == "float32"
    bench.plot(rows, tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert bench.parse_strategy("(6,8,32)") == Strategy(6, 8, 32)


@pytest.mark.parametrize("lengths, read_len", [([5, 2, 9], None), ([6, 6, 6], None),
                                               ([6, 6, 6], 20), ([7], None)])
def test_draft_level_attention_sees_committed_slots_and_its_ancestors_only(lengths, read_len):
    """attention_plan with `before` uncommitted slots (the draft tree's earlier levels):
    checked entry by entry against the definition, tree and causal masks, for ragged rows,
    equal rows (their plan built without a per-row gather) and a fixed read_len."""
    from tlt_core.model.attention_plan import attention_plan
    from tlt_core.model.kv_cache import CacheShape, KVCache

    g = torch.Generator().manual_seed(0)
    B = len(lengths)
    cache = KVCache(CacheShape(1, B, 1, 32, 2))
    cache.set_lengths(lengths)
    before, T = 4, 3
    ancestors = torch.rand(B, T, before + T, generator=g) < 0.5
    for tree_mask in (ancestors, None):
        plan = attention_plan((B, T), cache, tree_mask, torch.device("cpu"), before=before,
                              read_len=read_len)
        assert plan.read_len == (max(lengths) + before + T if read_len is None else read_len)
        assert plan.mask.shape == (B, 1, T, plan.read_len)
        for b, length in enumerate(lengths):
            assert plan.write_slots[b].tolist() == [length + before + i for i in range(T)]
            for i in range(T):
                for s in range(plan.read_len):
                    u = s - length  # uncommitted slot index, or < 0 for committed
                    if tree_mask is None:
                        want = u <= before + i
                    else:
                        want = u < 0 or (u < before + T and (bool(ancestors[b, i, u])
                                                              or u == before + i))
                    assert bool(plan.mask[b, 0, i, s]) == want, (b, i, s)
