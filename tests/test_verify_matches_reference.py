"""Invariant "Kernels agree": the fused verifiers equal the pure-PyTorch reference bit for bit
on integer outputs (and to float rounding on log-probabilities), on many random trees and the
edge cases: N = 1, depth 1, all rejected, all accepted, ties, top_k = 1, tiny top_p,
temperature near 0, half-precision logits, sampled drafts."""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference
from tests.trees import random_tree_case


def assert_same(kernel, oracle, logprob_atol=2e-5):
    torch.testing.assert_close(kernel.num_accepted, oracle.num_accepted, rtol=0, atol=0)
    torch.testing.assert_close(kernel.accept_index, oracle.accept_index, rtol=0, atol=0)
    torch.testing.assert_close(kernel.emitted_tokens, oracle.emitted_tokens, rtol=0, atol=0)
    torch.testing.assert_close(kernel.emitted_logprobs, oracle.emitted_logprobs, rtol=0,
                               atol=logprob_atol)


ISAS = ("auto", "portable")  # the CPU verifier's AVX2 passes over V, and its scalar loops


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 4, 11), (8, 16, 50), (5, 64, 300)])
def test_greedy_matches_reference(seed, shape, isa):
    case = random_tree_case(seed, *shape, ties=seed % 2 == 0)
    kernel = ops.verify_tree_greedy(case.logits, case.tokens, case.parents, case.num_nodes,
                                    isa=isa)
    assert_same(kernel, reference.verify_tree_greedy(case.logits, case.tokens, case.parents,
                                                      case.num_nodes))


SAMPLING_SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0), (0.6, 20, 0.8), (1.0, 1, 1.0),
    (1.0, 0, 1e-6), (1e-3, 0, 1.0), (0.0, 0, 1.0), (2.0, 0, 0.5),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("setting", SAMPLING_SETTINGS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_sampling_deterministic_drafts_match_reference(seed, setting, isa):
    temperature, top_k, top_p = setting
    case = random_tree_case(100 + seed, 6, 12, 40, ties=seed == 2)
    uniforms = torch.rand(6, 12, generator=torch.Generator().manual_seed(seed))
    kernel = ops.verify_tree_sampling(case.logits, case.tokens, case.parents,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      uniforms=uniforms, num_nodes=case.num_nodes, isa=isa)
    oracle = reference.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature,
                                            top_k, top_p, uniforms, num_nodes=case.num_nodes)
    assert_same(kernel, oracle)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("setting", SAMPLING_SETTINGS[:4] + SAMPLING_SETTINGS[7:8], ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_sampling_sampled_drafts_match_reference(seed, setting, isa):
    temperature, top_k, top_p = setting
    case = random_tree_case(200 + seed, 5, 10, 30)
    g = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(case.logits + torch.randn(case.logits.shape, generator=g), -1)
    uniforms = torch.rand(5, 10, generator=g)
    kernel = ops.verify_tree_sampling(case.logits, case.tokens, case.parents,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      uniforms=uniforms, draft_probs=draft_probs,
                                      num_nodes=case.num_nodes, isa=isa)
    oracle = reference.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature,
                                            top_k, top_p, uniforms, draft_probs=draft_probs,
                                            num_nodes=case.num_nodes)
    assert_same(kernel, oracle)


def test_mixed_per_row_parameters_match_reference():
    case = random_tree_case(5, 6, 9, 64)
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0, 1.5, 0.9])
    top_k = torch.tensor([0, 0, 10, 3, 0, 1], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.95, 1.0, 0.5, 0.7, 1.0])
    uniforms = torch.rand(6, 9, generator=torch.Generator().manual_seed(1))
    kernel = ops.verify_tree_sampling(case.logits, case.tokens, case.parents,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      uniforms=uniforms, num_nodes=case.num_nodes)
    oracle = reference.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature,
                                            top_k, top_p, uniforms, num_nodes=case.num_nodes)
    assert_same(kernel, oracle)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_match_reference(dtype, isa):
    case = random_tree_case(9, 4, 8, 100)
    logits = case.logits.to(dtype)
    uniforms = torch.rand(4, 8, generator=torch.Generator().manual_seed(2))
    kernel = ops.verify_tree_sampling(logits, case.tokens, case.parents, temperature=0.8,
                                      top_p=0.9, uniforms=uniforms, num_nodes=case.num_nodes,
                                      isa=isa)
    oracle = reference.verify_tree_sampling(logits, case.tokens, case.parents, 0.8, 0, 0.9,
                                            uniforms, num_nodes=case.num_nodes)
    assert_same(kernel, oracle)
    greedy = ops.verify_tree_greedy(logits, case.tokens, case.parents, case.num_nodes, isa=isa)
    assert_same(greedy, reference.verify_tree_greedy(logits, case.tokens, case.parents,
                                                     case.num_nodes))


def test_sampling_at_temperature_zero_is_the_greedy_verifier():
    case = random_tree_case(3, 8, 16, 50, ties=True)
    greedy = ops.verify_tree_greedy(case.logits, case.tokens, case.parents, case.num_nodes)
    sampled = ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=0.0,
                                       seed=123, num_nodes=case.num_nodes)
    assert_same(sampled, greedy, logprob_atol=0)


