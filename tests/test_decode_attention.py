"""The CPU attention kernel (tlt_core.ops.decode_attention, csrc/include/tlt/attention.h):
equal to attention's math to float32 rounding, each query's bits independent of everything but
its q and the slots it sees (what makes a token verified in a tree match it decoded alone),
bad input named, and an engine decoding through it as through PyTorch's attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tlt_core.drafting.tree import Strategy
from tlt_core.ops import DecodeAttention, decode_attention, reference
from tests.pass_kernel_flags import assert_bf16_pass_alike, assert_engine_decodes_alike

ATOL = 3e-6  # unit-scale data: float32 rounding of sums over a few hundred slots


def _problem(B, H_q, H_kv, T, d, S, max_len=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, T, d, generator=g)
    cache = torch.randn(2, B, H_kv, max_len or S, d, generator=g)
    return q, cache


# (B, H_q, H_kv, T, d, S): SmolLM2's heads at one and five tokens; multi-head; several slot
# chunks; d of two V blocks, full and partial; a d that is no multiple of 8 (the portable loop)
SHAPES = [(1, 9, 3, 1, 64, 200), (2, 9, 3, 5, 64, 37), (3, 4, 4, 3, 16, 20),
          (1, 8, 2, 16, 128, 300), (1, 4, 2, 3, 80, 90), (2, 6, 3, 2, 12, 70),
          (1, 2, 1, 1, 8, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_equals_attention_math_to_float32_rounding(shape, masked):
    B, H_q, H_kv, T, d, S = shape
    q, cache = _problem(B, H_q, H_kv, T, d, S, max_len=S + 7)
    mask = None
    if masked:
        mask = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(1)) < 0.6
        mask[..., 0] = True
    want = reference.decode_attention(q, cache, S, mask)
    got = decode_attention(q, cache, S, mask)
    assert got.shape == (B * T, H_q * d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL)
    # what the packed pass computed before: PyTorch's attention, transposed to (B T, H_q d)
    sdpa = F.scaled_dot_product_attention(q, cache[0, :, :, :S], cache[1, :, :, :S],
                                          attn_mask=mask, enable_gqa=H_q != H_kv)
    torch.testing.assert_close(got, sdpa.transpose(1, 2).reshape(B * T, H_q * d), rtol=0,
                               atol=2 * ATOL)


def test_bf16_output_is_the_float32_output_rounded_once():
    q, cache = _problem(2, 9, 3, 5, 64, 80)
    mask = torch.ones(5, 80, dtype=torch.bool).tril(75)[None, None]
    wide = decode_attention(q, cache, 80, mask)
    narrow = decode_attention(q, cache, 80, mask, out_dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow.view(torch.int16), wide.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_a_bf16_cache_gives_the_bits_of_a_float32_cache_holding_its_values(shape, masked):
    """A bf16 model's cache holds bf16 values: read as bf16 and widened in the kernel, they give
    every output bit of the same values held in float32 (every path: the AVX-512 shared slots,
    AVX2, the portable loop), while the bytes read halve."""
    B, H_q, H_kv, T, d, S = shape
    q, cache = _problem(B, H_q, H_kv, T, d, S, max_len=S + 7)
    q16, cache16 = q.to(torch.bfloat16), cache.to(torch.bfloat16)
    mask = None
    if masked:
        mask = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(1)) < 0.6
        mask[..., 0] = True
    for out_dtype in (torch.float32, torch.bfloat16):
        narrow = decode_attention(q16, cache16, S, mask, out_dtype=out_dtype)
        wide = decode_attention(q16.float(), cache16.float(), S, mask, out_dtype=out_dtype)
        assert narrow.dtype == out_dtype
        assert torch.equal(narrow.view(torch.int16 if out_dtype == torch.bfloat16
                                       else torch.int32),
                           wide.view(torch.int16 if out_dtype == torch.bfloat16
                                     else torch.int32))


def test_a_bf16_cache_sliced_from_a_wider_one_reads_its_own_strides():
    """Layer and row views of a bf16 cache (strides in bf16 elements) read the right slots."""
    q, cache = _problem(2, 9, 3, 1, 64, 40)
    whole = torch.randn(3, 2, 4, 3, 48, 64).to(torch.bfloat16)  # (L, 2, rows, H_kv, max, d)
    whole[1, :, 1:3, :, :40] = cache.to(torch.bfloat16)
    got = decode_attention(q.to(torch.bfloat16), whole[1, :, 1:3], 40)
    want = decode_attention(q.to(torch.bfloat16).float(), cache.to(torch.bfloat16).float(), 40)
    assert torch.equal(got, want)


@pytest.mark.parametrize("d", [64, 12])  # the AVX2 path and the portable loop
def test_a_query_in_a_wide_pass_gets_the_bits_it_gets_alone(d):
    """Token t of a five-token causal pass over L committed slots sees slots [0, L + t]: its
    output equals, bit for bit, a one-token pass over those L + t + 1 slots, with the other
    rows, other tokens and the slots past it changed."""
    L, T = 130, 5
    q, cache = _problem(2, 9, 3, T, d, L + T)
    causal = torch.ones(T, L + T, dtype=torch.bool).tril(L)[None, None]
    wide = decode_attention(q, cache, L + T, causal).view(2, T, 9 * d)
    for t in range(T):
        alone_cache = cache.clone()
        alone_cache[:, :, :, L + t + 1:] = float("nan")  # slots it does not see: anything
        alone_cache[:, 1] = torch.randn_like(alone_cache[:, 1])  # another row's slots
        alone = decode_attention(q[:, :, t:t + 1].contiguous(), alone_cache, L + t + 1)
        assert torch.equal(wide[0, t], alone.view(2, 9 * d)[0]), t


@pytest.mark.parametrize("d", [64, 16])  # (the AVX-512 path where the CPU has it)
def test_slots_a_task_shares_give_a_query_the_bits_it_gets_on_its_own(d):
    """Where every query of a task sees slots [0, P), those run for all of them at once; one
    query that does not see slot 0 makes P = 0, and the others' outputs stay the same bits."""
    L, T = 203, 2  # a task: 4 query heads of a KV head x 2 tokens; L not a multiple of 8
    q, cache = _problem(1, 4, 1, T, d, L, seed=6)
    every = torch.ones(1, 1, T, L, dtype=torch.bool)
    holed = every.clone()
    holed[0, 0, 1, 0] = False  # token 1 does not see slot 0
    shared = decode_attention(q, cache, L, every).view(T, 4 * d)
    alone = decode_attention(q, cache, L, holed).view(T, 4 * d)
    assert torch.equal(shared[0], alone[0])
    assert not torch.equal(shared[1], alone[1])


