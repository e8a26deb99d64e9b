"""Invariant "Cache truth" at the model level: after rollback (and, in test_model.py, after
tree compaction) the cache equals the one built from the kept prefix alone."""

import pytest
import torch

from tlt_core.model.kv_cache import CacheBudgetError, CacheShape, KVCache
from tlt_core.model.transformer import ModelConfig, Transformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return Transformer(ModelConfig(vocab_size=30, num_layers=2)).eval()


def prefill(model, rows: list[list[int]], max_len=24) -> KVCache:
    cache = KVCache(CacheShape(2, len(rows), 2, max_len, 16))
    for b, ids in enumerate(rows):
        view = cache.rows(b, 1)
        with torch.no_grad():
            model(torch.tensor([ids]), torch.arange(len(ids))[None], view)
        view.commit(torch.tensor([len(ids)]))
    return cache


def test_rollback_then_decode_equals_cache_of_kept_prefix(model):
    full = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    keep = [5, 2]
    cache = prefill(model, full)
    cache.rollback(torch.tensor(keep))
    new_tokens = torch.tensor([[20, 21, 22], [23, 24, 25]])
    positions = cache.lengths[:, None] + torch.arange(3)[None]
    with torch.no_grad():
        logits = model(new_tokens, positions, cache).logits
    cache.commit(torch.tensor([3, 3]))
    rebuilt = prefill(model, [full[b][:keep[b]] + new_tokens[b].tolist() for b in range(2)])
    assert torch.equal(cache.lengths, rebuilt.lengths)
    for b in range(2):
        n = int(cache.lengths[b])
        torch.testing.assert_close(cache.data[:, :, b, :, :n], rebuilt.data[:, :, b, :, :n],
                                   atol=1e-5, rtol=0)
        with torch.no_grad():
            ids = full[b][:keep[b]] + new_tokens[b].tolist()
            want = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -3:]
        torch.testing.assert_close(logits[b], want, atol=1e-4, rtol=0)


def test_move_row_keeps_the_sequence(model):
    cache = prefill(model, [[1, 2, 3], [4, 5, 6, 7, 8]])
    before = cache.data[:, :, 1, :, :5].clone()
    cache.move_row(1, 0)
    assert int(cache.lengths[0]) == 5
    assert torch.equal(cache.data[:, :, 0, :, :5], before)


def test_cache_errors_are_clear():
    cache = KVCache(CacheShape(1, 2, 1, 8, 4))
    with pytest.raises(ValueError, match="rollback can only shrink"):
        cache.rollback(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="max_len: row 0"):
        cache.commit(torch.tensor([9, 0]))
    with pytest.raises(ValueError, match="rows:"):
        cache.rows(1, 2)
    with pytest.raises(ValueError, match="head_dim"):
        CacheShape(1, 1, 1, 1, 0)
    with pytest.raises(CacheBudgetError, match="budget_bytes"):
        KVCache(CacheShape(4, 8, 4, 1024, 64), budget_bytes=1 << 20)
