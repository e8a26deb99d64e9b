"""Invariant "Lossless, sampled": the tokens a verification step emits, continued with target
samples, are distributed exactly as sampling from the target token by token.

Checked exactly (tests/lossless_model.py walks the algorithm with probabilities), and by Monte
Carlo on the kernel with a chi-square test. Both checks must also *fail* on a deliberately wrong
verifier (no residual / no zeroing of rejected drafts), or they would prove nothing.
"""

import numpy as np
import pytest
import torch
from scipy import stats

import tlt_core.ops as ops
from tlt_core.ops import reference
from tests.lossless_model import (ToyLanguage, complete_samples, completed_distribution,
                                  exact_emission)

CONTEXT = (1, 2)
# root -> {1, 2}, 1 -> {3}, 3 -> {4}: siblings, a chain, and depth 3 (L = 4 tokens at most).
PARENTS = [-1, 0, 0, 1, 3]
LENGTH = 4
SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 0, 0.9),
    (1.3, 3, 1.0),
    (0.0, 0, 1.0),
]


def draft_tokens(lang: ToyLanguage) -> list[int]:
    """Deterministic EAGLE-style drafts: the q_draft top choices along the first branch."""
    top = lambda ctx: [int(t) for t in np.argsort(-lang.q_draft(CONTEXT + ctx), kind="stable")]
    first, second = top(())[:2]
    third = top((first,))[0]
    fourth = top((first, third))[0]
    return [0, first, second, third, fourth]


def max_deviation(lang: ToyLanguage, emitted: dict) -> float:
    completed = completed_distribution(lang, CONTEXT, emitted, LENGTH)
    target = lang.sequence_probs(CONTEXT, LENGTH)
    return max(abs(completed[s] - target[s]) for s in target)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_exact_deterministic_drafts_are_lossless(temperature, top_k, top_p):
    lang = ToyLanguage(vocab=4, temperature=temperature, top_k=top_k, top_p=top_p)
    emitted = exact_emission(lang, CONTEXT, PARENTS, draft_tokens(lang))
    assert abs(sum(emitted.values()) - 1.0) < 1e-9
    assert max_deviation(lang, emitted) < 1e-9


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS[:3])
def test_exact_sampled_drafts_are_lossless(temperature, top_k, top_p):
    lang = ToyLanguage(vocab=3, temperature=temperature, top_k=top_k, top_p=top_p)
    emitted = exact_emission(lang, CONTEXT, PARENTS, None)
    assert abs(sum(emitted.values()) - 1.0) < 1e-6
    assert max_deviation(lang, emitted) < 1e-6


def test_exact_check_catches_mutations():
    lang = ToyLanguage(vocab=4, temperature=1.0, top_k=0, top_p=1.0)
    kept = exact_emission(lang, CONTEXT, PARENTS, draft_tokens(lang), zero_rejected=False)
    assert max_deviation(lang, kept) > 1e-2
    lang3 = ToyLanguage(vocab=3, temperature=1.0, top_k=0, top_p=1.0)
    no_residual = exact_emission(lang3, CONTEXT, PARENTS, None, residual=lambda w, q, s: w)
    assert max_deviation(lang3, no_residual) > 1e-2


# ---- Monte Carlo on the kernel -------------------------------------------------------------


def chi_square_pvalue(samples: list[tuple], target: dict[tuple, float]) -> float:
    """Goodness of fit of sampled sequences to target; cells with tiny expectation pooled."""
    counts = {s: 0 for s in target}
    for s in samples:
        counts[s] += 1
    n = len(samples)
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for s, prob in target.items():
        if prob * n >= 5:
            observed.append(counts[s])
            expected.append(prob * n)
        else:
            pooled_obs += counts[s]
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    return float(stats.chisquare(observed, expected).pvalue)


def batch_inputs(lang: ToyLanguage, rows: int, sampled: bool, rng: np.random.Generator):
    """(logits, tokens, parents, draft_probs) for `rows` copies of the step; sampled drafts
    are drawn per row from q_draft along each node's context."""
    n = len(PARENTS)
    fixed = draft_tokens(lang)
    logits = torch.empty(rows, n, lang.vocab)
    tokens = torch.zeros(rows, n, dtype=torch.int64)
    draft_probs = torch.empty(rows, n, lang.vocab) if sampled else None
    for b in range(rows):
        contexts = [()]
        for node in range(1, n):
            parent_ctx = contexts[PARENTS[node]]
            if sampled:
                q = lang.q_draft(CONTEXT + parent_ctx)
                tokens[b, node] = int(rng.choice(lang.vocab, p=q / q.sum()))
            else:
                tokens[b, node] = fixed[node]
            contexts.append(parent_ctx + (int(tokens[b, node]),))
        for node, ctx in enumerate(contexts):
            logits[b, node] = lang.logits(CONTEXT + ctx)
            if sampled:
                draft_probs[b, node] = torch.from_numpy(lang.q_draft(CONTEXT + ctx)).float()
    parents = torch.tensor([PARENTS] * rows, dtype=torch.int32)
    return logits, tokens, parents, draft_probs


def emitted_sequences(out) -> list[tuple]:
    sequences = []
    for b in range(out.emitted_tokens.shape[0]):
        count = int(out.num_accepted[b]) + 1
        sequences.append(tuple(int(t) for t in out.emitted_tokens[b, :count]))
    return sequences


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS[:3])
def test_monte_carlo_kernel_is_lossless(sampled, temperature, top_k, top_p):
    rows = 6000
    rng = np.random.default_rng(7)
    lang = ToyLanguage(vocab=3, temperature=temperature, top_k=top_k, top_p=top_p)
    logits, tokens, parents, draft_probs = batch_inputs(lang, rows, sampled, rng)
    out = ops.verify_tree_sampling(logits, tokens, parents, temperature=temperature,
                                   top_k=top_k, top_p=top_p, draft_probs=draft_probs,
                                   seed=torch.arange(rows), offset=3)
    samples = complete_samples(lang, CONTEXT, emitted_sequences(out), LENGTH, rng)
    assert chi_square_pvalue(samples, lang.sequence_probs(CONTEXT, LENGTH)) > 1e-4


def test_monte_carlo_catches_a_wrong_residual():
    """The same Monte-Carlo check rejects the reference run with the residual left out."""
    rows = 2500
    rng = np.random.default_rng(11)
    lang = ToyLanguage(vocab=3, temperature=1.0, top_k=0, top_p=1.0)
    logits, tokens, parents, draft_probs = batch_inputs(lang, rows, True, rng)
    uniforms = torch.from_numpy(rng.random((rows, len(PARENTS)), dtype=np.float32))
    out = reference.verify_tree_sampling(logits, tokens, parents, 1.0, 0, 1.0, uniforms,
                                         draft_probs=draft_probs,
                                         residual=lambda w, q, s: w.clone())
    samples = complete_samples(lang, CONTEXT, emitted_sequences(out), LENGTH, rng)
    assert chi_square_pvalue(samples, lang.sequence_probs(CONTEXT, LENGTH)) < 1e-4
