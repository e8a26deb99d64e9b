"""SGLang's tree-verification layout over tlt_core's verify kernels, as torch.library ops.

sgl-kernel verifies EAGLE draft trees with `verify_tree_greedy` and
`tree_speculative_sampling_target_only` (sgl-kernel/python/sgl_kernel/speculative.py, called
from sglang/srt/speculative/eagle_utils.py). The functions here take the same arguments in the
same order and write the same outputs in place, running the walk in
tlt_core.ops.verify_tree_greedy / verify_tree_sampling. They are the custom ops
`torch.ops.tlt.sglang_verify_tree_greedy` and
`torch.ops.tlt.sglang_tree_speculative_sampling_target_only`, with fake (meta)
implementations, so torch.compile traces them (fullgraph) and, with validate=False, they read
no value on the host and can be captured in a CUDA graph.

Shapes: B requests, N draft-tree nodes per request (node 0 the root, the last verified token),
S = accept_index.shape[1] (the most tokens a step commits: tree depth + 1), V vocabulary.
    predicts                (B * N,) int32   written at the accepted path's retrive_index: the
                                             token that follows that node (accepted draft or
                                             final token); other entries untouched
    accept_index            (B, S) int32     written: retrive_index of the accepted path, root
                                             first, -1 after
    accept_token_num        (B,) int32       written: accepted draft tokens
    candidates              (B, N) int       token of each node (node 0: the root's, not read)
    retrive_index           (B, N) int       flat index of each node in predicts (and in
                                             target_predict); SGLang's is b * N + i
    retrive_next_token      (B, N) int       first child of each node, -1 for none
    retrive_next_sibling    (B, N) int       next sibling, -1 for none
    target_predict          (B, N) int64     greedy: the target's token after each node, read at
                                             the flat index retrive_index (as sgl-kernel does)
    target_probs            (B, N, V) float32  sampling: p_target after each node, already
                                             through SGLang's temperature / top-k / top-p
    uniform_samples         (B, N) float32   sampling: the coin of each node (tests its children)
    uniform_samples_for_final_sampling (B,) float32  draws the final token

Trees: as SGLang's build_tree_kernel_efficient links them. A child's index is larger than its
parent's and siblings are linked in increasing index order (the order tlt's kernels try them
in); every node but the root is linked exactly once; the tree is at most S - 1 deep; siblings
carry distinct tokens (EAGLE's top-k expansions do). validate=True checks all of it.

Semantics (sgl-kernel's, per request; tlt's kernel walks the tree):
    greedy:   from the root, move to the first child (sibling order) whose candidate equals the
              target's token at the current node; commit the path and, at its last node, the
              target's token.
    sampling: at the current node v with coin u = uniform_samples[b, v] and P = 0, try v's
              children in order; for child c with token x: P += p_v(x); accept c iff
              u <= P / max(threshold_acc, 1e-9) or p_v(x) >= threshold_single (sgl-kernel's
              cap on threshold_acc). When no child is accepted
              (or v is a leaf), draw the final token from p_v with the rejected children's
              tokens removed, renormalised, by inverse CDF with
              uniform_samples_for_final_sampling[b]. With both thresholds 1 (the default) this
              is exact sampling from p_target (lossless); smaller thresholds accept more.
    tlt's kernel tests each child with its own uniform: the coin of node v is turned into child
    c's uniform (u * threshold_acc - P_before_c) / (1 - P_before_c) (0 where the threshold_single
    rule accepts), under which the kernel's test u_c * (1 - P_before_c) < p_v(x) is
    sgl-kernel's. Decisions agree except where a uniform lies within float32 rounding of a
    threshold (sgl-kernel compares u <= P, the kernel u_c < p, and p is renormalised from
    log(target_probs)); and a token with p_v(x) = 0 is never accepted, where sgl-kernel's
    threshold_single = 0 would accept it.
Not supported: draft_probs other than zeros (sgl-kernel's scratch buffer, passed as
torch.zeros_like(target_probs); here it is neither read nor written) and sibling orders other
than increasing index. `deterministic` is accepted for call compatibility: tlt's kernels are
always deterministic.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tlt_core import _C, ops
from tlt_core.ops import _arrays as arr

__all__ = ["verify_tree_greedy", "tree_speculative_sampling_target_only"]

# The largest float32 below 1: the kernel takes uniforms in [0, 1).
_BELOW_ONE = 1.0 - 2.0 ** -24
# sgl-kernel caps threshold_acc from below before dividing by it.
_MIN_THRESHOLD_ACC = 1e-9
_INDEX_DTYPES = (torch.int32, torch.int64)


def verify_tree_greedy(predicts: torch.Tensor, accept_index: torch.Tensor,
                       accept_token_num: torch.Tensor, candidates: torch.Tensor,
                       retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor, *,
                       validate: bool = True) -> None:
    """sgl-kernel's verify_tree_greedy (module docstring): fills predicts, accept_index and
    accept_token_num in place."""
    torch.ops.tlt.sglang_verify_tree_greedy(predicts, accept_index, accept_token_num, candidates,
                                            retrive_index, retrive_next_token,
                                            retrive_next_sibling, target_predict, validate)


def tree_speculative_sampling_target_only(
        predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
        candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
        retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
        uniform_samples_for_final_sampling: torch.Tensor, target_probs: torch.Tensor,
        draft_probs: Optional[torch.Tensor] = None, threshold_single: float = 1.0,
        threshold_acc: float = 1.0, deterministic: bool = True, *,
        validate: bool = True) -> None:
    """sgl-kernel's tree_speculative_sampling_target_only (module docstring): fills predicts,
    accept_index and accept_token_num in place. draft_probs: None or zeros; deterministic:
    accepted for call compatibility."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    torch.ops.tlt.sglang_tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, float(threshold_single), float(threshold_acc), validate)


