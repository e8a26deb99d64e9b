"""Invariant "Cache truth": after verification and compaction, each row's KV cache equals the
cache built from the committed prefix plus the accepted path alone."""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference
from tests.trees import random_tree_case


def tree_pass_and_truth(layout_shape, batch_dim, seq_dim, dtype, seed):
    """A cache after a tree verification pass, the accepted paths, and the expected cache."""
    g = torch.Generator().manual_seed(seed)
    batch, n_max = layout_shape[batch_dim], 12
    max_len = layout_shape[seq_dim]
    case = random_tree_case(seed, batch, n_max, 30)
    out = ops.verify_tree_greedy(case.logits, case.tokens, case.parents, case.num_nodes)
    cache_len = torch.randint(0, max_len - n_max, (batch,), generator=g, dtype=torch.int32)
    cache = (torch.randn(layout_shape, generator=g) * 10).to(dtype)  # prefix + tree nodes
    truth = cache.clone()
    moved = truth.movedim((batch_dim, seq_dim), (0, 1))  # (B, T, ...) view of truth
    source = cache.movedim((batch_dim, seq_dim), (0, 1))
    for b in range(batch):
        base = int(cache_len[b])
        for j in range(int(out.num_accepted[b]) + 1):
            moved[b, base + j] = source[b, base + int(out.accept_index[b, j])]
    return cache, truth, out, cache_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_compaction_equals_cache_of_accepted_prefix(layout, dtype):
    if layout == "head_major":  # (layers, 2, B, H_kv, T, head_dim): the engine's layout
        shape, batch_dim, seq_dim = (3, 2, 5, 2, 40, 8), -4, -2
    else:  # (layers * 2, B, T, H_kv * head_dim)
        shape, batch_dim, seq_dim = (6, 5, 40, 16), -3, -2
    cache, truth, out, cache_len = tree_pass_and_truth(shape, batch_dim % len(shape),
                                                       seq_dim % len(shape), dtype, seed=3)
    result = ops.compact_kv_(cache, out.accept_index, out.num_accepted, cache_len,
                             batch_dim=batch_dim, seq_dim=seq_dim)
    assert result is cache
    b_axis, t_axis = batch_dim % len(shape), seq_dim % len(shape)
    for b in range(shape[b_axis]):
        kept = int(cache_len[b]) + int(out.num_accepted[b]) + 1
        got = cache.select(b_axis, b).narrow(t_axis - 1, 0, kept)
        want = truth.select(b_axis, b).narrow(t_axis - 1, 0, kept)
        assert torch.equal(got, want), f"row {b}"


def test_compaction_matches_reference_on_odd_entry_sizes():
    g = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 255, (2, 4, 3, 20, 5), generator=g, dtype=torch.uint8)  # 5-byte entries
    accept_index = torch.tensor([[0, 2, 5, -1], [0, 1, 2, 3], [0, -1, -1, -1], [0, 3, -1, -1]],
                                dtype=torch.int32)
    num_accepted = torch.tensor([2, 3, 0, 1], dtype=torch.int32)
    cache_len = torch.tensor([0, 4, 9, 13], dtype=torch.int32)
    want = reference.compact_kv(cache, accept_index, num_accepted, cache_len)
    ops.compact_kv_(cache, accept_index, num_accepted, cache_len, batch_dim=1, seq_dim=3)
    assert torch.equal(cache, want)


def test_compaction_rejects_paths_that_leave_the_cache():
    cache = torch.zeros(2, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="cache_len"):
        ops.compact_kv_(cache, torch.tensor([[0, 3], [0, 1]]), torch.tensor([1, 1]),
                        torch.tensor([5, 0]), batch_dim=1, seq_dim=3)
