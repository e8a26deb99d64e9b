"""The CPU verifier's two paths over the vocabulary (csrc/vocab_passes.h): the AVX2 passes
(isa "auto") and the scalar loops (isa "portable") give the same tokens and paths at a real
model's vocabulary size, and log-probabilities equal to float32 rounding, with temperature,
top-k, top-p, sampled drafts, half-precision logits, -inf logits, logits so spread that exp
underflows, argmax ties, and a vocabulary that is not a multiple of eight lanes; a bad row is
bad on both paths."""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference
from tests.trees import random_tree_case

VOCAB = 49157  # SmolLM2's 49152 and five more: the passes' last partial block of eight


def both_paths(verify, *args, **kwargs):
    return [verify(*args, isa=isa, **kwargs) for isa in ("auto", "portable")]


def assert_agree(fast, portable, atol=1e-5):
    for name in ("num_accepted", "accept_index", "emitted_tokens"):
        assert torch.equal(getattr(fast, name), getattr(portable, name)), name
    torch.testing.assert_close(fast.emitted_logprobs, portable.emitted_logprobs, rtol=0,
                               atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9),
                                     (0.0, 0, 1.0)], ids=str)
@pytest.mark.parametrize("sampled", [False, True], ids=["one_hot_drafts", "sampled_drafts"])
def test_paths_agree_at_a_real_vocabulary(dtype, setting, sampled):
    temperature, top_k, top_p = setting
    case = random_tree_case(7, 3, 5, VOCAB, chain=sampled)
    logits = (case.logits * 3).to(dtype)
    g = torch.Generator().manual_seed(1)
    draft_probs = (torch.softmax(case.logits * 3 + torch.randn(case.logits.shape, generator=g),
                                 -1) if sampled else None)
    uniforms = torch.rand(3, 5, generator=g)
    fast, portable = both_paths(ops.verify_tree_sampling, logits, case.tokens, case.parents,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                uniforms=uniforms, draft_probs=draft_probs,
                                num_nodes=case.num_nodes)
    assert_agree(fast, portable)
    oracle = reference.verify_tree_sampling(logits, case.tokens, case.parents, temperature,
                                            top_k, top_p, uniforms, draft_probs=draft_probs,
                                            num_nodes=case.num_nodes)
    assert torch.equal(fast.emitted_tokens, oracle.emitted_tokens)
    if temperature == 0.0:
        assert_agree(*both_paths(ops.verify_tree_greedy, logits, case.tokens, case.parents,
                                 case.num_nodes))


def test_paths_agree_on_minus_inf_and_underflowing_logits():
    # Half the vocabulary masked to -inf, the rest spread over [-300, 0]: exp(z - m) lies below
    # float32's normal range for most tokens (the AVX2 exp gives 0 below -87, std::exp a
    # subnormal down to -103), which must change no token.
    g = torch.Generator().manual_seed(3)
    logits = -300 * torch.rand(4, 1, VOCAB, generator=g)
    logits[:, :, ::2] = float("-inf")
    logits[:, 0, 11] = 0.0
    roots = torch.zeros(4, 1, dtype=torch.int64)
    parents = torch.full((4, 1), -1, dtype=torch.int32)
    for temperature in (0.0, 0.5, 1.0, 4.0):
        fast, portable = both_paths(ops.verify_tree_sampling, logits, roots, parents,
                                    temperature=temperature, seed=5)
        assert_agree(fast, portable)


def test_argmax_is_the_lowest_id_on_both_paths():
    logits = torch.zeros(1, 1, VOCAB)
    logits[0, 0, [9, 17, 40000]] = 2.5  # ties, the first in the second block of eight
    roots = torch.zeros(1, 1, dtype=torch.int64)
    parents = torch.full((1, 1), -1, dtype=torch.int32)
    for out in both_paths(ops.verify_tree_greedy, logits, roots, parents):
        assert out.emitted_tokens[0, 0] == 9
    logits[0, 0, VOCAB - 1] = 3.0  # in the last, partial block
    for out in both_paths(ops.verify_tree_greedy, logits, roots, parents):
        assert out.emitted_tokens[0, 0] == VOCAB - 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", [100, VOCAB - 2])  # in an eight-lane block, in the tail
def test_bad_logits_are_named_on_both_paths(bad, where):
    logits = torch.randn(2, 1, VOCAB)
    logits[1, 0, where] = bad
    roots = torch.zeros(2, 1, dtype=torch.int64)
    parents = torch.full((2, 1), -1, dtype=torch.int32)
    for isa in ("auto", "portable"):
        with pytest.raises(ValueError, match="logits"):
            ops.verify_tree_sampling(logits, roots, parents, temperature=1.0, seed=0, isa=isa)
        with pytest.raises(ValueError, match="logits"):
            ops.verify_tree_greedy(logits, roots, parents, isa=isa)


def test_bad_draft_probs_are_named_on_both_paths():
    case = random_tree_case(2, 1, 3, VOCAB, ragged=False, chain=True)
    draft_probs = torch.full((1, 3, VOCAB), 1.0 / VOCAB)
    draft_probs[0, 0, VOCAB - 1] = -1e-6  # in the tail
    for isa in ("auto", "portable"):
        with pytest.raises(ValueError, match="draft_probs"):
            ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=1.0,
                                     seed=0, draft_probs=draft_probs, isa=isa)


def test_a_bad_isa_is_named():
    case = random_tree_case(1, 1, 2, 16)
    with pytest.raises(ValueError, match="isa"):
        ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=1.0,
                                 seed=0, isa="avx512")
    with pytest.raises(ValueError, match="isa"):
        ops.verify_tree_greedy(case.logits, case.tokens, case.parents, isa="fast")