# ---------------------------------------------------------------------------------------
# checks


def _check_tree_layout(predicts: torch.Tensor, accept_index: torch.Tensor,
                       accept_token_num: torch.Tensor, candidates: torch.Tensor,
                       retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor) -> torch.device:
    """The layout both ops share: shapes, dtypes, devices, each error naming its argument. Reads
    no values (the fake implementations run it)."""
    if candidates.dim() != 2 or candidates.shape[1] < 1:
        raise ValueError(f"candidates: expected shape (B, N), got {tuple(candidates.shape)}")
    batch, num_nodes_max = candidates.shape
    if num_nodes_max > _C.max_tree_nodes:
        raise ValueError(f"candidates: N = {num_nodes_max} nodes exceeds "
                         f"{_C.max_tree_nodes}")
    device = candidates.device
    for name, tensor in (("candidates", candidates), ("retrive_index", retrive_index),
                         ("retrive_next_token", retrive_next_token),
                         ("retrive_next_sibling", retrive_next_sibling)):
        if tensor.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name}: dtype must be int64 (or int32), got {tensor.dtype}")
        arr.check_shape(tensor, name, (batch, num_nodes_max))
        arr.check_device(tensor, name, device)
    for name, tensor, shape in (("predicts", predicts, (None,)),
                                ("accept_index", accept_index, (batch, None)),
                                ("accept_token_num", accept_token_num, (batch,))):
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name}: dtype must be int32 (torch.int32), got {tensor.dtype}")
        arr.check_shape(tensor, name, shape)
        arr.check_device(tensor, name, device)
    if accept_index.shape[1] < 1:
        raise ValueError("accept_index: needs at least one column (the root)")
    return device


