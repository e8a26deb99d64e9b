"""The bf16 residual-add + RMSNorm kernel (tlt_core.ops.add_rms_norm) against rms_norm.h's
oracle (tlt_core.ops.reference, bit for bit) and the model's own RMSNorm module after a bf16
add: the sum bit for bit, the norm bit for bit but for a rare last-place difference of the sum
of squares' order (never more than one bf16 place); NaN and inf rows as PyTorch's; inputs never
written; bad input named. The packed pass uses it for a bf16 model on the CPU and then agrees
with its tensor-op path to bf16's rounding."""

import pytest
import torch

import tlt_core.model.packed as packed
from tlt_core.model.kv_cache import CacheShape, KVCache
from tlt_core.model.transformer import RMSNorm
from tlt_core.ops import add_rms_norm, reference

from tests.speculative_fixtures import tiny_target


def _reference(h, delta, weight, eps):
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data = weight
    summed = h if delta is None else h + delta
    return summed, norm.forward(summed)


def _bf16_places(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (same sign): 0 when equal."""
    bits = lambda t: t.view(torch.int16).to(torch.int32)  # noqa: E731
    return (bits(a) - bits(b)).abs()


@pytest.mark.parametrize("rows, hidden", [(0, 576), (1, 576), (3, 37), (65, 576), (2, 4096)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_the_kernel_is_the_modules_rms_norm_to_the_last_bf16_place(rows, hidden, with_delta):
    g = torch.Generator().manual_seed(rows * 7 + hidden)
    h = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    delta = torch.randn(rows, hidden, generator=g).bfloat16() if with_delta else None
    weight = (torch.randn(hidden, generator=g) * 0.5 + 1).bfloat16()
    h_before = h.clone()
    delta_before = None if delta is None else delta.clone()
    summed, normed = add_rms_norm(h, delta, weight, 1e-5)
    oracle_sum, oracle = reference.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(summed, oracle_sum) and torch.equal(normed, oracle)  # rms_norm.h's bits
    expected_sum, expected = _reference(h, delta, weight, 1e-5)
    assert torch.equal(summed, expected_sum)
    assert summed.dtype == normed.dtype == torch.bfloat16 and normed.shape == (rows, hidden)
    if normed.numel():
        assert int(_bf16_places(normed, expected).max()) <= 1
        assert (normed == expected).float().mean() >= 0.999
    assert torch.equal(h, h_before)  # the inputs are not written
    if delta is not None:
        assert torch.equal(delta, delta_before)
    else:
        assert summed is h  # no add: h itself


def test_nan_and_inf_rows_come_out_as_pytorchs():
    h = torch.randn(3, 64).bfloat16()
    h[0, 5], h[1, 9] = float("nan"), float("inf")
    weight = torch.ones(64).bfloat16()
    _, normed = add_rms_norm(h, None, weight, 1e-6)
    _, expected = _reference(h, None, weight, 1e-6)
    assert torch.equal(normed.isnan(), expected.isnan())
    assert torch.equal(normed[2], expected[2])


@pytest.mark.parametrize("change, error, name", [
    ("float32 h", ValueError, "h: expected a contiguous CPU bfloat16"),
    ("1-D h", ValueError, "h: expected \\(rows, hidden\\)"),
    ("strided h", ValueError, "h: .*not contiguous"),
    ("short delta", ValueError, "delta: expected shape \\(2, 8\\)"),
    ("long weight", ValueError, "weight: expected shape \\(8,\\)"),
    ("list weight", TypeError, "weight: expected a torch tensor"),
    ("negative eps", ValueError, "eps: must be a finite number >= 0"),
    ("nan eps", ValueError, "eps: must be a finite number >= 0"),
])
def test_bad_input_is_named(change, error, name):
    h, delta, weight, eps = (torch.ones(2, 8).bfloat16(), torch.ones(2, 8).bfloat16(),
                             torch.ones(8).bfloat16(), 1e-5)
    if change == "float32 h":
        h = h.float()
    elif change == "1-D h":
        h = h[0]
    elif change == "strided h":
        h = torch.ones(2, 16).bfloat16()[:, ::2]
    elif change == "short delta":
        delta = delta[:1]
    elif change == "long weight":
        weight = torch.ones(9).bfloat16()
    elif change == "list weight":
        weight = [1.0] * 8
    elif change == "negative eps":
        eps = -1.0
    else:
        eps = float("nan")
    with pytest.raises(error, match=name):
        add_rms_norm(h, delta, weight, eps)


def test_the_bf16_packed_pass_with_the_kernel_agrees_with_its_tensor_ops(monkeypatch):
    """The engine's inference pass of a bf16 model: the same logits with the kernel as with
    PyTorch's ops, up to bf16 rounding carried through the layers."""
    model = tiny_target().to(torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (3, 9),
                        generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None].expand(3, 9)
    logits = {}
    for kernel in (True, False):
        monkeypatch.setattr(packed, "RMS_NORM_KERNEL", kernel)
        c = model.config
        cache = KVCache(CacheShape(c.num_layers, 3, c.num_kv_heads, 16, c.head_dim),
                        dtype=torch.float32)
        logits[kernel] = model.step(ids, positions, cache).logits
    assert torch.allclose(logits[True], logits[False], atol=0.1, rtol=0.05)
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean() > 0.9
