"""tlt's verify kernels in SGLang's EAGLE tree layout (sgl-kernel's verify_tree_greedy and
tree_speculative_sampling_target_only), on trees that tlt's own select_tree built.

    python examples/sglang_tree_verify.py
    python examples/sglang_tree_verify.py --rows 4000 --depth 4 --topk 4 --nodes 16

SGLang's EAGLE worker describes a draft tree by first-child / next-sibling links
(retrive_next_token, retrive_next_sibling), the flat position of each node (retrive_index),
the node tokens (candidates) and target probabilities per node, and reads predicts /
accept_index / accept_token_num back, written in place. `tlt_core.integrations.sglang_ops` has
functions with sgl-kernel's signatures, the custom ops `torch.ops.tlt.sglang_*`. This script
builds EAGLE-2 trees with `tlt_core.ops.select_tree`, converts them to SGLang's links
(`sglang_links`) and verifies them both ways. SGLang itself is not needed (nor installed: it
requires a CUDA build of torch).

What it proves (each is an assert; the script exits non-zero when one fails):

1. One tree, two layouts, one answer: greedy verification in SGLang's layout commits the same
   path and tokens as `tlt_core.ops.verify_tree_greedy` on the tree in tlt's layout.
2. Lossless at sgl-kernel's default thresholds (1, 1): the token after the root is distributed
   as the target's probabilities there (chi-square p-value > 1e-3, pooled over rows that share
   the root distribution), and the first child's tokens, emitted unverified, fail that test.
3. SGLang's relaxed acceptance (threshold_single < 1, threshold_acc < 1; not lossless) accepts
   more tokens per step on the same uniforms; both means are printed.
4. The sampling op traced by torch.compile(fullgraph=True) gives the same outputs as eager.
"""

from __future__ import annotations

import argparse
import sys

import torch
from scipy import stats

import tlt_core.ops as ops
from tlt_core.integrations import sglang_ops


def eagle_tree(rows: int, depth: int, topk: int, nodes: int, root_logits: torch.Tensor,
               g: torch.Generator) -> ops.DraftTree:
    """EAGLE-2 drafting with a random drafter near the target: each depth expands the best
    `topk` frontier nodes by their `topk` most likely tokens; select_tree keeps the best
    `nodes - 1` by cumulative log-prob."""
    vocab = root_logits.shape[0]
    tokens, scores, parents = [], [], []
    frontier_index = torch.full((rows, 1), -1)  # (B, F) candidate index, -1: the root
    frontier_score = torch.zeros(rows, 1)  # (B, F)
    for level in range(depth):
        base = root_logits if level == 0 else torch.zeros(vocab)
        logits = base + torch.randn(rows, frontier_index.shape[1], vocab, generator=g) * 2
        logq, token = torch.log_softmax(logits, -1).topk(topk, -1)  # (B, F, K)
        score = (frontier_score[..., None] + logq).flatten(1)  # (B, F * K)
        start = sum(t.shape[1] for t in tokens)
        tokens.append(token.flatten(1))
        scores.append(score)
        parents.append(frontier_index[..., None].expand(-1, -1, topk).flatten(1))
        best = score.topk(min(topk, score.shape[1]), -1).indices  # (B, K)
        frontier_index, frontier_score = best + start, score.gather(1, best)
    return ops.select_tree(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                           torch.zeros(rows, dtype=torch.int64), num_nodes=nodes)


def sglang_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tlt's parents (B, N) -> SGLang's (retrive_next_token, retrive_next_sibling), siblings
    linked in increasing index order as build_tree_kernel_efficient links them."""
    next_token = torch.full(parents.shape, -1, dtype=torch.int64)
    next_sibling = torch.full(parents.shape, -1, dtype=torch.int64)
    for b, row in enumerate(parents.tolist()):
        last_child: dict[int, int] = {}
        for c, parent in enumerate(row):
            if c == 0 or parent < 0:
                continue
            if parent in last_child:
                next_sibling[b, last_child[parent]] = c
            else:
                next_token[b, parent] = c
            last_child[parent] = c
    return next_token, next_sibling


def sglang_call(tree: ops.DraftTree, next_token: torch.Tensor, next_sibling: torch.Tensor,
                steps: int) -> dict:
    """SGLang's buffers for one verify step: outputs pre-filled as eagle_utils.py fills them."""
    rows, nodes = tree.tokens.shape
    return dict(predicts=torch.full((rows * nodes,), -1, dtype=torch.int32),
                accept_index=torch.full((rows, steps), -1, dtype=torch.int32),
                accept_token_num=torch.zeros(rows, dtype=torch.int32),
                candidates=tree.tokens, retrive_index=torch.arange(rows * nodes).view(rows, nodes),
                retrive_next_token=next_token, retrive_next_sibling=next_sibling)