def _check_sampling_layout(candidates: torch.Tensor, uniform_samples: torch.Tensor,
                           uniform_samples_for_final_sampling: torch.Tensor,
                           target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor],
                           threshold_single: float, threshold_acc: float) -> None:
    batch, num_nodes_max = candidates.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch, num_nodes_max):
        raise ValueError(f"target_probs: expected shape ({batch}, {num_nodes_max}, V) like "
                         f"candidates, got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if not 1 <= vocab <= _C.max_vocab:
        raise ValueError(f"target_probs: V = {vocab} must be in [1, {_C.max_vocab}]")
    for name, tensor, shape in (
            ("target_probs", target_probs, (batch, num_nodes_max, vocab)),
            ("draft_probs", draft_probs, (batch, num_nodes_max, vocab)),
            ("uniform_samples", uniform_samples, (batch, num_nodes_max)),
            ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling,
             (batch,))):
        if tensor is None:
            continue
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name}: dtype must be float32, got {tensor.dtype}")
        if name == "draft_probs" and tensor.dim() == 3 and tensor.shape[2] != vocab:
            raise ValueError(f"draft_probs: vocabulary {tensor.shape[2]} differs from "
                             f"target_probs' V = {vocab}")
        arr.check_shape(tensor, name, shape)
        arr.check_device(tensor, name, candidates.device)
    for name, value in (("threshold_single", threshold_single),
                        ("threshold_acc", threshold_acc)):
        if not 0.0 <= value <= 1.0:  # False for NaN too
            raise ValueError(f"{name}: must be in [0, 1], got {value!r}")


def _check_tree_values(predicts: torch.Tensor, accept_index: torch.Tensor,
                       candidates: torch.Tensor, retrive_index: torch.Tensor,
                       retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                       parents: torch.Tensor) -> None:
    """validate=True: the links form a tree as the module docstring requires, deep enough for
    accept_index, and retrive_index addresses distinct entries of predicts."""
    batch, num_nodes_max = candidates.shape
    node = torch.arange(num_nodes_max, device=candidates.device)  # (N,)
    incoming = torch.zeros((batch, num_nodes_max + 1), dtype=torch.int64,
                           device=candidates.device)  # (B, N + 1), column N: no link
    for name, links in (("retrive_next_token", retrive_next_token),
                        ("retrive_next_sibling", retrive_next_sibling)):
        links = links.to(torch.int64)  # (B, N)
        linked = links != -1
        bad = linked & ((links <= node[None, :]) | (links >= num_nodes_max))
        if bool(bad.any()):
            row, at = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(f"{name}: [{row}, {at}] = {int(links[row, at])}; a link must be -1 "
                             f"or a later node in [{at + 1}, {num_nodes_max}) (children after "
                             "their parent, siblings in increasing index order)")
        incoming.scatter_add_(1, torch.where(linked, links, num_nodes_max),
                              torch.ones_like(links))
    incoming = incoming[:, :num_nodes_max]  # (B, N)
    expected = (node > 0).to(torch.int64)[None, :]  # (1, N): root 0, every other node 1
    if bool((incoming != expected).any()):
        row, at = (int(i) for i in torch.nonzero(incoming != expected)[0])
        raise ValueError(f"retrive_next_token: with retrive_next_sibling, node {at} of row {row} "
                         f"is linked {int(incoming[row, at])} times; the root must be linked "
                         "0 times and every other node once")
    depth = ops.tree_metadata(parents).depths.amax(1)  # (B,)
    room = accept_index.shape[1] - 1
    if bool((depth > room).any()):
        row = int(torch.nonzero(depth > room)[0])
        raise ValueError(f"accept_index: has room for {room} accepted tokens, but row {row}'s "
                         f"tree is {int(depth[row])} deep")
    flat = retrive_index.reshape(-1).to(torch.int64)
    if bool(((flat < 0) | (flat >= predicts.shape[0])).any()):
        at = int(torch.nonzero((flat < 0) | (flat >= predicts.shape[0]))[0])
        raise ValueError(f"retrive_index: entry {at} is {int(flat[at])}, outside predicts' "
                         f"[0, {predicts.shape[0]})")
    if flat.numel() and bool((torch.sort(flat).values.diff() == 0).any()):
        raise ValueError("retrive_index: two nodes share an entry of predicts")


