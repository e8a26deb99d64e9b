"""Invariant "Bad input gets a clear error": a Python exception that names the argument, never
a crash, a hang or silent garbage -- including problems only the kernel can see (NaN logits at a
visited node, a bad draft distribution), which it reports per row."""

import numpy as np
import pytest
import torch

import tlt_core.ops as ops
from tests.trees import random_tree_case

CASE = random_tree_case(0, 2, 4, 10, ragged=False, chain=True)


def sampling(**overrides):
    kwargs = dict(logits=CASE.logits, tokens=CASE.tokens, parents=CASE.parents, temperature=1.0,
                  seed=0)
    kwargs.update(overrides)
    return ops.verify_tree_sampling(kwargs.pop("logits"), kwargs.pop("tokens"),
                                    kwargs.pop("parents"), **kwargs)


@pytest.mark.parametrize("overrides,error,pattern", [
    (dict(logits=CASE.logits[0]), ValueError, "logits: expected shape"),
    (dict(logits=CASE.logits.double()), TypeError, "logits: dtype"),
    (dict(logits=CASE.logits.transpose(0, 1)), ValueError, "parents|logits"),
    (dict(logits=CASE.logits.permute(0, 2, 1).contiguous().permute(0, 2, 1)), ValueError,
     "logits: must be contiguous"),
    (dict(tokens=CASE.tokens[:, :3]), ValueError, "tokens: expected shape"),
    (dict(tokens=CASE.tokens.float()), TypeError, "tokens: expected an integer dtype"),
    (dict(tokens=CASE.tokens + 100), ValueError, "tokens: node 1 of row 0"),
    (dict(parents=torch.tensor([[-1, 0, 2, 1], [-1, 0, 1, 2]])), ValueError, "parents: node 2"),
    (dict(parents=torch.tensor([[0, 0, 1, 2], [-1, 0, 1, 2]])), ValueError, "root's parent"),
    (dict(num_nodes=torch.tensor([0, 4])), ValueError, "num_nodes"),
    (dict(num_nodes=torch.tensor([5, 4])), ValueError, "num_nodes"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(temperature=torch.ones(3)), ValueError, "temperature: expected shape"),
    (dict(seed=None), ValueError, "uniforms: pass uniforms"),
    (dict(seed=None, uniforms=torch.ones(2, 4)), ValueError, "uniforms: every value"),
    (dict(seed=None, uniforms=torch.rand(2, 4).double()), TypeError, "uniforms: dtype"),
    (dict(uniforms=torch.rand(2, 4)), ValueError, "seed: pass either"),
    (dict(draft_probs=torch.rand(2, 4, 9)), ValueError, "draft_probs: expected shape"),
    (dict(draft_probs=torch.full((2, 4, 10), 0.5)), ValueError, "draft_probs: row 0"),
    (dict(logits="not an array"), TypeError, "logits: expected a torch tensor"),
])
def test_sampling_verifier_names_the_bad_argument(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        sampling(**overrides)


def test_non_finite_logits_at_a_visited_node_are_reported():
    logits = CASE.logits.clone()
    logits[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="logits: row 1"):
        sampling(logits=logits)
    with pytest.raises(ValueError, match="logits: row 1"):
        ops.verify_tree_greedy(logits, CASE.tokens, CASE.parents)
    all_masked = CASE.logits.clone()
    all_masked[0, 0, :] = float("-inf")
    with pytest.raises(ValueError, match="logits: row 0"):
        ops.verify_tree_greedy(all_masked, CASE.tokens, CASE.parents)


def test_validate_false_skips_checks_but_never_crashes():
    """The hot path may skip host checks; the kernel still stays in bounds and pads the row."""
    tokens = CASE.tokens.clone()
    tokens[0, 1] = 10**9
    out = ops.verify_tree_greedy(CASE.logits, tokens, CASE.parents, validate=False)
    assert out.emitted_tokens[0].tolist() == [-1, -1, -1, -1]
    parents = CASE.parents.clone()
    parents[1, 2] = 77
    out = ops.verify_tree_sampling(CASE.logits, CASE.tokens, parents, temperature=1.0, seed=0,
                                   validate=False)
    assert int(out.num_accepted[1]) == 0 and int(out.emitted_tokens[1, 0]) == -1


def test_tree_op_errors_name_the_argument():
    with pytest.raises(ValueError, match="cand_parents"):
        ops.select_tree(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2),
                        torch.tensor([[-1, 1]]), torch.zeros(1, dtype=torch.long), num_nodes=2)
    with pytest.raises(ValueError, match="cand_scores: contains NaN"):
        ops.select_tree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0.0, float("nan")]]),
                        torch.tensor([[-1, 0]]), torch.zeros(1, dtype=torch.long), num_nodes=2)
    with pytest.raises(ValueError, match="num_nodes"):
        ops.select_tree(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2),
                        torch.tensor([[-1, 0]]), torch.zeros(1, dtype=torch.long), num_nodes=0)
    with pytest.raises(ValueError, match="parents: N"):
        ops.tree_metadata(torch.full((1, 2000), -1))
    with pytest.raises(ValueError, match="cache_len"):
        ops.tree_metadata(torch.tensor([[-1, 0]]), cache_len=torch.tensor([-3]))
    with pytest.raises(ValueError, match="batch_dim"):
        ops.compact_kv_(torch.zeros(2, 3, 4), torch.zeros(3, 1), torch.zeros(3), torch.zeros(3),
                        batch_dim=2, seq_dim=1)
    with pytest.raises(ValueError, match="cache: must be contiguous"):
        ops.compact_kv_(torch.zeros(4, 3, 2).transpose(0, 2), torch.zeros(2, 1), torch.zeros(2),
                        torch.zeros(2), batch_dim=0, seq_dim=1)
    with pytest.raises(ValueError, match="count"):
        ops.philox_uniforms(torch.zeros(2, dtype=torch.long), 0, -1)


def test_numpy_inputs_are_checked_too():
    with pytest.raises(ValueError, match="tokens: expected shape"):
        ops.verify_tree_greedy(CASE.logits.numpy(), np.zeros((2, 3), dtype=np.int64),
                               CASE.parents.numpy())
