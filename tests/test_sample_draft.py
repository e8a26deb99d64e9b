"""tlt_core.ops.sample_draft (csrc/include/tlt/draft_sample.h), the CPU's one call per drafting
level: its q and draws equal the reference's (and the tensor ops GPUs run) to float32
rounding, its draws follow q (chi-square), greedy rows take the lowest argmax, rows are
independent, bad input is named, and a diverged drafter stops a step with a clear error."""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.drafting import sampled_chain
from tlt_core.ops import reference

V_DRAFT, V = 8192, 49157  # a SmolLM2-sized draft vocabulary over a vocabulary with a tail


def case(seed, rows=6, draws=3, greedy=(3, 5)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V_DRAFT, generator=g) * 3
    uniforms = torch.rand(rows, draws, generator=g)
    temperature = torch.full((rows,), 0.8)
    temperature[list(greedy)] = 0.0
    draft_to_target = torch.sort(torch.randperm(V, generator=g)[:V_DRAFT]).values
    return logits, uniforms, temperature, draft_to_target


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_reference(seed):
    logits, uniforms, temperature, ids_map = case(seed)
    ids, q = ops.sample_draft(logits, uniforms, temperature, ids_map, V)
    want_ids, want_q = reference.sample_draft(logits, uniforms, temperature, ids_map, V)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-9)
    assert torch.equal(q[3], want_q[3]) and int((q[3] > 0).sum()) == 1  # greedy: one-hot


def test_without_a_map_the_ids_are_draft_ids():
    logits, uniforms, temperature, _ = case(7)
    ids, q = ops.sample_draft(logits, uniforms, temperature)
    want_ids, want_q = reference.sample_draft(logits, uniforms, temperature)
    assert q.shape == (6, V_DRAFT) and torch.equal(ids, want_ids)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-9)


def test_matches_the_tensor_ops_of_a_gpu_level():
    # draw()'s tensor-op path, which a GPU's captured level runs, on the same inputs
    logits, uniforms, temperature, ids_map = case(11, rows=4, draws=2, greedy=(1,))

    class Drafter:
        draft_to_target = ids_map

        def to_target_ids(self, index):
            return ids_map[index]

    B, R = 2, 2
    uniforms = torch.rand(B * R, 5)[:, 1:1 + uniforms.shape[1]]  # a strided view, as a level's
    greedy = (temperature == 0).view(B, R)[:, 0]
    scale = torch.where(greedy, torch.ones(B), temperature.view(B, R)[:, 0])
    out = torch.empty(B, R, V)
    want = sampled_chain.draw_tensor_ops(Drafter(), logits.view(B, R, -1),
                                         uniforms.view(B, R, -1), greedy, scale, out)
    got_q = torch.empty(B, R, V)
    got = sampled_chain.draw(Drafter(), logits.view(B, R, -1), uniforms.view(B, R, -1), greedy,
                             scale, got_q)  # the kernel, on the CPU
    assert torch.equal(got, want)
    torch.testing.assert_close(got_q, out, rtol=1e-5, atol=1e-9)


def test_draws_follow_q():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 12, generator=g)
    uniforms = torch.rand(1, 40000, generator=g)
    ids, q = ops.sample_draft(logits, uniforms, torch.ones(1))
    counts = torch.bincount(ids[0], minlength=12).double()
    expected = q[0].double() * uniforms.shape[1]
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 31.3  # 11 degrees of freedom, p = 0.001


def test_greedy_rows_take_the_lowest_argmax():
    logits = torch.zeros(1, V_DRAFT)
    logits[0, [20, 21, V_DRAFT - 1]] = 4.0
    ids, q = ops.sample_draft(logits, torch.rand(1, 3), torch.zeros(1))
    assert ids.tolist() == [[20, 20, 20]] and q[0, 20] == 1 and q.sum() == 1


def test_rows_are_independent():
    logits, uniforms, temperature, ids_map = case(5)
    ids, q = ops.sample_draft(logits, uniforms, temperature, ids_map, V)
    logits[1:] = torch.randn(5, V_DRAFT)
    uniforms[1:] = 0.5
    alone_ids, alone_q = ops.sample_draft(logits, uniforms, temperature, ids_map, V)
    assert torch.equal(ids[0], alone_ids[0]) and torch.equal(q[0], alone_q[0])


@pytest.mark.parametrize("where", [100, V_DRAFT - 3])  # in an eight-lane block, in the tail
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bad_logits_and_uniforms_are_named(where, bad):
    logits, uniforms, temperature, ids_map = case(2)
    logits[4, where] = bad
    with pytest.raises(ValueError, match="^logits: row 4"):
        ops.sample_draft(logits, uniforms, temperature, ids_map, V)
    logits[4, where] = 0.0
    uniforms[2, 1] = 1.0
    with pytest.raises(ValueError, match="^uniforms: row 2"):
        ops.sample_draft(logits, uniforms, temperature, ids_map, V)


def test_bad_arguments_are_named():
    logits, uniforms, temperature, ids_map = case(1)
    with pytest.raises(TypeError, match="^logits"):
        ops.sample_draft(logits.double(), uniforms, temperature, ids_map, V)
    with pytest.raises(ValueError, match="^uniforms"):
        ops.sample_draft(logits, uniforms[:2], temperature, ids_map, V)
    with pytest.raises(ValueError, match="^temperature"):
        ops.sample_draft(logits, uniforms, temperature[:3], ids_map, V)
    with pytest.raises(ValueError, match="^vocab"):
        ops.sample_draft(logits, uniforms, temperature, ids_map, V_DRAFT - 1)
    with pytest.raises(ValueError, match="^draft_to_target"):
        ops.sample_draft(logits, uniforms, temperature, ids_map.int(), V)
    repeated = ids_map.clone()
    repeated[1] = repeated[0]
    with pytest.raises(ValueError, match="^draft_to_target"):
        ops.sample_draft(logits, uniforms, temperature, repeated, V)
    with pytest.raises(ValueError, match="^draft_to_target"):
        ops.sample_draft(logits, uniforms, temperature, ids_map, int(ids_map.max()))


def test_a_diverged_drafter_stops_the_level_with_a_clear_error():
    logits, uniforms, temperature, ids_map = case(4, rows=2, draws=1, greedy=())

    class Drafter:
        draft_to_target = ids_map

    logits[1, 7] = float("nan")
    with pytest.raises(FloatingPointError, match="drafter logits: row 1"):
        sampled_chain.draw(Drafter(), logits.view(2, 1, -1), uniforms.view(2, 1, 1),
                           torch.zeros(2, dtype=torch.bool), torch.ones(2),
                           torch.empty(2, 1, V))