def _check_sampling_values(candidates: torch.Tensor, parents: torch.Tensor,
                           uniform_samples: torch.Tensor,
                           uniform_samples_for_final_sampling: torch.Tensor,
                           target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor]
                           ) -> None:
    vocab = target_probs.shape[2]
    draft = candidates[:, 1:].to(torch.int64)  # (B, N - 1); the root's token is not read
    if bool(((draft < 0) | (draft >= vocab)).any()):
        row, at = (int(i) for i in torch.nonzero((draft < 0) | (draft >= vocab))[0])
        raise ValueError(f"candidates: node {at + 1} of row {row} is {int(draft[row, at])}, "
                         f"outside target_probs' vocabulary [0, {vocab})")
    same = ((parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
            & (candidates[:, :, None] == candidates[:, None, :]))  # (B, N, N)
    same &= ~torch.eye(candidates.shape[1], dtype=torch.bool, device=candidates.device)
    if bool(same.any()):
        row, first, second = (int(i) for i in torch.nonzero(same)[0])
        raise ValueError(f"candidates: siblings {first} and {second} of row {row} carry the "
                         "same token; merge them")
    bad = ~torch.isfinite(target_probs).all(-1) | (target_probs < 0).any(-1)
    bad |= ~(target_probs.sum(-1) > 0)  # (B, N)
    if bool(bad.any()):
        row, at = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"target_probs: [{row}, {at}] is not a distribution (negative, "
                         "non-finite or no mass)")
    if draft_probs is not None and bool((draft_probs != 0).any()):
        raise ValueError("draft_probs: only zeros (sgl-kernel's scratch buffer) are supported; "
                         "the residual after rejections is computed inside the kernel")
    for name, uniforms in (("uniform_samples", uniform_samples),
                           ("uniform_samples_for_final_sampling",
                            uniform_samples_for_final_sampling)):
        if bool(((uniforms < 0) | ~(uniforms < 1)).any()):
            raise ValueError(f"{name}: every value must be in [0, 1)")


# ---------------------------------------------------------------------------------------
# layout conversion (tensor ops only: no host sync)


def _parents_from_links(retrive_next_token: torch.Tensor,
                        retrive_next_sibling: torch.Tensor) -> torch.Tensor:
    """(B, N) first-child / next-sibling links -> parents (B, N) int64, -1 for the root.

    A node's parent is the parent of the first sibling of its chain, found by pointer doubling
    over the previous-sibling links (log2 N gathers). Links outside [0, N) are dropped, so a bad
    tree gives a bad parents array for the kernel to refuse, never an out-of-bounds index."""
    batch, num_nodes_max = retrive_next_token.shape
    node = torch.arange(num_nodes_max, device=retrive_next_token.device)  # (N,)
    nodes = node.expand(batch, num_nodes_max)  # (B, N)

    def back_links(links: torch.Tensor) -> torch.Tensor:
        """(B, N) forward links -> (B, N) the node linking to each one, -1 for none."""
        links = links.to(torch.int64)
        target = torch.where((links >= 0) & (links < num_nodes_max), links, num_nodes_max)
        back = torch.full((batch, num_nodes_max + 1), -1, dtype=torch.int64, device=node.device)
        return back.scatter_(1, target, nodes)[:, :num_nodes_max]  # column N: unlinked

    parent_of_first = back_links(retrive_next_token)  # (B, N)
    previous = back_links(retrive_next_sibling)  # (B, N)
    first = torch.where(previous >= 0, previous, nodes)  # (B, N)
    for _ in range(max(1, math.ceil(math.log2(num_nodes_max)))):
        first = first.gather(1, first)
    return parent_of_first.gather(1, first)  # (B, N)


def _write_outputs(predicts: torch.Tensor, accept_index: torch.Tensor,
                   accept_token_num: torch.Tensor, retrive_index: torch.Tensor,
                   path: torch.Tensor, num_accepted: torch.Tensor,
                   next_tokens: torch.Tensor) -> None:
    """The kernel's path (B, N) node indices and the token after each path node (B, N) written
    in sgl-kernel's form: accept_index holds retrive_index of the path (-1 after), predicts the
    token at each path node's retrive_index."""
    batch, num_nodes_max = path.shape
    steps = accept_index.shape[1]
    on_path = (torch.arange(num_nodes_max, device=path.device)[None, :]
               <= num_accepted.to(torch.int64)[:, None])  # (B, N)
    flat = retrive_index.to(torch.int64).gather(1, path.to(torch.int64).clamp(min=0))  # (B, N)
    accepted = torch.where(on_path, flat, -1)  # (B, N)
    if num_nodes_max < steps:
        accepted = torch.cat((accepted, accepted.new_full((batch, steps - num_nodes_max), -1)), 1)
    accept_index.copy_(accepted[:, :steps])
    accept_token_num.copy_(num_accepted)
    # One spare slot takes the writes of nodes off the path, so that the scatter needs no mask.
    size = predicts.shape[0]
    slot = torch.where(on_path & (flat >= 0) & (flat < size), flat, size)  # (B, N)
    staged = torch.cat((predicts, predicts.new_zeros(1)))  # (B * N + 1,)
    staged.scatter_(0, slot.reshape(-1), next_tokens.reshape(-1).to(torch.int32))
    predicts.copy_(staged[:size])


