"""pytest-benchmark microbenchmarks of the fused kernels and their PyTorch reference, grouped so
each group compares the two side by side:

    python -m pytest bench/test_kernels.py --benchmark-only --benchmark-group-by=param:case

`tlt bench kernels` runs the full B x N x V grid and writes JSON; this file is for profiling a
few cases with pytest-benchmark's statistics and history (--benchmark-autosave / compare).
"""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.bench import kernels
from tlt_core.ops import reference

CASES = {"B1-N32-V32000": (1, 32, 32000), "B16-N32-V32000": (16, 32, 32000),
         "B4-N64-V151936": (4, 64, 151936)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    B, N, V = CASES[request.param]
    buffer = torch.randn(B * N * V, generator=torch.Generator().manual_seed(0)) * 2
    return request.param, kernels.make_inputs(B, N, V, buffer)


def test_sampling_fused(benchmark, case):
    name, x = case
    benchmark.extra_info["case"] = name
    benchmark(lambda: ops.verify_tree_sampling(
        x.logits, x.tokens, x.parents, temperature=kernels.TEMPERATURE, top_p=kernels.TOP_P,
        uniforms=x.uniforms, validate=False))


def test_sampling_reference(benchmark, case):
    name, x = case
    benchmark.extra_info["case"] = name
    benchmark.pedantic(lambda: reference.verify_tree_sampling(
        x.logits, x.tokens, x.parents, kernels.TEMPERATURE, kernels.TOP_K, kernels.TOP_P,
        x.uniforms), rounds=2, iterations=1)


def test_greedy_fused(benchmark, case):
    name, x = case
    benchmark.extra_info["case"] = name
    benchmark(lambda: ops.verify_tree_greedy(x.logits, x.tokens, x.parents, validate=False))


def test_greedy_reference(benchmark, case):
    name, x = case
    benchmark.extra_info["case"] = name
    benchmark.pedantic(lambda: reference.verify_tree_greedy(x.logits, x.tokens, x.parents),
                       rounds=2, iterations=1)
