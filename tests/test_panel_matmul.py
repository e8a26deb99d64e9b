"""The panel product in float32 and bfloat16 (tlt_core.ops.panel_matmul,
csrc/include/tlt/panel_matmul.h): its bits are the header's (tlt_core.ops.reference, exact fmaf
chains), the same on the AVX2 path and the portable loop, on one thread or PyTorch's team, and
for a row whatever the other rows are (rows independent, bit for bit); the inputs are never
written; the add can be in place; bad input is named. The "panels" weight layout that uses it
is tested with the others in tests/test_weight_layout.py."""

from pathlib import Path

import pytest
import torch

from tlt_core.ops import pack_panels, panel_matmul, reference
from tlt_core.ops.panel_matmul import PANEL_WIDTH, vectorised


DTYPES = (torch.float32, torch.bfloat16)


def _case(rows, out_features, in_features, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    addend = torch.randn(rows, out_features, generator=g)
    return tuple(t.to(dtype) for t in (weight, x, bias, addend))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, out_features, in_features",
                         [(1, 16, 8), (3, 37, 13), (7, 5, 1), (2, 40, 33), (0, 16, 4)])
@pytest.mark.parametrize("with_bias, with_addend", [(False, False), (True, False), (True, True),
                                                    (False, True)])
def test_the_product_is_the_headers_bit_for_bit(rows, out_features, in_features, with_bias,
                                                with_addend, dtype):
    weight, x, bias, addend = _case(rows, out_features, in_features, dtype=dtype)
    bias, addend = (bias if with_bias else None), (addend if with_addend else None)
    panels = pack_panels(weight)
    want = reference.panel_matmul(x, panels, out_features, bias, addend)
    for isa in ("auto", "portable"):
        got = panel_matmul(x, panels, out_features, bias, addend, isa=isa)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        assert torch.equal(got, want), isa


def test_a_bfloat16_nan_is_0x7fc0_as_the_header_says():
    weight, x, _, _ = _case(2, 20, 8, dtype=torch.bfloat16)
    weight[3, 5] = -float("nan")  # a sign and payload torch's conversion would keep
    panels = pack_panels(weight)
    got = panel_matmul(x, panels, 20)
    want = reference.panel_matmul(x, panels, 20)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert (got[:, 3].view(torch.int16) == 0x7FC0).all() and not got[:, 4].isnan().any()


def test_bfloat16_is_the_float32_product_of_the_widened_operands_rounded_once():
    weight, x, bias, addend = _case(5, 40, 30, dtype=torch.bfloat16)
    got = panel_matmul(x, pack_panels(weight), 40, bias, addend)
    wide = panel_matmul(x.float(), pack_panels(weight.float()), 40, bias.float(), addend.float())
    assert torch.equal(got, wide.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_panels_hold_the_matrix_column_blocks_zero_padded(dtype):
    weight = torch.arange(20 * 3, dtype=dtype).view(20, 3)
    panels = pack_panels(weight)
    assert panels.shape == (2, 3, PANEL_WIDTH) and panels.dtype == dtype
    assert torch.equal(panels[0], weight[:16].T) and torch.equal(panels[1, :, :4], weight[16:].T)
    assert not panels[1, :, 4:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 33, 130])  # 130: a bf16 x widened apart
def test_rows_are_independent_and_paths_agree_at_a_real_layers_size(rows, dtype):
    # 3072 x 576: SmolLM2's gate|up matrix, large enough to run on PyTorch's thread team
    weight, x, bias, addend = _case(rows, 3072, 576, seed=rows, dtype=dtype)
    panels = pack_panels(weight)
    got = panel_matmul(x, panels, 3072, bias, addend)
    assert torch.equal(got, panel_matmul(x, panels, 3072, bias, addend, isa="portable"))
    for r in (0, rows - 1):  # a row alone: the same bits as among the others
        alone = panel_matmul(x[r:r + 1].clone(), panels, 3072, bias, addend[r:r + 1].clone())
        assert torch.equal(alone[0], got[r])
    exact = x.double() @ weight.double().T + bias.double() + addend.double()
    tolerance = 1e-4 if dtype == torch.float32 else 2 ** -8  # bf16: one rounding of the sum
    assert (got.double() - exact).abs().max() <= tolerance * exact.abs().max()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the calling thread alone: the same bits
    try:
        assert torch.equal(panel_matmul(x, panels, 3072, bias, addend), got)
    finally:
        torch.set_num_threads(threads)


def test_inputs_are_not_written_and_the_add_can_be_in_place():
    weight, x, bias, addend = _case(4, 50, 20)
    panels = pack_panels(weight)
    before = [t.clone() for t in (x, panels, bias, addend)]
    out = panel_matmul(x, panels, 50, bias, addend)
    assert all(torch.equal(a, b) for a, b in zip((x, panels, bias, addend), before))
    in_place = panel_matmul(x, panels, 50, bias, addend, out=addend)
    assert in_place is addend and torch.equal(addend, out)


def test_rows_with_a_stride_are_read_as_such():
    weight, x, _, _ = _case(3, 20, 8)
    wide = torch.zeros(3, 12)
    wide[:, :8] = x
    out = torch.full((3, 30), 7.0)
    got = panel_matmul(wide[:, :8], pack_panels(weight), 20, out=out[:, :20])
    assert torch.equal(got, panel_matmul(x, pack_panels(weight), 20))
    assert (out[:, 20:] == 7).all()  # nothing written past each row's N


def test_the_vector_path_is_used_where_the_cpu_has_avx2_and_fma():
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if not {"avx2", "fma"} <= flags:
        pytest.skip("the CPU has no AVX2 + FMA (or its flags are unknown)")
    assert vectorised()


@pytest.mark.parametrize("change, argument", [
    (lambda a: a.update(x=a["x"].double()), "x"),
    (lambda a: a.update(x=a["x"].half()), "x"),
    (lambda a: a.update(x=a["x"].bfloat16()), "panels"),  # one dtype for all: x's
    (lambda a: a.update(bias=a["bias"].bfloat16()), "bias"),
    (lambda a: a.update(x=a["x"][:, ::2]), "x"),
    (lambda a: a.update(x=a["x"][None]), "x"),
    (lambda a: a.update(x=a["x"].numpy()), "x"),
    (lambda a: a.update(panels=a["panels"][:, :-1]), "panels"),
    (lambda a: a.update(out_features=0), "out_features"),
    (lambda a: a.update(out_features=33), "panels"),
    (lambda a: a.update(out_features=2.0), "out_features"),
    (lambda a: a.update(bias=torch.ones(19)), "bias"),
    (lambda a: a.update(addend=torch.ones(4, 20)), "addend"),
    (lambda a: a.update(out=torch.ones(3, 21)), "out"),
    (lambda a: a.update(out=a["x"][:, :20]), "out"),  # would overwrite x while reading it
    (lambda a: a.update(isa="avx512"), "isa"),
])
def test_bad_input_is_named(change, argument):
    weight, x, bias, addend = _case(3, 20, 24)
    args = dict(x=x, panels=pack_panels(weight), out_features=20, bias=bias, addend=addend[:3])
    change(args)
    with pytest.raises((ValueError, TypeError), match=f"^{argument}:"):
        panel_matmul(**args)


def test_pack_panels_names_a_bad_weight():
    with pytest.raises(ValueError, match="^weight:"):
        pack_panels(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="^weight:"):
        pack_panels(torch.ones(4))