# ---------------------------------------------------------------------------------------
# the ops


@torch.library.custom_op("tlt::sglang_verify_tree_greedy",
                         mutates_args=("predicts", "accept_index", "accept_token_num"))
def _verify_tree_greedy_op(predicts: torch.Tensor, accept_index: torch.Tensor,
                           accept_token_num: torch.Tensor, candidates: torch.Tensor,
                           retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor,
                           validate: bool) -> None:
    _check_greedy_layout(predicts, accept_index, accept_token_num, candidates, retrive_index,
                         retrive_next_token, retrive_next_sibling, target_predict)
    batch, num_nodes_max = candidates.shape
    parents = _parents_from_links(retrive_next_token, retrive_next_sibling)  # (B, N)
    if validate:
        _check_tree_values(predicts, accept_index, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, parents)
        flat = retrive_index.reshape(-1)
        if bool((flat >= target_predict.numel()).any()):
            raise ValueError(f"retrive_index: addresses target_predict beyond its "
                             f"{target_predict.numel()} entries")
    if batch == 0:
        return
    # The walk only compares a child's token with the target's token at its parent, so the
    # kernel runs on a two-symbol vocabulary: 1 = "the target's token" (every node's argmax),
    # 0 = "another token".
    index = retrive_index.to(torch.int64).clamp(0, max(target_predict.numel() - 1, 0))
    target_token = target_predict.reshape(-1)[index]  # (B, N) the target's token after each node
    at_parent = target_token.gather(1, parents.clamp(min=0))  # (B, N)
    matches = (candidates.to(torch.int64) == at_parent).to(torch.int64)  # (B, N)
    # (arange, not torch.tensor: a host-to-device copy cannot be captured in a CUDA graph)
    logits = torch.arange(2, dtype=torch.float32, device=candidates.device).expand(
        batch, num_nodes_max, 2).contiguous()  # (B, N, 2)
    out = ops.verify_tree_greedy(logits, matches, parents, validate=validate)
    path_tokens = target_token.gather(1, out.accept_index.to(torch.int64).clamp(min=0))  # (B, N)
    _write_outputs(predicts, accept_index, accept_token_num, retrive_index, out.accept_index,
                   out.num_accepted, path_tokens)


def _check_greedy_layout(predicts, accept_index, accept_token_num, candidates, retrive_index,
                         retrive_next_token, retrive_next_sibling, target_predict) -> None:
    device = _check_tree_layout(predicts, accept_index, accept_token_num, candidates,
                                retrive_index, retrive_next_token, retrive_next_sibling)
    if target_predict.dtype not in _INDEX_DTYPES:
        raise TypeError(f"target_predict: dtype must be int64 (or int32), got "
                        f"{target_predict.dtype}")
    arr.check_shape(target_predict, "target_predict", tuple(candidates.shape))
    arr.check_device(target_predict, "target_predict", device)


@_verify_tree_greedy_op.register_fake
def _verify_tree_greedy_fake(predicts, accept_index, accept_token_num, candidates,
                             retrive_index, retrive_next_token, retrive_next_sibling,
                             target_predict, validate) -> None:
    _check_greedy_layout(predicts, accept_index, accept_token_num, candidates, retrive_index,
                         retrive_next_token, retrive_next_sibling, target_predict)


