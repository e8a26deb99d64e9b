"""Invariant "Kernels agree" on the GPU: CUDA = CPU = reference, bit for bit on integer outputs
given the same uniforms. Marked `gpu`; skipped without a CUDA device and a CUDA build."""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference
from tests.test_tree_ops import batch_candidates
from tests.trees import random_tree_case

pytestmark = pytest.mark.gpu


def cuda(*tensors):
    return [t.cuda() if t is not None else None for t in tensors]


def assert_outputs_equal(gpu, cpu, logprob_atol=2e-5):
    for name in ("accept_index", "num_accepted", "emitted_tokens"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    torch.testing.assert_close(gpu.emitted_logprobs.cpu(), cpu.emitted_logprobs, rtol=0,
                               atol=logprob_atol)


@pytest.mark.parametrize("shape", [(1, 1, 7), (4, 16, 1000), (16, 64, 32000), (3, 8, 151936)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_cuda_equals_cpu(shape, dtype):
    case = random_tree_case(1, *shape)
    logits = case.logits.to(dtype)
    cpu = ops.verify_tree_greedy(logits, case.tokens, case.parents, case.num_nodes)
    gpu = ops.verify_tree_greedy(*cuda(logits, case.tokens, case.parents, case.num_nodes))
    assert_outputs_equal(gpu, cpu)


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 0, 0.9), (0.6, 50, 0.8), (1.0, 1, 1.0),
                                     (0.0, 0, 1.0), (1.0, 0, 1e-6)], ids=str)
@pytest.mark.parametrize("shape", [(5, 12, 40), (8, 32, 32000), (2, 16, 151936)])
@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampling_cuda_equals_cpu_and_reference(setting, shape, sampled_drafts):
    temperature, top_k, top_p = setting
    case = random_tree_case(7, *shape)
    g = torch.Generator().manual_seed(0)
    draft_probs = (torch.softmax(case.logits + torch.randn(case.logits.shape, generator=g), -1)
                   if sampled_drafts else None)
    uniforms = torch.rand(shape[:2], generator=g)
    kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    cpu = ops.verify_tree_sampling(case.logits, case.tokens, case.parents, uniforms=uniforms,
                                   draft_probs=draft_probs, num_nodes=case.num_nodes, **kwargs)
    logits, tokens, parents, u, q, n = cuda(case.logits, case.tokens, case.parents, uniforms,
                                            draft_probs, case.num_nodes)
    gpu = ops.verify_tree_sampling(logits, tokens, parents, uniforms=u, draft_probs=q,
                                   num_nodes=n, **kwargs)
    assert_outputs_equal(gpu, cpu)
    if shape[2] <= 1000:
        oracle = reference.verify_tree_sampling(case.logits, case.tokens, case.parents,
                                                temperature, top_k, top_p, uniforms,
                                                draft_probs=draft_probs, num_nodes=case.num_nodes)
        assert torch.equal(gpu.emitted_tokens.cpu(), oracle.emitted_tokens)


def test_seeded_sampling_is_identical_on_cpu_and_cuda():
    case = random_tree_case(8, 6, 16, 5000)
    seeds = torch.arange(6) + 100
    cpu = ops.verify_tree_sampling(case.logits, case.tokens, case.parents, temperature=0.8,
                                   top_p=0.95, seed=seeds, offset=9, num_nodes=case.num_nodes)
    gpu = ops.verify_tree_sampling(*cuda(case.logits, case.tokens, case.parents),
                                   temperature=0.8, top_p=0.95, seed=seeds.cuda(), offset=9,
                                   num_nodes=case.num_nodes.cuda())
    assert_outputs_equal(gpu, cpu)
    assert torch.equal(ops.philox_uniforms(seeds.cuda(), 3, 50).cpu(),
                       ops.philox_uniforms(seeds, 3, 50))


@pytest.mark.parametrize("depth,topk,num_nodes", [(1, 4, 3), (5, 4, 16), (6, 8, 32), (6, 10, 60)])
def test_tree_ops_cuda_equal_cpu(depth, topk, num_nodes):
    cands = batch_candidates(depth + topk, 8, depth, topk, invalid=0.1)
    cpu = ops.select_tree(*cands, num_nodes=num_nodes)
    gpu = ops.select_tree(*cuda(*cands), num_nodes=num_nodes)
    for name in ("tokens", "parents", "source_index", "num_nodes"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    meta_cpu = ops.tree_metadata(cpu.parents, cpu.num_nodes, torch.arange(8, dtype=torch.int32))
    meta_gpu = ops.tree_metadata(gpu.parents, gpu.num_nodes, torch.arange(8, dtype=torch.int32).cuda())
    for name in ("depths", "positions", "mask"):
        assert torch.equal(getattr(meta_gpu, name).cpu(), getattr(meta_cpu, name)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_compaction_cuda_equals_cpu(dtype):
    case = random_tree_case(4, 6, 12, 30)
    out = ops.verify_tree_greedy(case.logits, case.tokens, case.parents, case.num_nodes)
    cache_len = torch.tensor([0, 3, 10, 20, 5, 1], dtype=torch.int32)
    cache = (torch.randn(4, 2, 6, 2, 48, 8) * 50).to(dtype)
    gpu_cache = cache.cuda()
    ops.compact_kv_(cache, out.accept_index, out.num_accepted, cache_len)
    ops.compact_kv_(gpu_cache, *cuda(out.accept_index, out.num_accepted, cache_len))
    assert torch.equal(gpu_cache.cpu(), cache)
