"""Invariant "Bad input gets a clear error": a Python exception that names the argument, never
a crash, a hang or silent garbage -- including problems only the kernel can see (NaN logits at a
visited node, a bad draft distribution), which it reports per row."""

import numpy as np
import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference
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


# ---- integers: never narrowed silently ------------------------------------------------------

ONE_NODE = dict(logits=torch.zeros(1, 1, 4), tokens=torch.zeros(1, 1, dtype=torch.long),
                parents=torch.tensor([[-1]]))


def compact(cache_len=(0,), accept_index=((0, 1),), num_accepted=(1,), validate=True):
    cache = torch.arange(8.0).reshape(1, 1, 1, 8, 1).clone()
    ops.compact_kv_(cache, torch.tensor(accept_index), torch.tensor(num_accepted),
                    torch.tensor(cache_len), validate=validate)
    return cache


@pytest.mark.parametrize("call,name", [
    (lambda: ops.tree_metadata(torch.tensor([[-1, 2**32, 2**32 + 1]])), "parents"),
    (lambda: ops.tree_metadata(torch.tensor([[-1, 0]]), torch.tensor([2**32 + 1])), "num_nodes"),
    (lambda: ops.tree_metadata(torch.tensor([[-1, 0]]), cache_len=torch.tensor([2**32 + 1])),
     "cache_len"),
    (lambda: ops.verify_tree_greedy(CASE.logits, CASE.tokens,
                                    CASE.parents.long() + torch.tensor([0, 2**32, 0, 0])),
     "parents"),
    (lambda: ops.select_tree(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2),
                             torch.tensor([[-1, 2**32]]), torch.zeros(1, dtype=torch.long), 2),
     "cand_parents"),
    (lambda: compact(cache_len=(2**32 + 1,)), "cache_len"),
    (lambda: compact(accept_index=((0, 2**32 + 1),)), "accept_index"),
    (lambda: compact(num_accepted=(2**32 + 1,)), "num_accepted"),
    (lambda: ops.verify_tree_greedy(CASE.logits, CASE.tokens, CASE.parents,
                                    torch.from_numpy(np.array([2**64 - 1, 4], dtype=np.uint64))),
     "num_nodes"),
])
def test_integers_outside_int32_are_rejected_not_wrapped(call, name):
    """2**32 + 1 cut to int32 is 1: a different, valid-looking input."""
    with pytest.raises(ValueError, match=f"^{name}: every value must be in"):
        call()


def test_without_validation_integers_saturate_and_stay_invalid():
    """validate=False reads no values, so it cannot raise; saturating instead of wrapping keeps
    an out-of-range value out of range, and the kernel treats its row as bad."""
    meta = ops.tree_metadata(torch.tensor([[-1, 0, 2**32 + 1]]), validate=False)
    assert meta.depths.tolist() == [[0, 0, 0]]  # a bad row is all padding, not a chain
    untouched = torch.arange(8.0).reshape(1, 1, 1, 8, 1)
    assert torch.equal(compact(cache_len=(2**32 + 1,), accept_index=((0, 2),), validate=False),
                       untouched)
    assert torch.equal(compact(num_accepted=(2**32 + 1,), validate=False), untouched)


def test_top_k_beyond_int32_means_off_as_in_the_reference():
    """Every k >= V is "off": clamping k into int32 keeps that, where wrapping 2**32 + 1 to 1
    made it top-1."""
    logits = torch.randn(2, 1, 50)
    tokens, parents = torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), -1)
    uniforms = torch.rand(2, 1)
    want = ops.verify_tree_sampling(logits, tokens, parents, temperature=1.0, uniforms=uniforms)
    for top_k in (2**32 + 1, torch.tensor([2**40, -2**63])):
        got = ops.verify_tree_sampling(logits, tokens, parents, temperature=1.0, top_k=top_k,
                                       uniforms=uniforms, validate=False)
        assert torch.equal(got.emitted_tokens, want.emitted_tokens)


# ---- types: an int where an int is meant, a real number where a real one is ------------------

@pytest.mark.parametrize("call,name", [
    (lambda: sampling(top_k=2.5), "top_k"),
    (lambda: sampling(top_k=True), "top_k"),
    (lambda: sampling(top_k=torch.tensor([1.0, 2.0])), "top_k"),
    (lambda: sampling(seed=1.5), "seed"),
    (lambda: sampling(offset=True), "offset"),
    (lambda: sampling(temperature=True), "temperature"),
    (lambda: sampling(temperature=1 + 0j), "temperature"),
    (lambda: sampling(temperature=torch.ones(2, dtype=torch.complex64)), "temperature"),
    (lambda: sampling(top_p=torch.ones(2, dtype=torch.bool)), "top_p"),
    (lambda: sampling(num_nodes=torch.ones(2, dtype=torch.bool)), "num_nodes"),
    (lambda: ops.philox_uniforms(torch.zeros(2, dtype=torch.long), 0, True), "count"),
    (lambda: ops.philox_uniforms(torch.zeros(2, dtype=torch.long), 0, 3.0), "count"),
    (lambda: ops.philox_uniforms(torch.zeros(2), 0, 3), "seeds"),
    (lambda: ops.select_tree(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2),
                             torch.tensor([[-1, 0]]), torch.zeros(1, dtype=torch.long), True),
     "num_nodes"),
    (lambda: ops.unpack_tree_mask(torch.ones(1, 3, 1), 3), "mask"),
    (lambda: ops.unpack_tree_mask(torch.ones(1, 3, 1, dtype=torch.int32), 3.0), "num_nodes_max"),
    (lambda: ops.compact_kv_(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                             batch_dim=True), "batch_dim"),
    (lambda: ops.verify_tree_greedy(CASE.logits, CASE.tokens.numpy().astype(object),
                                    CASE.parents), "tokens"),
])
def test_non_integers_and_non_reals_are_rejected_by_name(call, name):
    with pytest.raises(TypeError, match=f"^({name}):"):
        call()