@torch.library.custom_op("tlt::sglang_tree_speculative_sampling_target_only",
                         mutates_args=("predicts", "accept_index", "accept_token_num"))
def _tree_sampling_op(predicts: torch.Tensor, accept_index: torch.Tensor,
                      accept_token_num: torch.Tensor, candidates: torch.Tensor,
                      retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                      retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
                      uniform_samples_for_final_sampling: torch.Tensor,
                      target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor],
                      threshold_single: float, threshold_acc: float, validate: bool) -> None:
    _check_tree_layout(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling)
    _check_sampling_layout(candidates, uniform_samples, uniform_samples_for_final_sampling,
                           target_probs, draft_probs, threshold_single, threshold_acc)
    batch, num_nodes_max, vocab = target_probs.shape
    parents = _parents_from_links(retrive_next_token, retrive_next_sibling)  # (B, N)
    if validate:
        _check_tree_values(predicts, accept_index, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, parents)
        _check_sampling_values(candidates, parents, uniform_samples,
                               uniform_samples_for_final_sampling, target_probs, draft_probs)
    if batch == 0:
        return
    tokens = candidates.to(torch.int64).clamp(0, vocab - 1)  # (B, N)
    uniforms = _child_uniforms(parents, tokens, uniform_samples,
                               uniform_samples_for_final_sampling, target_probs,
                               threshold_single, threshold_acc)  # (B, N)
    # softmax(log p) at temperature 1 is p: the kernel samples from target_probs as given.
    out = ops.verify_tree_sampling(torch.log(target_probs), tokens, parents, temperature=1.0,
                                   uniforms=uniforms, validate=validate)
    _write_outputs(predicts, accept_index, accept_token_num, retrive_index, out.accept_index,
                   out.num_accepted, out.emitted_tokens)


def _child_uniforms(parents: torch.Tensor, tokens: torch.Tensor, uniform_samples: torch.Tensor,
                    uniform_samples_for_final_sampling: torch.Tensor,
                    target_probs: torch.Tensor, threshold_single: float,
                    threshold_acc: float) -> torch.Tensor:
    """The kernel's uniforms (B, N) float32 that make its per-child test sgl-kernel's coin rule
    (module docstring): column 0 draws the final token, column c >= 1 tests child c."""
    batch, num_nodes_max, _ = target_probs.shape
    parent = parents.clamp(min=0)  # (B, N)
    rows = torch.arange(batch, device=parents.device)[:, None]  # (B, 1)
    p_child = target_probs[rows, parent, tokens].to(torch.float64)  # (B, N) p_parent(x_c)
    node = torch.arange(num_nodes_max, device=parents.device)  # (N,)
    earlier_sibling = ((parents[:, :, None] == parents[:, None, :])
                       & (node[None, :] < node[:, None]))  # (B, N, N): [c, s] s before c
    p_before = (earlier_sibling * p_child[:, None, :]).sum(-1)  # (B, N)
    coin = uniform_samples.gather(1, parent).to(torch.float64)  # (B, N) the parent's coin
    scaled = coin * max(threshold_acc, _MIN_THRESHOLD_ACC)
    child = (scaled - p_before) / (1.0 - p_before).clamp(min=torch.finfo(torch.float64).tiny)
    child = torch.where(p_child >= threshold_single, 0.0, child)  # (B, N)
    final = uniform_samples_for_final_sampling.to(torch.float64)[:, None]  # (B, 1)
    uniforms = torch.cat((final, child[:, 1:]), 1)  # (B, N)
    return uniforms.clamp(0.0, _BELOW_ONE).to(torch.float32).clamp(max=_BELOW_ONE)


@_tree_sampling_op.register_fake
def _tree_sampling_fake(predicts, accept_index, accept_token_num, candidates, retrive_index,
                        retrive_next_token, retrive_next_sibling, uniform_samples,
                        uniform_samples_for_final_sampling, target_probs, draft_probs,
                        threshold_single, threshold_acc, validate) -> None:
    _check_tree_layout(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling)
    _check_sampling_layout(candidates, uniform_samples, uniform_samples_for_final_sampling,
                           target_probs, draft_probs, threshold_single, threshold_acc)