@pytest.mark.parametrize("d", [64, 12])
def test_a_tree_node_gets_the_bits_of_its_path_decoded_alone(d):
    """A draft tree's node sees the committed slots and its ancestors, scattered among the
    tree's slots: its output equals, bit for bit, one token decoded alone over a cache holding
    the same slots in a row (the path as plain decoding would have written it)."""
    L = 70
    q, cache = _problem(1, 9, 3, 6, d, L + 6, seed=4)
    tree = torch.zeros(1, 1, 6, L + 6, dtype=torch.bool)
    tree[..., :L] = True
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 4, 5]}
    for node, path in ancestors.items():
        tree[0, 0, node, [L + a for a in path]] = True
    wide = decode_attention(q, cache, L + 6, tree).view(6, 9 * d)
    for node, path in ancestors.items():
        alone = torch.full_like(cache[:, :, :, :L + len(path)], float("nan"))
        alone[:, :, :, :L] = cache[:, :, :, :L]
        alone[:, :, :, L:] = cache[:, :, :, [L + a for a in path]]
        got = decode_attention(q[:, :, node:node + 1].contiguous(), alone, L + len(path))
        assert torch.equal(wide[node], got[0]), node


def test_unseen_slots_are_not_read_and_a_blind_query_gets_zeros():
    q, cache = _problem(1, 4, 2, 2, 16, 40)
    mask = torch.zeros(1, 1, 2, 40, dtype=torch.bool)
    mask[0, 0, 0, ::3] = True  # query 0 sees every third slot, query 1 none
    want = decode_attention(q, cache, 40, mask)
    poisoned = cache.clone()
    poisoned[:, :, :, 1::3] = float("nan")
    poisoned[:, :, :, 2::3] = float("inf")
    got = decode_attention(q, poisoned, 40, mask)
    assert torch.equal(got, want) and torch.isfinite(got).all()
    assert torch.equal(got.view(2, 4, 16)[1], torch.zeros(4, 16))


def test_rows_and_heads_go_to_their_places_with_a_per_row_mask():
    """Rows of different lengths (the engine's mixed batch): row b sees its own first
    lengths[b] + 1 slots; the cache a view of the engine's running rows (a row stride larger
    than the view's rows)."""
    q, full = _problem(4, 6, 2, 1, 32, 50)
    cache = full[:, 1:4]  # rows 1-3 of 4: a strided view
    q = q[1:4].contiguous()
    lengths = torch.tensor([10, 49, 0])
    mask = (torch.arange(50) <= lengths[:, None])[:, None, None, :]
    got = decode_attention(q, cache, 50, mask)
    torch.testing.assert_close(got.double(), reference.decode_attention(q, cache, 50, mask),
                               rtol=0, atol=ATOL)


