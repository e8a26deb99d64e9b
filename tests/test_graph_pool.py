"""The fixed-shape (static) target pass and the graph pool: eager on the CPU, captured on CUDA
(GPU tests skip without one)."""

import pytest
import torch

import tlt_core.ops as ops
from tests.speculative_fixtures import tiny_target
from tlt_core.engine.graph_pool import GraphPool
from tlt_core.model.kv_cache import CacheShape, KVCache

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cache(model, batch, max_len, device, lengths):
    c = model.config
    cache = KVCache(CacheShape(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim),
                    dtype=torch.float32, device=device)
    prefix = torch.randint(0, c.vocab_size, (batch, max(lengths)), device=device)
    positions = torch.arange(prefix.shape[1], device=device).expand_as(prefix)
    model.step(prefix, positions, cache)
    cache.commit(torch.tensor(lengths, device=device))
    return cache


def _tree_mask(batch, n, device):
    parents = torch.tensor([[-1, 0, 0, 1, 2][:n]] * batch, dtype=torch.int32, device=device)
    lengths = torch.zeros(batch, dtype=torch.int64, device=device)
    meta = ops.tree_metadata(parents, torch.full((batch,), n, dtype=torch.int32, device=device),
                             lengths)
    return ops.unpack_tree_mask(meta.mask, n)


@torch.no_grad()
@pytest.mark.parametrize("tokens,tree", [(1, False), (5, False), (5, True)])
def test_static_pass_equals_the_dynamic_pass(tokens, tree):
    torch.manual_seed(0)
    model = tiny_target()
    lengths = [3, 7, 5]
    outs = []
    for static in (False, True):
        torch.manual_seed(2)  # the same prefix both times
        cache = _cache(model, 3, 24, "cpu", lengths)
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (3, tokens))
        positions = cache.lengths[:, None] + torch.arange(tokens)
        mask = _tree_mask(3, tokens, "cpu") if tree else None
        out = model.step(ids, positions, cache, tree_mask=mask, hidden_layers=(0,),
                         read_len=cache.shape.max_len if static else None)
        outs.append((out.logits, out.hidden_states[0], cache.data.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cpu_pool_runs_eagerly():
    pool = GraphPool("cpu")
    assert not pool.enabled
    assert pool.run(("x", 4), lambda a, b: a + b, torch.ones(2), torch.ones(2)).tolist() == [2, 2]
    assert pool.reserved_bytes == 0
    with pytest.raises(ValueError, match="enabled"):
        GraphPool("cpu", enabled=True)


@needs_gpu
@torch.no_grad()
def test_replay_equals_eager_and_the_shared_pool_is_smaller_than_naive():
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = tiny_target().to(device)
    shared, naive = GraphPool(device), GraphPool(device, share_pool=False)
    for batch, tokens in ((4, 1), (4, 5), (8, 1), (8, 5), (8, 9)):
        cache = _cache(model, batch, 64, device, [3 + i for i in range(batch)])

        def verify(ids, positions, cache=cache):
            return model.step(ids, positions, cache, read_len=64).logits

        for replay in range(2):  # the second call replays the captured graph
            ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
            positions = cache.lengths[:, None] + torch.arange(tokens, device=device)
            eager = model.step(ids, positions, cache, read_len=64).logits.clone()
            got = shared.run((batch, tokens), verify, ids, positions).clone()
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
            naive.run((batch, tokens), verify, ids, positions)
    assert 0 < shared.reserved_bytes <= naive.reserved_bytes
