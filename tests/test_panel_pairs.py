"""The bfloat16 pairs product (tlt_core.ops.panel_matmul over pack_panels(W, pairs=True),
csrc/include/tlt/panel_matmul.h): its bits are the header's (tlt_core.ops.reference: the
VDPBF16PS order, k = 1, 0, 3, 2, ..., with subnormals flushed), the same on the AVX512-BF16 path
and the portable loop, on one thread or PyTorch's team, and for a row whatever the other rows
are; bad input is named. Where the CPU has no AVX512-BF16 both isas run the portable loop and
these tests check it against the reference alone."""

from pathlib import Path

import pytest
import torch

from tlt_core.ops import pack_panels, panel_matmul, reference
from tlt_core.ops.panel_matmul import PANEL_WIDTH, pairs_vectorised


def _case(rows, out_features, in_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = (torch.randn(out_features, in_features, generator=g),
               torch.randn(rows, in_features, generator=g),
               torch.randn(out_features, generator=g),
               torch.randn(rows, out_features, generator=g))
    return tuple(t.bfloat16() for t in tensors)


def _bits(tensor):
    return tensor.view(torch.int16)


@pytest.mark.parametrize("rows, out_features, in_features",
                         [(1, 16, 8), (3, 37, 13), (7, 5, 1), (2, 40, 33), (0, 16, 4),
                          (9, 50, 20), (8, 48, 64)])  # 9: a group of 8 and one row more
@pytest.mark.parametrize("with_bias, with_addend", [(False, False), (True, False), (True, True),
                                                    (False, True)])
def test_the_product_is_the_headers_bit_for_bit(rows, out_features, in_features, with_bias,
                                                with_addend):
    weight, x, bias, addend = _case(rows, out_features, in_features)
    bias, addend = (bias if with_bias else None), (addend if with_addend else None)
    pairs = pack_panels(weight, pairs=True)
    want = reference.panel_matmul(x, pairs, out_features, bias, addend)
    for isa in ("auto", "portable"):
        got = panel_matmul(x, pairs, out_features, bias, addend, isa=isa)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        assert torch.equal(_bits(got), _bits(want)), isa


def test_the_chain_takes_each_pair_odd_k_first():
    # W = [2^24, 1, 1, -2^24], x = 1: in order the 1s are lost to rounding at 2^24 (float32 has
    # 24 bits) and the sum is 0; in pairs (k = 1, 0, 3, 2) the first 1 is lost, the second comes
    # after the -2^24 and the sum is 1
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    weight = torch.zeros(16, 4)
    weight[0] = torch.tensor([2.0 ** 24, 1.0, 1.0, -2.0 ** 24])
    weight = weight.bfloat16()
    pairs = pack_panels(weight, pairs=True)
    for isa in ("auto", "portable"):
        assert panel_matmul(x, pairs, 16, isa=isa)[0, 0] == 1
    assert panel_matmul(x, pack_panels(weight), 16)[0, 0] == 0
    assert reference.panel_matmul(x, pairs, 16)[0, 0] == 1


def test_subnormal_operands_and_sums_are_flushed_as_the_instruction_does():
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-20, 1e-39, -3e-39, 1.0, -1e-19])
    for trial in range(20):
        x = (torch.randn(3, 10, generator=g)
             * scales[torch.randint(0, 5, (3, 10), generator=g)]).bfloat16()
        weight = (torch.randn(20, 10, generator=g)
                  * scales[torch.randint(0, 5, (20, 10), generator=g)]).bfloat16()
        pairs = pack_panels(weight, pairs=True)
        want = reference.panel_matmul(x, pairs, 20)
        for isa in ("auto", "portable"):
            assert torch.equal(_bits(panel_matmul(x, pairs, 20, isa=isa)), _bits(want)), trial
    # 1e-20 * 1e-19 = 1e-39 is a subnormal float32 sum: flushed to zero, where the in-order
    # chain keeps it (a bfloat16 holds it)
    x = torch.tensor([[1e-20, 0.0]]).bfloat16()
    weight = torch.zeros(16, 2).bfloat16()
    weight[:, 0] = 1e-19
    assert (panel_matmul(x, pack_panels(weight, pairs=True), 16) == 0).all()
    assert (panel_matmul(x, pack_panels(weight), 16) != 0).all()


def test_a_nan_is_0x7fc0_as_the_header_says():
    weight, x, _, _ = _case(2, 20, 8)
    weight[3, 5] = -float("nan")
    pairs = pack_panels(weight, pairs=True)
    got = panel_matmul(x, pairs, 20)
    assert torch.equal(_bits(got), _bits(reference.panel_matmul(x, pairs, 20)))
    assert (_bits(got[:, 3]) == 0x7FC0).all() and not got[:, 4].isnan().any()


