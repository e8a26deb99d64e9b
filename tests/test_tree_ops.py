"""Tree selection and tree metadata: kernels equal the reference, and the trees they produce
keep the draft-tree contract (root first, parents[i] < i, ancestor-closed, siblings by score)."""

import pytest
import torch

import tlt_core.ops as ops
from tlt_core.ops import reference


def eagle_candidates(seed: int, batch: int, depth: int, topk: int, vocab: int = 1000,
                     ties: bool = False, invalid: float = 0.0):
    """Per-depth top-k expansions as an EAGLE-2 drafter produces them: depth 0 expands the root
    into `topk` children; each later depth expands the `topk` best frontier nodes into `topk`
    children each. Scores are cumulative log-probs (decreasing along a path)."""
    g = torch.Generator().manual_seed(seed)
    tokens, scores, parents = [], [], []
    frontier = [(-1, 0.0)] * 1  # (candidate index, cumulative score)
    for d in range(depth):
        level = []
        for parent, score in frontier:
            logq = torch.log_softmax(torch.randn(topk + 3, generator=g), -1)[:topk]
            if ties:
                logq = torch.round(logq * 2) / 2
            for t in range(topk):
                index = len(tokens)
                tokens.append(int(torch.randint(0, vocab, (1,), generator=g)))
                s = score + float(logq[t])
                if invalid and float(torch.rand(1, generator=g)) < invalid:
                    s = float("-inf")
                scores.append(s)
                parents.append(parent)
                level.append((index, s))
        level.sort(key=lambda item: (-item[1], item[0]))
        frontier = level[:topk]
    return tokens, scores, parents


def batch_candidates(seed, batch, depth, topk, **kwargs):
    rows = [eagle_candidates(seed * 1000 + b, batch, depth, topk, **kwargs) for b in range(batch)]
    tokens = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    scores = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    parents = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    roots = torch.arange(batch, dtype=torch.int64) + 7
    return tokens, scores, parents, roots


@pytest.mark.parametrize("depth,topk,num_nodes", [(1, 1, 2), (1, 4, 3), (4, 1, 5), (5, 4, 16),
                                                  (6, 8, 32), (3, 8, 64), (6, 10, 60)])
@pytest.mark.parametrize("variant", ["plain", "ties", "invalid"])
def test_select_tree_matches_reference(depth, topk, num_nodes, variant):
    cands = batch_candidates(depth * 31 + topk, 4, depth, topk, ties=variant == "ties",
                             invalid=0.3 if variant == "invalid" else 0.0)
    oracle = reference.select_tree(*cands, num_nodes)
    for validate in (True, False):  # the engine's unchecked fast path selects the same tree
        tree = ops.select_tree(*cands, num_nodes=num_nodes, validate=validate)
        for got, want in zip((tree.tokens, tree.parents, tree.source_index, tree.num_nodes),
                             oracle):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_selected_trees_keep_the_contract():
    cand_tokens, scores, cand_parents, roots = batch_candidates(5, 8, 6, 8)
    tree = ops.select_tree(cand_tokens, scores, cand_parents, roots, num_nodes=32)
    for b in range(8):
        n = int(tree.num_nodes[b])
        assert n == 32 and int(tree.tokens[b, 0]) == int(roots[b])
        assert int(tree.parents[b, 0]) == -1
        eff = {}
        for m in range(scores.shape[1]):
            p = int(cand_parents[b, m])
            eff[m] = float(scores[b, m]) if p < 0 else min(float(scores[b, m]), eff[p])
        chosen = {int(tree.source_index[b, i]) for i in range(1, n)}
        best = sorted(eff, key=lambda m: (-eff[m], m))[: n - 1]
        assert chosen == set(best), "keeps exactly the N-1 best candidates"
        for i in range(1, n):
            parent = int(tree.parents[b, i])
            assert 0 <= parent < i, "topological"
            m = int(tree.source_index[b, i])
            assert int(tree.tokens[b, i]) == int(cand_tokens[b, m])
            want_parent = int(cand_parents[b, m])
            assert (parent == 0) if want_parent < 0 else int(tree.source_index[b, parent]) == want_parent
        for v in range(n):  # siblings ordered by draft score
            kids = [i for i in range(1, n) if int(tree.parents[b, i]) == v]
            kid_scores = [eff[int(tree.source_index[b, i])] for i in kids]
            assert kid_scores == sorted(kid_scores, reverse=True)


def test_select_tree_pads_rows_with_few_candidates():
    tokens = torch.tensor([[3, 4, 5], [6, 7, 8]])
    scores = torch.tensor([[-0.1, float("-inf"), -0.5], [float("-inf")] * 3])
    parents = torch.tensor([[-1, -1, 0], [-1, 0, 1]], dtype=torch.int32)
    tree = ops.select_tree(tokens, scores, parents, torch.tensor([1, 2]), num_nodes=4)
    assert tree.num_nodes.tolist() == [3, 1]
    assert tree.tokens.tolist() == [[1, 3, 5, 0], [2, 0, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 1, -1], [-1, -1, -1, -1]]
    assert tree.source_index.tolist() == [[-1, 0, 2, -1], [-1, -1, -1, -1]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_max", [1, 5, 32, 33, 64, 100])
def test_tree_metadata_matches_reference(seed, n_max):
    g = torch.Generator().manual_seed(seed)
    batch = 5
    parents = torch.full((batch, n_max), -1, dtype=torch.int32)
    for i in range(1, n_max):
        parents[:, i] = torch.randint(0, i, (batch,), generator=g, dtype=torch.int32)
    num_nodes = torch.randint(1, n_max + 1, (batch,), generator=g, dtype=torch.int32)
    cache_len = torch.randint(0, 1000, (batch,), generator=g, dtype=torch.int32)
    meta = ops.tree_metadata(parents, num_nodes, cache_len)
    depths, positions, mask = reference.tree_metadata(parents, num_nodes, cache_len)
    torch.testing.assert_close(meta.depths, depths, rtol=0, atol=0)
    torch.testing.assert_close(meta.positions, positions, rtol=0, atol=0)
    torch.testing.assert_close(meta.mask, mask, rtol=0, atol=0)
    # The packed mask is the ancestor relation, built independently.
    torch.testing.assert_close(ops.unpack_tree_mask(meta.mask, n_max),
                               reference.tree_attention_mask(parents, num_nodes))


def test_tree_metadata_of_a_known_tree():
    parents = torch.tensor([[-1, 0, 0, 1, 3]], dtype=torch.int32)
    meta = ops.tree_metadata(parents, cache_len=torch.tensor([10]))
    assert meta.depths.tolist() == [[0, 1, 1, 2, 3]]
    assert meta.positions.tolist() == [[10, 11, 11, 12, 13]]
    assert meta.mask[0, :, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b11011]