def test_a_one_row_one_head_cache_may_carry_any_stride_there():
    """PyTorch gives a dimension of one element whatever stride a view leaves it."""
    q, cache = _problem(1, 3, 1, 2, 8, 12)
    odd = cache.as_strided(cache.shape, (cache.stride(0), 5, 3, 8, 1))
    assert torch.equal(odd, cache)
    assert torch.equal(decode_attention(q, odd, 12), decode_attention(q, cache, 12))


def test_a_permuted_cache_view_is_read_where_it_lies():
    """A cache stored heads-first, (2, H_kv, B, L, d), viewed as (2, B, H_kv, L, d)."""
    q, cache = _problem(3, 4, 2, 2, 16, 30)
    stored = cache.transpose(1, 2).contiguous()
    view = stored.transpose(1, 2)
    assert not view.is_contiguous()
    assert torch.equal(decode_attention(q, view, 30), decode_attention(q, cache, 30))


def test_the_threaded_path_equals_one_thread_bit_for_bit():
    q, cache = _problem(8, 9, 3, 4, 64, 256)  # 4.7 M multiply-adds: past the threading limit
    mask = torch.ones(4, 256, dtype=torch.bool).tril(252)[None, None]
    threads = torch.get_num_threads()
    try:
        many = decode_attention(q, cache, 256, mask)
        torch.set_num_threads(1)
        one = decode_attention(q, cache, 256, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)


def _bad(**changes):
    q, cache = _problem(1, 4, 2, 2, 8, 10)
    args = dict(q=q, cache_kv=cache, slots=10, mask=None, out_dtype=torch.float32)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, name", [
    (dict(q=torch.zeros(1, 4, 2, 8, dtype=torch.float16)), "q"),
    (dict(q=torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)), "cache_kv"),  # q's dtype: the cache's
    (dict(q=torch.zeros(1, 2, 4, 8).transpose(1, 2)), "q"),
    (dict(q=torch.zeros(4, 2, 8)), "q"),
    (dict(q=torch.zeros(1, 3, 2, 8)), "cache_kv"),
    (dict(slots=0), "slots"),
    (dict(slots=11), "cache_kv"),
    (dict(slots=2.0), "slots"),
    (dict(mask=torch.ones(1, 1, 2, 9, dtype=torch.bool)), "mask"),
    (dict(mask=torch.ones(1, 1, 2, 10)), "mask"),
    (dict(mask=torch.ones(1, 1, 2, 20, dtype=torch.bool)[..., ::2]), "mask"),
    (dict(cache_kv=torch.zeros(2, 1, 2, 10, 8, dtype=torch.bfloat16)), "cache_kv"),
    (dict(cache_kv=torch.zeros(2, 1, 2, 8, 10).transpose(3, 4)), "cache_kv"),
    (dict(cache_kv=torch.zeros(2, 2, 2, 10, 8)), "cache_kv"),
    (dict(out_dtype=torch.float16), "out_dtype"),
    (dict(q=torch.zeros(1, 4, 2, 8).to_sparse()), "q"),
    (dict(cache_kv=torch.zeros(2, 1, 2, 10, 8).to_sparse()), "cache_kv"),
    (dict(mask=torch.ones(1, 1, 2, 10, dtype=torch.bool).to_sparse()), "mask"),
])
def test_bad_input_is_named(changes, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        decode_attention(**_bad(**changes))


def test_a_pass_object_checks_each_layer_cache():
    q, cache = _problem(1, 4, 2, 1, 8, 10)
    attend = DecodeAttention(q, None, 10, 2)
    torch.testing.assert_close(attend(cache), decode_attention(q, cache, 10))
    with pytest.raises(ValueError, match="^cache_kv"):
        attend(cache.numpy())
    with pytest.raises(ValueError, match="^cache_kv"):
        attend(cache[:, :, :1])


@pytest.mark.parametrize("plan", [None, Strategy(4, 1, 5), Strategy(3, 2, 6)], ids=str)
def test_an_engine_decodes_the_same_through_the_kernel_and_through_pytorch(
        target, drafter, plan, monkeypatch):
    assert_engine_decodes_alike(target, drafter, plan, "ATTENTION_KERNEL", monkeypatch)


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_bf16_pass_through_the_kernel_is_one_through_pytorch_to_bf16_rounding(
        target, tokens, monkeypatch):
    assert_bf16_pass_alike(target, tokens, "ATTENTION_KERNEL", monkeypatch)