def test_all_accepted_and_all_rejected_extremes():
    # A chain whose every draft token is the target's argmax: everything is accepted.
    case = random_tree_case(4, 3, 6, 20, ragged=False, chain=True, accept_bias=0.0)
    logits = case.logits.clone()
    for i in range(1, 6):
        logits[:, i - 1, :] = -5.0
        logits[torch.arange(3), i - 1, case.tokens[:, i]] = 5.0
    out = ops.verify_tree_greedy(logits, case.tokens, case.parents)
    assert out.num_accepted.tolist() == [5, 5, 5]
    torch.testing.assert_close(out.emitted_tokens[:, :5], case.tokens[:, 1:])
    # Draft tokens that the target never allows (top_k=1 elsewhere): nothing is accepted.
    logits = case.logits.clone()
    logits[torch.arange(3), 0, case.tokens[:, 1]] = -1e4
    out = ops.verify_tree_sampling(logits, case.tokens, case.parents, temperature=1.0, top_k=1,
                                   seed=0)
    assert out.num_accepted.tolist() == [0, 0, 0]
    assert out.emitted_tokens[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()


def test_seeded_rows_are_independent_and_reproducible():
    """Invariant "Rows are independent": a row's result depends on its own inputs and seed only."""
    case = random_tree_case(6, 6, 10, 40, ragged=False)
    seeds = torch.arange(6) * 17
    full = ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=1.0,
                                    seed=seeds, offset=5)
    again = ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=1.0,
                                     seed=seeds, offset=5)
    assert_same(full, again, logprob_atol=0)
    for b in (0, 3, 5):
        alone = ops.verify_tree_sampling(case.logits[b:b + 1], case.tokens[b:b + 1],
                                         case.parents[b:b + 1], temperature=1.0,
                                         seed=seeds[b:b + 1], offset=5)
        assert alone.emitted_tokens[0].tolist() == full.emitted_tokens[b].tolist()


def longest_matching_path(logits, tokens, parents, valid):
    """Brute force over every root path: the longest whose tokens are the argmax at their
    parents (argmax ties to the lowest id)."""
    best = [0]
    paths = [[0]]
    while paths:
        path = paths.pop()
        if len(path) > len(best):
            best = path
        v = path[-1]
        target = int(logits[v].argmax())
        for c in range(v + 1, valid):
            if int(parents[c]) == v and int(tokens[c]) == target:
                paths.append(path + [c])
    return best


@pytest.mark.parametrize("seed", range(5))
def test_greedy_accepts_exactly_the_longest_matching_path(seed):
    case = random_tree_case(300 + seed, 16, 24, 12)
    tokens = case.tokens.clone()
    # Distinct sibling tokens (as select_tree produces): re-draw duplicates.
    for b in range(16):
        for v in range(24):
            seen = set()
            for c in range(v + 1, 24):
                if int(case.parents[b, c]) == v:
                    while int(tokens[b, c]) in seen:
                        tokens[b, c] = (tokens[b, c] + 1) % 12
                    seen.add(int(tokens[b, c]))
    out = ops.verify_tree_greedy(case.logits, tokens, case.parents, case.num_nodes)
    for b in range(16):
        path = longest_matching_path(case.logits[b], tokens[b], case.parents[b],
                                     int(case.num_nodes[b]))
        assert out.accept_index[b, :len(path)].tolist() == path
        assert int(out.num_accepted[b]) == len(path) - 1
        assert int(out.emitted_tokens[b, len(path) - 1]) == int(case.logits[b, path[-1]].argmax())


# ---- property-based sweep: any small tree shape, any sampling setting ------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def verification_problems(draw):
    batch = draw(st.integers(1, 4))
    n_max = draw(st.integers(1, 12))
    vocab = draw(st.integers(1, 24))
    shape = draw(st.sampled_from(["random", "star", "chain"]))
    parents = [[-1] + [draw(st.integers(0, i - 1)) if shape == "random" else
                       (0 if shape == "star" else i - 1) for i in range(1, n_max)]
               for _ in range(batch)]
    num_nodes = [draw(st.integers(1, n_max)) for _ in range(batch)]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, n_max), generator=g)
    logits = torch.randn(batch, n_max, vocab, generator=g) * draw(st.sampled_from([0.0, 1.0, 4.0]))
    for b in range(batch):  # make acceptance likely along some edges
        for i in range(1, n_max):
            if float(torch.rand(1, generator=g)) < 0.5:
                logits[b, parents[b][i], tokens[b, i]] += 5.0
    setting = dict(temperature=draw(st.sampled_from([0.0, 1e-3, 0.5, 1.0, 2.0])),
                   top_k=draw(st.sampled_from([0, 1, 2, 5, 100])),
                   top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 1e-6])))
    sampled = draw(st.booleans())
    draft_probs = (torch.softmax(torch.randn(batch, n_max, vocab, generator=g) * 2, -1)
                   if sampled else None)
    uniforms = torch.rand(batch, n_max, generator=g)
    return (logits, tokens, torch.tensor(parents, dtype=torch.int32),
            torch.tensor(num_nodes, dtype=torch.int32), setting, draft_probs, uniforms)


@settings(max_examples=150, deadline=None)
@given(verification_problems())
def test_any_small_problem_matches_reference(problem):
    logits, tokens, parents, num_nodes, setting, draft_probs, uniforms = problem
    oracle = reference.verify_tree_sampling(logits, tokens, parents, setting["temperature"],
                                            setting["top_k"], setting["top_p"], uniforms,
                                            draft_probs=draft_probs, num_nodes=num_nodes)
    greedy_oracle = reference.verify_tree_greedy(logits, tokens, parents, num_nodes)
    for isa in ISAS:
        kernel = ops.verify_tree_sampling(logits, tokens, parents, uniforms=uniforms,
                                          draft_probs=draft_probs, num_nodes=num_nodes,
                                          isa=isa, **setting)
        assert_same(kernel, oracle)
        assert_same(ops.verify_tree_greedy(logits, tokens, parents, num_nodes, isa=isa),
                    greedy_oracle)
