"""The ops take torch tensors and any DLPack array and give back the caller's kind; the Philox
uniforms are exactly random.h's (known-answer test) on every implementation."""

import numpy as np
import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference
from tests.trees import random_tree_case


def test_numpy_in_numpy_out():
    case = random_tree_case(1, 3, 6, 20)
    out = ops.verify_tree_sampling(case.logits.numpy(), case.tokens.numpy(), case.parents.numpy(),
                                   temperature=0.9, top_p=0.95, seed=np.arange(3),
                                   num_nodes=case.num_nodes.numpy())
    assert isinstance(out.emitted_tokens, np.ndarray) and out.emitted_tokens.dtype == np.int64
    want = ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=0.9,
                                    top_p=0.95, seed=torch.arange(3), num_nodes=case.num_nodes)
    np.testing.assert_array_equal(out.emitted_tokens, want.emitted_tokens.numpy())
    meta = ops.tree_metadata(case.parents.numpy(), case.num_nodes.numpy())
    assert isinstance(meta.mask, np.ndarray)


class DLPackOnly:
    """An array that only speaks DLPack (like a JAX or CuPy array would)."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, **kwargs):
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


def test_any_dlpack_array_is_accepted():
    case = random_tree_case(2, 2, 5, 16)
    out = ops.verify_tree_greedy(DLPackOnly(case.logits), DLPackOnly(case.tokens),
                                 DLPackOnly(case.parents), DLPackOnly(case.num_nodes))
    want = ops.verify_tree_greedy(case.logits, case.tokens, case.parents, case.num_nodes)
    assert torch.equal(out.emitted_tokens, want.emitted_tokens)


def test_cupy_arrays_round_trip():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - any CUDA runtime failure means no usable device
        pytest.skip("CuPy imports but no CUDA device is usable")
    if not ops.built_with_cuda:
        pytest.skip("tlt_core was built without CUDA kernels")
    case = random_tree_case(3, 4, 8, 32)
    out = ops.verify_tree_greedy(cupy.asarray(case.logits.numpy()), cupy.asarray(case.tokens.numpy()),
                                 cupy.asarray(case.parents.numpy()),
                                 cupy.asarray(case.num_nodes.numpy()))
    assert isinstance(out.emitted_tokens, cupy.ndarray)
    want = ops.verify_tree_greedy(case.logits, case.tokens, case.parents, case.num_nodes)
    np.testing.assert_array_equal(cupy.asnumpy(out.emitted_tokens), want.emitted_tokens.numpy())


def test_philox_known_answers():
    # Random123's published Philox4x32-10 known-answer vectors.
    assert reference.philox4x32_10(0, 0, 0, 0, 0, 0) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 0xFFFFFFFF
    assert reference.philox4x32_10(ones, ones, ones, ones, ones, ones) == (
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)


def test_philox_kernel_matches_reference():
    seeds = torch.tensor([0, 1, -1, 2**40 + 3], dtype=torch.int64)
    offsets = torch.tensor([0, 7, 2**33, -5], dtype=torch.int64)
    got = ops.philox_uniforms(seeds, offsets, 37)
    assert torch.equal(got, reference.philox_uniforms(seeds, offsets, 37))
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0


def test_every_op_takes_an_empty_batch():
    """B = 0 gives empty outputs of the right shapes (the sampling kernel cannot take B = 0:
    an empty per-row array has a null data pointer)."""
    logits, tokens = torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.long)
    parents = torch.zeros(0, 3, dtype=torch.int32)
    for out in (ops.verify_tree_greedy(logits, tokens, parents),
                ops.verify_tree_sampling(logits, tokens, parents, temperature=1.0, seed=0),
                ops.verify_tree_sampling(logits, tokens, parents, temperature=torch.zeros(0),
                                         top_k=torch.zeros(0, dtype=torch.int32),
                                         top_p=torch.ones(0), uniforms=torch.zeros(0, 3),
                                         draft_probs=torch.zeros(0, 3, 5), validate=False)):
        assert out.accept_index.shape == out.emitted_tokens.shape == (0, 3)
        assert out.num_accepted.shape == (0,)
    meta = ops.tree_metadata(parents, torch.zeros(0, dtype=torch.int32),
                             torch.zeros(0, dtype=torch.long))
    assert meta.mask.shape == (0, 3, 1) and meta.positions.shape == (0, 3)
    assert ops.unpack_tree_mask(meta.mask, 3).shape == (0, 3, 3)
    tree = ops.select_tree(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4),
                           torch.zeros(0, 4, dtype=torch.int32),
                           torch.zeros(0, dtype=torch.long), 3)
    assert tree.tokens.shape == (0, 3) and tree.num_nodes.shape == (0,)
    cache = torch.zeros(2, 0, 1, 4, 2)
    assert ops.compact_kv_(cache, torch.zeros(0, 3, dtype=torch.int32),
                           torch.zeros(0, dtype=torch.int32),
                           torch.zeros(0, dtype=torch.int32)) is cache
    assert ops.philox_uniforms(torch.zeros(0, dtype=torch.long), 0, 5).shape == (0, 5)