# ---- each op names its own arguments --------------------------------------------------------

@pytest.mark.parametrize("call,pattern", [
    (lambda: ops.compact_kv_(torch.zeros(1, 1, 1, 8, 1), torch.zeros(1, 0, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)),
     "^accept_index: N = 0"),
    (lambda: ops.compact_kv_(torch.zeros(1, 1, 1, 8, 1), torch.zeros(1, 2000, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)),
     "^accept_index: N = 2000"),
    (lambda: compact(num_accepted=(2,)), "^num_accepted: every value must be in \\[0, 1\\]"),
    (lambda: compact(accept_index=((1, 0),)), "^accept_index: row 0 is not an accepted path"),
    (lambda: compact(cache_len=(-1,)), "^cache_len: every value must be in \\[0,"),
    (lambda: compact(cache_len=(7,)),
     "^cache_len: row 0's accepted node 1 sits at slot cache_len \\+ 1 = 8"),
    (lambda: ops.compact_kv_(torch.zeros(3), torch.zeros(1, 1), torch.zeros(1), torch.zeros(1)),
     "^cache: needs a batch dim"),
    (lambda: ops.compact_kv_(torch.zeros(1, 1, 4, 0), torch.zeros(1, 1), torch.zeros(1),
                             torch.zeros(1), batch_dim=0, seq_dim=2), "^cache: a token's entry"),
    (lambda: ops.compact_kv_(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1), torch.zeros(1),
                             torch.zeros(1), batch_dim=7), "^batch_dim: must be in"),
    (lambda: ops.select_tree(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2),
                             torch.tensor([[-1, 1]]), torch.zeros(1, dtype=torch.long), 2),
     "^cand_parents:"),
    (lambda: ops.unpack_tree_mask(torch.ones(1, 4, 1, dtype=torch.int32), 3), "^mask: expected"),
    (lambda: sampling(uniforms=torch.rand(2, 4), seed=None, offset=3), "^offset:"),
])
def test_errors_name_the_ops_own_arguments(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_row_status_messages_are_worded_per_op():
    for problems in (ops._VERIFY_PROBLEMS, ops._TREE_PROBLEMS, ops._SELECT_PROBLEMS,
                     ops._COMPACT_PROBLEMS):
        assert problems  # every op that reads a row status has its own table
    assert {name for name, _ in ops._SELECT_PROBLEMS.values()} == {"cand_parents"}
    assert {name for name, _ in ops._COMPACT_PROBLEMS.values()} <= {
        "accept_index", "num_accepted", "cache_len"}
    assert {name for name, _ in ops._TREE_PROBLEMS.values()} <= {"parents", "num_nodes"}


# ---- per-row parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("overrides,name", [
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1e-50), "top_p"),  # rounds to 0 in float32: +inf log-probs
    (dict(top_p=float("nan")), "top_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e300), "temperature"),  # inf in float32
    (dict(temperature=10**400), "temperature"),
    (dict(temperature=1e-42), "temperature"),
    (dict(seed=2**64), "seed"),
])
def test_number_parameters_are_checked_even_without_validation(overrides, name):
    """Checking a Python number costs no host sync, so validate=False checks it too."""
    with pytest.raises(ValueError, match=f"^{name}:"):
        sampling(validate=False, **overrides)


@pytest.mark.parametrize("temperature", [1e-42, 1e-7, torch.tensor([1.0, 1e-30]),
                                         torch.tensor([1e-300, 1.0], dtype=torch.float64)])
def test_a_tiny_temperature_is_named_not_blamed_on_the_logits(temperature):
    """A positive temperature below MIN_TEMPERATURE overflows l / T in float32 (the kernel would
    report the logits as bad) or rounds to 0 (silently greedy); the reference agrees."""
    with pytest.raises(ValueError, match="^temperature: must be 0 \\(greedy\\)"):
        sampling(temperature=temperature)
    as_float32 = torch.as_tensor(temperature).float().expand(2)
    if bool((as_float32 > 0).all()):
        with pytest.raises(ValueError, match="temperature"):
            reference.verify_tree_sampling(CASE.logits, CASE.tokens, CASE.parents, as_float32,
                                           0, 1.0, torch.rand(2, 4))
    smallest = sampling(temperature=ops.MIN_TEMPERATURE, uniforms=torch.rand(2, 4), seed=None)
    assert smallest.emitted_tokens.shape == (2, 4)
