"""The SwiGLU activation kernel (tlt_core.ops.silu_mul, csrc/include/tlt/silu_mul.h): silu(gate)
* up to float32 rounding (bf16: to the last place, rounded once), on the AVX2 lanes and the
tail past them, row by row; edge values; bad input named; an engine decoding through it as
through PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tlt_core.drafting.tree import Strategy
from tlt_core.ops import reference, silu_mul
from tests.pass_kernel_flags import assert_bf16_pass_alike, assert_engine_decodes_alike


@pytest.mark.parametrize("rows,width", [(1, 1536), (5, 1536), (3, 13), (2, 8), (1, 1)])
def test_float32_equals_the_math_to_rounding(rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(0)) * 4
    got = silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference.silu_mul(gate_up), rtol=4e-7, atol=1e-30)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-30)


def test_bf16_is_the_exact_value_rounded_once():
    """Within half a bf16 place of the float64 value (and so at most one place from PyTorch's
    twice-rounded silu(gate) * up)."""
    gate_up = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4)
    gate_up = gate_up.to(torch.bfloat16)
    got = silu_mul(gate_up)
    exact = reference.silu_mul(gate_up)
    place = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)  # one bf16 ulp
    assert ((got.double() - exact).abs() <= 0.5 * place + 1e-6 * exact.abs()).all()
    gate, up = gate_up.chunk(2, -1)
    assert ((got.double() - (F.silu(gate) * up).double()).abs() <= 1.01 * place).all()


def test_edge_values():
    values = [0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 100.0, -100.0, 1e30, -1e30,
              float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor(values * 2)  # both the eight-lane part and the tail
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    got = silu_mul(gate_up)[0]
    want = (F.silu(gate) * 3.0)
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-35)
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])


def test_rows_are_independent_and_a_row_stride_is_read():
    wide = torch.randn(4, 2 * 40 + 6, generator=torch.Generator().manual_seed(2))
    gate_up = wide[:, :80]  # rows 86 apart
    together = silu_mul(gate_up)
    for r in range(4):
        assert torch.equal(together[r], silu_mul(gate_up[r:r + 1].contiguous())[0])


@pytest.mark.parametrize("bad, name", [
    (torch.zeros(2, 8, dtype=torch.float16), "gate_up"),
    (torch.zeros(2, 7), "gate_up"),
    (torch.zeros(8), "gate_up"),
    (torch.zeros(8, 2).t(), "gate_up"),
    ([[0.0, 1.0]], "gate_up"),
    (torch.zeros(2, 8).to_sparse(), "gate_up"),
])
def test_bad_input_is_named(bad, name):
    with pytest.raises((ValueError, TypeError), match=f"^{name}"):
        silu_mul(bad)


@pytest.mark.parametrize("plan", [None, Strategy(4, 1, 5)], ids=str)
def test_an_engine_decodes_the_same_through_the_kernel_and_through_pytorch(
        target, drafter, plan, monkeypatch):
    assert_engine_decodes_alike(target, drafter, plan, "SILU_MUL_KERNEL", monkeypatch)


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_bf16_pass_through_the_kernel_is_one_through_pytorch_to_bf16_rounding(
        target, tokens, monkeypatch):
    assert_bf16_pass_alike(target, tokens, "SILU_MUL_KERNEL", monkeypatch)