def test_pairs_hold_two_k_of_sixteen_features_zero_padded():
    weight = torch.arange(20 * 3, dtype=torch.bfloat16).view(20, 3)
    pairs = pack_panels(weight, pairs=True)
    assert pairs.shape == (2, 2, PANEL_WIDTH, 2) and pairs.dtype == torch.bfloat16
    assert torch.equal(pairs[0, 0], weight[:16, 0:2]) and torch.equal(pairs[0, 1, :, 0],
                                                                      weight[:16, 2])
    assert not pairs[0, 1, :, 1].any()  # past K
    assert torch.equal(pairs[1, 0, :4], weight[16:, 0:2]) and not pairs[1, :, 4:].any()


@pytest.mark.parametrize("rows, out_features, in_features",
                         [(1, 3072, 576), (4, 3072, 576), (5, 3072, 576), (8, 3072, 576),
                          (16, 3072, 576), (33, 3072, 576), (12, 576, 1536), (20, 960, 576),
                          (6, 1000, 576), (10, 1000, 576)])
def test_rows_are_independent_and_paths_agree_at_a_real_layers_size(rows, out_features,
                                                                    in_features):
    # SmolLM2's gate|up (3072 x 576), down (576 x 1536) and q|k|v (960 x 576) matrices, large
    # enough to run on PyTorch's thread team, in tasks whose last block is narrower (and 1000
    # features: a last panel of 8); from 5 rows on each block prefetches the next; 10 and 12
    # rows in one group across 2 panels, 20 in groups of 8 and a shorter one
    weight, x, bias, addend = _case(rows, out_features, in_features, seed=rows)
    pairs = pack_panels(weight, pairs=True)
    got = panel_matmul(x, pairs, out_features, bias, addend)
    assert torch.equal(_bits(got), _bits(panel_matmul(x, pairs, out_features, bias, addend,
                                                      isa="portable")))
    for r in (0, rows - 1):
        alone = panel_matmul(x[r:r + 1].clone(), pairs, out_features, bias,
                             addend[r:r + 1].clone())
        assert torch.equal(_bits(alone[0]), _bits(got[r]))
    exact = x.double() @ weight.double().T + bias.double() + addend.double()
    assert (got.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(_bits(panel_matmul(x, pairs, out_features, bias, addend)),
                           _bits(got))
    finally:
        torch.set_num_threads(threads)


def test_rows_with_a_stride_and_the_add_in_place():
    weight, x, bias, addend = _case(3, 20, 9)
    wide = torch.zeros(3, 12, dtype=torch.bfloat16)
    wide[:, :9] = x
    pairs = pack_panels(weight, pairs=True)
    want = panel_matmul(x, pairs, 20, bias, addend)
    out = torch.full((3, 30), 7.0, dtype=torch.bfloat16)
    got = panel_matmul(wide[:, :9], pairs, 20, bias, addend, out=out[:, :20])
    assert torch.equal(_bits(got), _bits(want)) and (out[:, 20:] == 7).all()
    assert panel_matmul(x, pairs, 20, bias, addend, out=addend) is addend
    assert torch.equal(_bits(addend), _bits(want))


def test_the_vector_path_is_used_where_the_cpu_has_avx512_bf16():
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if not {"avx512f", "avx512_bf16"} <= flags:
        pytest.skip("the CPU has no AVX512-BF16 (or its flags are unknown)")
    assert pairs_vectorised()


@pytest.mark.parametrize("change, argument", [
    (lambda a: a.update(x=a["x"].float()), "panels"),  # pairs are bfloat16 only
    (lambda a: a.update(panels=a["panels"][:, :-1]), "panels"),
    (lambda a: a.update(panels=a["panels"].float()), "panels"),
    (lambda a: a.update(out_features=33), "panels"),
    (lambda a: a.update(bias=torch.ones(20)), "bias"),
])
def test_bad_input_is_named(change, argument):
    weight, x, bias, addend = _case(3, 20, 24)
    args = dict(x=x, panels=pack_panels(weight, pairs=True), out_features=20, bias=bias,
                addend=addend)
    change(args)
    with pytest.raises((ValueError, TypeError), match=f"^{argument}:"):
        panel_matmul(**args)


def test_pack_panels_names_a_float32_weight_for_pairs():
    with pytest.raises(ValueError, match="^pairs:"):
        pack_panels(torch.ones(4, 4), pairs=True)
