"""The fused RoPE + K/V write (tlt_core.ops.rope, csrc/include/tlt/rope.h): the same values as
the tensor ops it replaces (tlt_core.ops.reference.rope_kv_write) in every dtype pairing, a
decoding engine that gives the same tokens and log-probs with it and without it, and bad input
named before anything is written."""

import pytest
import torch

import tlt_core.model.packed as packed
import tlt_core.ops as ops
from tlt_core.drafting.tree import Strategy
from tlt_core.ops import reference
from tests.pass_kernel_flags import assert_engine_decodes_alike

H_Q, H_KV, SLOTS, POSITIONS = 4, 2, 40, 50


def _inputs(model_dtype, cache_dtype, batch=3, tokens=5, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, tokens, H_Q + 2 * H_KV, d, generator=g).to(model_dtype)
    cos = torch.randn(POSITIONS, d, generator=g).to(model_dtype)
    sin = torch.randn(POSITIONS, d, generator=g).to(model_dtype)
    positions = torch.randint(0, POSITIONS, (batch, tokens), generator=g)
    slots = torch.stack([torch.randperm(SLOTS, generator=g)[:tokens] for _ in range(batch)])
    # a view of the first rows of a larger cache, as the engine's running rows are
    cache = torch.randn(2, batch + 2, H_KV, SLOTS, d, generator=g).to(cache_dtype)[:, :batch]
    q = torch.empty(batch, H_Q, tokens, d, dtype=cache_dtype)
    return qkv, cos, sin, positions, slots, cache, q


@pytest.mark.parametrize("model_dtype,cache_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("batch,tokens,d", [(1, 1, 8), (3, 5, 8), (4, 40, 16), (2, 3, 2),
                                            (1, 3, 64), (2, 2, 48)])  # 16 | d: eight lanes
def test_the_kernel_computes_what_the_tensor_ops_do(model_dtype, cache_dtype, batch, tokens, d):
    """Bit for bit (NaNs equal as NaNs): rows written one thread or (B T >= 64) several."""
    qkv, cos, sin, positions, slots, cache, q = _inputs(model_dtype, cache_dtype, batch,
                                                        tokens, d)
    qkv.view(-1)[::29] = float("nan")
    want_cache, want_q = cache.clone(), torch.empty_like(q)
    reference.rope_kv_write(qkv, cos, sin, positions, slots, want_cache, want_q)
    ops.rope_kv_write(qkv, cos, sin, positions, slots, cache, q)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan", [None, Strategy(4, 1, 5), Strategy(3, 2, 6)], ids=str)
def test_an_engine_decodes_the_same_with_the_kernel_and_without(target, drafter, dtype, plan,
                                                                monkeypatch):
    """Prefill, plain steps, draft levels and tree verification through the kernel: the same
    tokens and log-probs, bit for bit, as the tensor ops, at T = 0 and T = 1."""
    # attention through PyTorch in both runs: the attention kernel needs the RoPE kernel's q
    # (tests/test_decode_attention.py compares the two attentions)
    monkeypatch.setattr(packed, "ATTENTION_KERNEL", False)
    assert_engine_decodes_alike(target, drafter, plan, "ROPE_KV_KERNEL", monkeypatch,
                                dtype=dtype, atol=0)


def test_bad_input_is_named_and_nothing_is_written():
    qkv, cos, sin, positions, slots, cache, q = _inputs(torch.bfloat16, torch.float32)
    before = cache.clone()

    def call(**change):
        args = dict(qkv=qkv, cos=cos, sin_signed=sin, positions=positions, slots=slots,
                    cache_kv=cache, q_out=q)
        args.update(change)
        return ops.rope_kv_write(**args)

    late = slots.clone()
    late[-1, -1] = SLOTS  # one slot past the cache, in the last row
    with pytest.raises(ValueError, match="^slots:"):
        call(slots=late)
    far = positions.clone()
    far[1, 2] = -1
    with pytest.raises(ValueError, match="^positions:"):
        call(positions=far)
    assert torch.equal(cache, before)  # checked before any row is written
    with pytest.raises(TypeError, match="^positions:"):
        call(positions=positions.int())
    with pytest.raises(ValueError, match="^qkv:"):
        call(qkv=qkv.float())
    with pytest.raises(ValueError, match="^qkv:"):
        call(qkv=qkv.transpose(0, 1))
    with pytest.raises(ValueError, match="^qkv:"):
        call(qkv=qkv[:, :, :-1])  # H_q + 2 H_kv - 1 heads
    with pytest.raises(ValueError, match="^sin_signed:"):
        call(sin_signed=sin[:-1])
    with pytest.raises(ValueError, match="^cache_kv:"):
        call(cache_kv=cache.transpose(3, 4))  # slots not dense
    with pytest.raises(ValueError, match="^cache_kv:"):
        call(cache_kv=cache[:1])  # keys without values
    with pytest.raises(TypeError, match="^q_out:"):
        call(q_out=q.half())
    with pytest.raises(TypeError, match="^cos:"):
        call(cos=cos.half(), sin_signed=sin.half())
    assert torch.equal(cache, before)
