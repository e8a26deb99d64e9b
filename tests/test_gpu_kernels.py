"""Invariant "Kernels agree" on the GPU: CUDA = CPU = reference, bit for bit on integer outputs
given the same uniforms; and for the sampling kernel, which splits a row's vocabulary across
blocks at small batches, "Rows are independent" of the batch, and CUDA-graph replay. Marked
`gpu`; skipped without a CUDA device and a CUDA build."""

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


LARGE_VOCAB = 152064  # Qwen2's vocabulary: at small B the kernel splits a row over a cluster
# Per-row (temperature, top_k, top_p), cycled over the rows: top-p only, top-k only, greedy,
# both, top-k = 1, a wide top-k with a narrow top-p, temperature only.
ROW_SETTINGS = [(0.7, 0, 0.9), (1.0, 50, 1.0), (0.0, 0, 1.0), (0.6, 20, 0.8), (1.3, 0, 0.95),
                (1.0, 1, 1.0), (0.9, 1000, 0.5), (0.5, 0, 1.0)]


def row_settings(batch, device="cpu"):
    settings = [ROW_SETTINGS[b % len(ROW_SETTINGS)] for b in range(batch)]
    temperature, top_k, top_p = zip(*settings)
    return dict(temperature=torch.tensor(temperature, device=device),
                top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
                top_p=torch.tensor(top_p, device=device))


@pytest.fixture(scope="module")
def large_vocab_case():
    case = random_tree_case(31, 16, 8, LARGE_VOCAB)
    g = torch.Generator().manual_seed(31)
    draft_probs = torch.softmax(case.logits + torch.randn(case.logits.shape, generator=g), -1)
    return case, draft_probs, torch.rand(16, 8, generator=g)


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_split_vocabulary_sampling_cuda_equals_cpu(large_vocab_case, batch, dtype,
                                                   sampled_drafts):
    case, draft_probs, uniforms = large_vocab_case
    logits = case.logits[:batch].to(dtype)
    tree = (case.tokens[:batch], case.parents[:batch])
    q = draft_probs[:batch] if sampled_drafts else None
    cpu = ops.verify_tree_sampling(logits, *tree, uniforms=uniforms[:batch], draft_probs=q,
                                   num_nodes=case.num_nodes[:batch], **row_settings(batch))
    logits, tokens, parents, u, q, n = cuda(logits, *tree, uniforms[:batch], q,
                                            case.num_nodes[:batch])
    gpu = ops.verify_tree_sampling(logits, tokens, parents, uniforms=u, draft_probs=q,
                                   num_nodes=n, **row_settings(batch, "cuda"))
    assert_outputs_equal(gpu, cpu)


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampling_row_outputs_do_not_depend_on_the_batch(large_vocab_case, sampled_drafts):
    """A row alone runs split over more blocks than in a batch of 64; the kernel's sums are
    exact, so its outputs are the same bit for bit, log-probabilities included."""
    case, draft_probs, uniforms = large_vocab_case
    rows = torch.arange(64) % 16
    logits, tokens, parents, u, n = cuda(case.logits.to(torch.bfloat16), case.tokens,
                                         case.parents, uniforms, case.num_nodes)
    q = draft_probs.cuda() if sampled_drafts else None
    settings = row_settings(16, "cuda")
    batched = ops.verify_tree_sampling(
        logits[rows], tokens[rows], parents[rows], uniforms=u[rows], num_nodes=n[rows],
        draft_probs=q[rows] if q is not None else None,
        **{name: value[rows.cuda()] for name, value in settings.items()})
    for b in range(16):
        one = slice(b, b + 1)
        alone = ops.verify_tree_sampling(
            logits[one], tokens[one], parents[one], uniforms=u[one], num_nodes=n[one],
            draft_probs=q[one] if q is not None else None,
            **{name: value[one] for name, value in settings.items()})
        for name in ("accept_index", "num_accepted", "emitted_tokens", "emitted_logprobs"):
            together = getattr(batched, name)[rows.cuda() == b]
            assert torch.equal(together, getattr(alone, name).expand_as(together)), (b, name)


def test_sampling_kernel_replays_in_a_cuda_graph(large_vocab_case):
    """With validate=False the sampling verifier has no host sync and allocates from the
    graph's pool: it captures, and a replay reads the inputs' new values."""
    case, _, uniforms = large_vocab_case
    logits, tokens, parents, u, n = cuda(case.logits[:4].to(torch.bfloat16), case.tokens[:4],
                                         case.parents[:4], uniforms[:4], case.num_nodes[:4])
    settings = row_settings(4, "cuda")

    def verify():
        return ops.verify_tree_sampling(logits, tokens, parents, uniforms=u, num_nodes=n,
                                        validate=False, **settings)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        verify()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = verify()
    u.copy_(torch.rand(u.shape, generator=torch.Generator().manual_seed(5)).cuda())
    graph.replay()
    expected = verify()
    for name in ("accept_index", "num_accepted", "emitted_tokens", "emitted_logprobs"):
        assert torch.equal(getattr(captured, name), getattr(expected, name)), name


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
