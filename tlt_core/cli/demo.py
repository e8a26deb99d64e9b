"""`tlt demo`: one speculative-decoding step through every kernel, printed as it happens.

A toy drafter proposes top-k expansions for a few depths; select_tree keeps the best nodes;
tree_metadata gives the positions and attention mask a target forward would use; a toy target
(logits that agree with the drafter most of the time) is verified greedily and by lossless
rejection sampling; compact_kv_ then moves the accepted path's cache entries into place. The
last part checks, by sampling, that the emitted first token follows the target distribution.
"""

from __future__ import annotations

import torch

import tlt_core.ops as ops
from tlt_core.ops import reference

VOCAB, DEPTH, TOPK, NUM_NODES = 12, 3, 3, 8


def toy_candidates(generator: torch.Generator):
    """Per-depth top-k expansions of a toy drafter: (tokens, cumulative log q, parents)."""
    tokens, scores, parents, frontier = [], [], [], [(-1, 0.0)]
    for _ in range(DEPTH):
        level = []
        for parent, score in frontier:
            logq = torch.log_softmax(torch.randn(VOCAB, generator=generator) * 2, -1)
            top = logq.topk(TOPK)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                level.append((len(tokens), score + value))
                tokens.append(token)
                scores.append(score + value)
                parents.append(parent)
        frontier = sorted(level, key=lambda item: (-item[1], item[0]))[:TOPK]
    return (torch.tensor([tokens]), torch.tensor([scores], dtype=torch.float32),
            torch.tensor([parents], dtype=torch.int32))


def main() -> int:
    g = torch.Generator().manual_seed(0)
    cand_tokens, cand_scores, cand_parents = toy_candidates(g)
    print(f"drafter: {cand_tokens.shape[1]} candidates from depth-{DEPTH} top-{TOPK} expansion")
    tree = ops.select_tree(cand_tokens, cand_scores, cand_parents, torch.tensor([5]), NUM_NODES)
    print(f"select_tree (best {NUM_NODES - 1} + root):")
    print(f"  tokens  {tree.tokens[0].tolist()}\n  parents {tree.parents[0].tolist()}")

    cache_len = torch.tensor([20], dtype=torch.int32)
    meta = ops.tree_metadata(tree.parents, tree.num_nodes, cache_len)
    print(f"tree_metadata: positions {meta.positions[0].tolist()}")
    mask = ops.unpack_tree_mask(meta.mask, NUM_NODES)[0].int()
    print("  ancestor mask (row i attends to j):")
    for i in range(NUM_NODES):
        print("   ", " ".join("x" if m else "." for m in mask[i].tolist()))

    # A target that prefers each node's first child 3 times out of 4.
    logits = torch.randn(1, NUM_NODES, VOCAB, generator=g)
    for i in range(1, NUM_NODES):
        parent = int(tree.parents[0, i])
        if int((tree.parents[0, :i] == parent).sum()) == 0 and float(torch.rand(1, generator=g)) < 0.75:
            logits[0, parent, tree.tokens[0, i]] += 4.0
    greedy = ops.verify_tree_greedy(logits, tree.tokens, tree.parents, tree.num_nodes)
    n = int(greedy.num_accepted[0])
    print(f"verify_tree_greedy: accepted {n} draft token(s), path {greedy.accept_index[0, :n + 1].tolist()},"
          f" emits {greedy.emitted_tokens[0, :n + 1].tolist()}")
    sampled = ops.verify_tree_sampling(logits, tree.tokens, tree.parents, temperature=0.8,
                                       top_p=0.95, seed=1, num_nodes=tree.num_nodes)
    n = int(sampled.num_accepted[0])
    print(f"verify_tree_sampling (T=0.8, top_p=0.95): emits {sampled.emitted_tokens[0, :n + 1].tolist()}"
          f" with log p {[round(v, 3) for v in sampled.emitted_logprobs[0, :n + 1].tolist()]}")

    cache = torch.arange(2 * 1 * 32, dtype=torch.float32).view(2, 1, 1, 32, 1)  # (planes, B, H, T, d)
    ops.compact_kv_(cache, greedy.accept_index, greedy.num_accepted, cache_len)
    kept = int(cache_len[0]) + int(greedy.num_accepted[0]) + 1
    print(f"compact_kv_: slots {int(cache_len[0])}..{kept - 1} now hold tree slots "
          f"{[int(v) - int(cache_len[0]) for v in cache[0, 0, 0, int(cache_len[0]):kept, 0].tolist()]}")

    rows = 20000
    out = ops.verify_tree_sampling(logits.expand(rows, -1, -1).contiguous(),
                                   tree.tokens.expand(rows, -1), tree.parents.expand(rows, -1),
                                   temperature=0.8, top_p=0.95, seed=torch.arange(rows))
    first = torch.bincount(out.emitted_tokens[:, 0], minlength=VOCAB).double() / rows
    w, total = reference.processed_target_probs(logits[0, 0], 0.8, 0, 0.95)
    gap = float((first - w.double() / float(total)).abs().sum() / 2)
    print(f"lossless check: first emitted token over {rows} seeds vs p_target: total variation {gap:.4f}"
          " (sampling noise is ~0.01)")
    return 0


def add_parsers(commands) -> None:
    demo = commands.add_parser("demo", help="one verification step on a toy tree, explained",
                               description="One speculative verification step on a toy draft "
                                           "tree, explained step by step.")
    demo.set_defaults(runner=lambda args: main())