def sample(call: dict, uniforms: torch.Tensor, final_uniforms: torch.Tensor,
           target_probs: torch.Tensor, threshold_single: float = 1.0,
           threshold_acc: float = 1.0) -> dict:
    out = {k: v.clone() if k in ("predicts", "accept_index", "accept_token_num") else v
           for k, v in call.items()}
    sglang_ops.tree_speculative_sampling_target_only(
        *out.values(), uniforms, final_uniforms, target_probs,
        torch.zeros_like(target_probs), threshold_single, threshold_acc)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    root_logits = torch.randn(args.vocab, generator=g) * 2  # shared by every row's root
    tree = eagle_tree(args.rows, args.depth, args.topk, args.nodes, root_logits, g)
    logits = torch.randn(args.rows, args.nodes, args.vocab, generator=g) * 2  # (B, N, V)
    children = tree.parents.long().clamp(min=0)
    favoured = torch.rand(args.rows, args.nodes, generator=g) < 0.6  # targets that agree often
    logits[torch.arange(args.rows)[:, None].expand_as(children)[favoured], children[favoured],
           tree.tokens[favoured]] += 3.0
    logits[:, 0] = root_logits  # the root's target distribution is the same in every row
    next_token, next_sibling = sglang_links(tree.parents)
    call = sglang_call(tree, next_token, next_sibling, args.depth + 1)

    # 1. greedy: SGLang's layout against tlt's layout
    greedy = {k: v.clone() if k in ("predicts", "accept_index", "accept_token_num") else v
              for k, v in call.items()}
    sglang_ops.verify_tree_greedy(*greedy.values(), logits.argmax(-1))
    tlt = ops.verify_tree_greedy(logits, tree.tokens, tree.parents, tree.num_nodes)
    path = tlt.accept_index[:, :args.depth + 1].long()  # (B, depth + 1)
    assert torch.equal(greedy["accept_token_num"], tlt.num_accepted)
    assert torch.equal(greedy["accept_index"].long(),
                       torch.where(path >= 0, call["retrive_index"].gather(1, path.clamp(min=0)),
                                   -1))
    on_path = path >= 0
    flat = call["retrive_index"].gather(1, path.clamp(min=0))[on_path]
    assert torch.equal(greedy["predicts"][flat].long(),
                       tlt.emitted_tokens[:, :args.depth + 1][on_path])

    # 2. lossless sampling at the default thresholds
    target_probs = torch.softmax(logits, -1)  # (B, N, V)
    uniforms = torch.rand(args.rows, args.nodes, generator=g)
    final_uniforms = torch.rand(args.rows, generator=g)
    exact = sample(call, uniforms, final_uniforms, target_probs)
    after_root = exact["predicts"].view(args.rows, args.nodes)[:, 0].long()
    observed = torch.bincount(after_root, minlength=args.vocab).double()
    p_root = torch.softmax(root_logits.double(), -1)
    p_value = float(stats.chisquare(observed, p_root * observed.sum()).pvalue)
    first_child = tree.tokens[:, 1]  # node 1: the root's best-scored child
    drafted = torch.bincount(first_child, minlength=args.vocab).double()
    control = float(stats.chisquare(drafted, p_root * drafted.sum()).pvalue)
    assert p_value > 1e-3, f"the token after the root does not follow p (p = {p_value:.2g})"
    assert control < 1e-3, "the check cannot tell the drafter from the target"

    # 3. SGLang's relaxed acceptance accepts more on the same uniforms
    relaxed = sample(call, uniforms, final_uniforms, target_probs, threshold_single=0.3,
                     threshold_acc=0.5)
    mean_exact = float(exact["accept_token_num"].double().mean())
    mean_relaxed = float(relaxed["accept_token_num"].double().mean())
    assert mean_relaxed > mean_exact

    # 4. the op under torch.compile
    compiled = torch.compile(sample, fullgraph=True, backend="aot_eager")(
        call, uniforms, final_uniforms, target_probs)
    assert all(torch.equal(compiled[k], exact[k])
               for k in ("predicts", "accept_index", "accept_token_num"))

    print(f"{args.rows} trees of {args.nodes} nodes: greedy equal in both layouts; sampled: "
          f"{mean_exact:.2f} accepted per step, token after the root chi-square p = "
          f"{p_value:.3f} vs target ({control:.2g} for the drafter's first child); relaxed "
          f"thresholds (0.3, 0.5): {mean_relaxed:.2f} accepted; compiled == eager")
    return dict(rows=args.rows, p_value=p_value, control_p_value=control,
                mean_accepted=mean_exact, mean_accepted_relaxed=mean_relaxed,
                greedy_mean_accepted=float(tlt.num_accepted.double().mean()))


if __name__ == "__main__":
    main(sys.argv[1:])
