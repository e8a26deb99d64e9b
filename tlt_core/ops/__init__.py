"""tlt_core.ops: the fused tree speculative-decoding kernels, one function per kernel.

Every function accepts torch tensors (CPU or CUDA) or any DLPack array (NumPy, CuPy), returns
results of the same kind on the same device, and raises ValueError / TypeError naming the
offending argument. Semantics are those of the C++ headers in csrc/include/tlt/ and of the
pure-PyTorch oracle in tlt_core.ops.reference.

Notation: B rows, N tree nodes, V vocabulary, M draft candidates, W = ceil(N / 32).
p_target is the target's (temperature / top-k / top-p transformed) distribution, q_draft the
drafter's. A draft tree is tokens[B, N] and parents[B, N]: node 0 is the root (the last
committed token, not yet in the KV cache), parents[:, 0] = -1 and parents[b, i] < i.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tlt_core import _C
from tlt_core.ops import _arrays as arr
from tlt_core.ops.records import DraftTree, TreeMetadata, VerifyOutput

__all__ = [
    "DraftTree", "TreeMetadata", "VerifyOutput", "select_tree", "tree_metadata",
    "unpack_tree_mask", "verify_tree_greedy", "verify_tree_sampling", "compact_kv_",
    "philox_uniforms", "built_with_cuda",
]

built_with_cuda: bool = _C.built_with_cuda

# RowStatus codes of csrc/include/tlt/common.h -> (argument, problem).
_ROW_PROBLEMS = {
    1: ("logits", "has NaN or +inf, or only -inf, at a node the walk visited"),
    2: ("tokens", "has a token id outside [0, V) at a valid node"),
    3: ("parents", "is not a topological tree (need parents[i] in [0, i) for valid nodes)"),
    4: ("draft_probs", "is negative, not finite, or does not sum to 1 (+-1e-3) at a visited node"),
    5: ("num_nodes", "is outside [1, N]"),
    6: ("uniforms", "has a value outside [0, 1) that the walk used"),
    7: ("cache_len", "with accept_index leaves the cache's [0, T) slots or is not a path"),
}


def _raise_row_status(row_status: torch.Tensor) -> None:
    bad = torch.nonzero(row_status).flatten()
    if bad.numel() == 0:
        return
    row = int(bad[0])
    argument, problem = _ROW_PROBLEMS.get(int(row_status[row]), ("input", "is invalid"))
    raise ValueError(f"{argument}: row {row} {problem} ({bad.numel()} bad row(s) in all)")


def _check_tree(tokens: torch.Tensor | None, parents: torch.Tensor,
                num_nodes: torch.Tensor | None, vocab: int | None) -> None:
    """Host-side tree checks: cheap (B x N) and with better messages than the row status."""
    batch, n_max = parents.shape
    index = torch.arange(n_max, device=parents.device)
    valid = torch.ones_like(parents, dtype=torch.bool)
    if num_nodes is not None:
        if bool(((num_nodes < 1) | (num_nodes > n_max)).any()):
            raise ValueError(f"num_nodes: every entry must be in [1, {n_max}]")
        valid = index[None, :] < num_nodes[:, None]
    if batch and bool((parents[:, 0] != -1).any()):
        raise ValueError("parents: the root's parent must be -1 (parents[:, 0] == -1)")
    bad = valid & (index[None, :] > 0) & ((parents < 0) | (parents >= index[None, :]))
    if bool(bad.any()):
        row, node = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(
            f"parents: node {node} of row {row} has parent {int(parents[row, node])}; "
            "nodes must be in topological order (0 <= parents[b, i] < i)"
        )
    if tokens is not None and vocab is not None:
        out_of_range = valid & (index[None, :] > 0) & ((tokens < 0) | (tokens >= vocab))
        if bool(out_of_range.any()):
            row, node = (int(v) for v in torch.nonzero(out_of_range)[0])
            raise ValueError(
                f"tokens: node {node} of row {row} is {int(tokens[row, node])}, outside [0, {vocab})"
            )


def _tree_inputs(tokens: Any, parents: Any, num_nodes: Any, device: torch.device,
                 batch: int | None = None):
    """(tokens int64 or None, parents int32, num_nodes int32 or None), checked and contiguous."""
    parents_t = arr.integer_tensor(parents, "parents", torch.int32, device, (batch, None))
    batch, n_max = parents_t.shape
    if not 1 <= n_max <= _C.max_tree_nodes:
        raise ValueError(f"parents: N = {n_max} nodes, must be in [1, {_C.max_tree_nodes}]")
    tokens_t = (None if tokens is None else
                arr.integer_tensor(tokens, "tokens", torch.int64, device, (batch, n_max)))
    num_nodes_t = (None if num_nodes is None else
                   arr.integer_tensor(num_nodes, "num_nodes", torch.int32, device, (batch,)))
    return tokens_t, parents_t, num_nodes_t


def _logits_input(logits: Any, name: str = "logits") -> torch.Tensor:
    logits_t = arr.as_tensor(logits, name)
    if logits_t.dim() != 3:
        raise ValueError(f"{name}: expected shape (B, N, V), got {tuple(logits_t.shape)}")
    arr.float_type_code(logits_t, name)
    arr.require_contiguous(logits_t, name)
    vocab = logits_t.shape[-1]
    if not 1 <= vocab <= _C.max_vocab:
        raise ValueError(f"{name}: V = {vocab} must be in [1, {_C.max_vocab}]")
    return logits_t


def _verify_inputs(logits: Any, tokens: Any, parents: Any, num_nodes: Any):
    """The tree and logits of a verifier, checked against each other."""
    logits_t = _logits_input(logits)
    batch, n_max, _ = logits_t.shape
    tokens_t, parents_t, num_nodes_t = _tree_inputs(tokens, parents, num_nodes, logits_t.device,
                                                    batch)
    if parents_t.shape[1] != n_max:
        raise ValueError(f"parents: has {parents_t.shape[1]} nodes but logits has N = {n_max}")
    return logits_t, tokens_t, parents_t, num_nodes_t


def select_tree(cand_tokens: Any, cand_scores: Any, cand_parents: Any, root_tokens: Any,
                num_nodes: int, *, validate: bool = True) -> DraftTree:
    """Keep the best `num_nodes - 1` draft candidates (plus the root) by cumulative draft
    log-prob: the EAGLE-2 dynamic tree.

    cand_tokens (B, M) int, cand_scores (B, M) float32 cumulative log q_draft of the path
    (-inf = invalid candidate), cand_parents (B, M) int (-1: child of the root, else an
    earlier candidate), root_tokens (B,) int. A path never scores above its prefix (scores are
    min-ed along the path), so the result is ancestor-closed; nodes come out by depth, siblings
    by score. Ragged rows (fewer valid candidates) are padded; see DraftTree.num_nodes.
    validate=False skips the host-side NaN and parent checks (and their host syncs) for
    candidates a trusted drafting loop built, and the kernel's row-status check (one more),
    leaving a bad row's output undefined.
    """
    kind = arr.array_kind(cand_scores)
    scores = arr.as_tensor(cand_scores, "cand_scores")
    if scores.dtype != torch.float32:
        raise TypeError(f"cand_scores: dtype must be float32, got {scores.dtype}")
    if scores.dim() != 2:
        raise ValueError(f"cand_scores: expected shape (B, M), got {tuple(scores.shape)}")
    if validate and bool(torch.isnan(scores).any()):
        raise ValueError("cand_scores: contains NaN (use -inf to mark invalid candidates)")
    scores = scores.contiguous()
    device = scores.device
    batch, num_candidates = scores.shape
    if num_candidates > _C.max_candidates:
        raise ValueError(f"cand_scores: M = {num_candidates} exceeds {_C.max_candidates}")
    if not isinstance(num_nodes, int) or not 1 <= num_nodes <= _C.max_tree_nodes:
        raise ValueError(f"num_nodes: must be an int in [1, {_C.max_tree_nodes}], got {num_nodes!r}")
    tokens = arr.integer_tensor(cand_tokens, "cand_tokens", torch.int64, device, (batch, num_candidates))
    parents = arr.integer_tensor(cand_parents, "cand_parents", torch.int32, device, (batch, num_candidates))
    roots = arr.integer_tensor(root_tokens, "root_tokens", torch.int64, device, (batch,))
    index = torch.arange(num_candidates, device=device)
    if validate and bool(((parents < -1) | (parents >= index[None, :])).any()):
        raise ValueError("cand_parents: each candidate's parent must be -1 or an earlier candidate")

    out_tokens = torch.empty((batch, num_nodes), dtype=torch.int64, device=device)
    out_parents = torch.empty((batch, num_nodes), dtype=torch.int32, device=device)
    source_index = torch.empty((batch, num_nodes), dtype=torch.int32, device=device)
    out_num_nodes = torch.empty((batch,), dtype=torch.int32, device=device)
    row_status = torch.empty((batch,), dtype=torch.int32, device=device)
    _C.select_tree(arr.ptr(tokens), arr.ptr(scores), arr.ptr(parents), arr.ptr(roots), batch,
                   num_candidates, num_nodes, arr.ptr(out_tokens), arr.ptr(out_parents),
                   arr.ptr(source_index), arr.ptr(out_num_nodes), arr.ptr(row_status),
                   *arr.launch_target(device))
    if validate:
        _raise_row_status(row_status)
    return DraftTree(*(arr.give_back(t, kind) for t in (out_tokens, out_parents, source_index, out_num_nodes)))


def tree_metadata(parents: Any, num_nodes: Any = None, cache_len: Any = None, *,
                  validate: bool = True) -> TreeMetadata:
    """Depths, positions (cache_len + depth) and the bit-packed ancestor mask of a tree.

    parents (B, N) int; num_nodes (B,) int or None (all N valid); cache_len (B,) int or None
    (0): committed tokens already in the cache, so the root sits at position cache_len.
    The mask is (B, N, ceil(N/32)) int32: node j is bit (j & 31) of word (j >> 5) of row i iff
    j is i or an ancestor of i. unpack_tree_mask turns it into a bool (B, N, N) mask.
    validate=False skips the host-side checks and the row-status check (host syncs) for a tree
    that select_tree or a drafting loop built; a bad row's output is then undefined.
    """
    kind = arr.array_kind(parents)
    parents_t = arr.as_tensor(parents, "parents")
    device = parents_t.device
    _, parents_t, num_nodes_t = _tree_inputs(None, parents_t, num_nodes, device)
    batch, n_max = parents_t.shape
    cache_len_t = (None if cache_len is None else
                   arr.integer_tensor(cache_len, "cache_len", torch.int32, device, (batch,)))
    if validate:
        if cache_len_t is not None and bool((cache_len_t < 0).any()):
            raise ValueError("cache_len: must be >= 0")
        _check_tree(None, parents_t, num_nodes_t, None)
    depths = torch.empty((batch, n_max), dtype=torch.int32, device=device)
    positions = torch.empty((batch, n_max), dtype=torch.int64, device=device)
    mask = torch.empty((batch, n_max, (n_max + 31) // 32), dtype=torch.int32, device=device)
    row_status = torch.empty((batch,), dtype=torch.int32, device=device)
    _C.tree_metadata(arr.ptr(parents_t), arr.ptr(num_nodes_t), arr.ptr(cache_len_t), batch, n_max,
                     arr.ptr(depths), arr.ptr(positions), arr.ptr(mask), arr.ptr(row_status),
                     *arr.launch_target(device))
    if validate:
        _raise_row_status(row_status)
    return TreeMetadata(*(arr.give_back(t, kind) for t in (depths, positions, mask)))


def unpack_tree_mask(mask: Any, num_nodes_max: int) -> Any:
    """(B, N, W) int32 bit-packed mask -> (B, N, N) bool, True where row i may attend to j."""
    kind = arr.array_kind(mask)
    mask_t = arr.as_tensor(mask, "mask")
    if mask_t.dim() != 3 or mask_t.shape[-1] != (num_nodes_max + 31) // 32:
        raise ValueError(f"mask: expected shape (B, N, {(num_nodes_max + 31) // 32}), got {tuple(mask_t.shape)}")
    j = torch.arange(num_nodes_max, device=mask_t.device)
    words = mask_t.to(torch.int64)[..., j // 32]  # (B, N, N)
    return arr.give_back(((words >> (j % 32)) & 1).bool(), kind)


def verify_tree_greedy(logits: Any, tokens: Any, parents: Any, num_nodes: Any = None, *,
                       validate: bool = True) -> VerifyOutput:
    """Greedy verification: the longest root path whose tokens equal the target's argmax, plus
    the argmax after it. Only the path's nodes are read.

    logits (B, N, V) float32/float16/bfloat16, contiguous: target logits at each node.
    tokens (B, N) int, parents (B, N) int, num_nodes (B,) int or None.
    emitted_logprobs are log_softmax(logits) at temperature 1 of the emitted tokens.
    validate=False skips the host-side checks and the row-status check (no host sync).
    """
    logits_t, tokens_t, parents_t, num_nodes_t = _verify_inputs(logits, tokens, parents, num_nodes)
    kind, device, (batch, n_max, vocab) = arr.array_kind(logits), logits_t.device, logits_t.shape
    if validate:
        _check_tree(tokens_t, parents_t, num_nodes_t, vocab)
    outputs = _verify_outputs(batch, n_max, device)
    _C.verify_tree_greedy(arr.ptr(logits_t), arr.float_type_code(logits_t, "logits"),
                          arr.ptr(tokens_t), arr.ptr(parents_t), arr.ptr(num_nodes_t), batch,
                          n_max, vocab, *(arr.ptr(t) for t in outputs), *arr.launch_target(device))
    return _finish_verify(outputs, kind, validate)


def verify_tree_sampling(logits: Any, tokens: Any, parents: Any, *, temperature: Any,
                         top_k: Any = 0, top_p: Any = 1.0, uniforms: Any = None,
                         seed: Any = None, offset: Any = 0, draft_probs: Any = None,
                         num_nodes: Any = None, validate: bool = True) -> VerifyOutput:
    """Lossless tree rejection sampling, fused with temperature / top-k / top-p.

    The emitted tokens are distributed exactly as sampling token by token from p_target, the
    target distribution after temperature, top-k (k <= 0: off) and top-p (1.0: off); rows with
    temperature 0 are greedy. Per-row parameters are numbers or (B,) arrays.

    Drafts: draft_probs=None means deterministic drafts (q_draft one-hot at each draft token,
    as EAGLE / SGLang top-k trees); draft_probs (B, N, V) float32 means the children of node v
    were sampled i.i.d. from q_draft = draft_probs[b, v].
    Randomness: uniforms (B, N) float32 in [0, 1) (u[:, c] tests node c, u[:, 0] draws the
    final token), or seed (int or (B,)) and offset (int or (B,)) for Philox uniforms that the
    CPU and CUDA kernels reproduce identically.
    emitted_logprobs are log p_target of each emitted token at the node that emitted it
    (temperature-0 rows: log_softmax at temperature 1).
    """
    logits_t, tokens_t, parents_t, num_nodes_t = _verify_inputs(logits, tokens, parents, num_nodes)
    kind, device, (batch, n_max, vocab) = arr.array_kind(logits), logits_t.device, logits_t.shape
    temperature_t = arr.per_row(temperature, "temperature", torch.float32, batch, device)
    top_k_t = arr.per_row(top_k, "top_k", torch.int32, batch, device)
    top_p_t = arr.per_row(top_p, "top_p", torch.float32, batch, device)
    if uniforms is None:
        if seed is None:
            raise ValueError("uniforms: pass uniforms (B, N) or a seed for Philox uniforms")
        uniforms_t = _philox(arr.per_row(seed, "seed", torch.int64, batch, device),
                             arr.per_row(offset, "offset", torch.int64, batch, device), n_max)
    else:
        if seed is not None:
            raise ValueError("seed: pass either uniforms or seed, not both")
        uniforms_t = arr.as_tensor(uniforms, "uniforms")
        arr.check_shape(uniforms_t, "uniforms", (batch, n_max))
        arr.check_device(uniforms_t, "uniforms", device)
        if uniforms_t.dtype != torch.float32:
            raise TypeError(f"uniforms: dtype must be float32, got {uniforms_t.dtype}")
        uniforms_t = uniforms_t.contiguous()
    draft_t = None
    if draft_probs is not None:
        draft_t = arr.as_tensor(draft_probs, "draft_probs")
        arr.check_shape(draft_t, "draft_probs", (batch, n_max, vocab))
        arr.check_device(draft_t, "draft_probs", device)
        if draft_t.dtype != torch.float32:
            raise TypeError(f"draft_probs: dtype must be float32, got {draft_t.dtype}")
        arr.require_contiguous(draft_t, "draft_probs")
    if validate:
        _check_tree(tokens_t, parents_t, num_nodes_t, vocab)
        if bool((~torch.isfinite(temperature_t) | (temperature_t < 0)).any()):
            raise ValueError("temperature: must be finite and >= 0 (0 = greedy)")
        if bool((~(top_p_t > 0) | (top_p_t > 1)).any()):
            raise ValueError("top_p: must be in (0, 1]")
        if bool(((uniforms_t < 0) | ~(uniforms_t < 1)).any()):
            raise ValueError("uniforms: every value must be in [0, 1)")
    workspace_bytes = _C.verify_tree_sampling_workspace_bytes(batch, vocab, draft_t is not None)
    workspace = (torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
                 if workspace_bytes and device.type == "cuda" else None)
    outputs = _verify_outputs(batch, n_max, device)
    _C.verify_tree_sampling(arr.ptr(logits_t), arr.float_type_code(logits_t, "logits"),
                            arr.ptr(draft_t), arr.ptr(tokens_t), arr.ptr(parents_t),
                            arr.ptr(num_nodes_t), arr.ptr(temperature_t), arr.ptr(top_k_t),
                            arr.ptr(top_p_t), arr.ptr(uniforms_t), batch, n_max, vocab,
                            *(arr.ptr(t) for t in outputs), arr.ptr(workspace),
                            *arr.launch_target(device))
    return _finish_verify(outputs, kind, validate)


def _verify_outputs(batch: int, n_max: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.empty((batch, n_max), dtype=torch.int32, device=device),  # accept_index
        torch.empty((batch,), dtype=torch.int32, device=device),  # num_accepted
        torch.empty((batch, n_max), dtype=torch.int64, device=device),  # emitted_tokens
        torch.empty((batch, n_max), dtype=torch.float32, device=device),  # emitted_logprobs
        torch.empty((batch,), dtype=torch.int32, device=device),  # row_status
    )


def _finish_verify(outputs: tuple[torch.Tensor, ...], kind: str, validate: bool) -> VerifyOutput:
    *results, row_status = outputs
    if validate:
        _raise_row_status(row_status)
    return VerifyOutput(*(arr.give_back(t, kind) for t in results))


def compact_kv_(cache: Any, accept_index: Any, num_accepted: Any, cache_len: Any, *,
                batch_dim: int = -4, seq_dim: int = -2, validate: bool = True) -> Any:
    """Move each row's accepted path to contiguous slots after its committed prefix, in place.

    cache: one contiguous tensor holding K and V (any dtype), with a batch dim and a sequence
    dim; the defaults fit the head-major layout (..., B, H_kv, T, head_dim), e.g. the engine's
    (layers, 2, B, H_kv, T, head_dim). For a token-major cache (..., B, T, H_kv * d) pass
    batch_dim=-3, seq_dim=-2. Node i of row b must have been written to slot cache_len[b] + i;
    afterwards slots cache_len[b] .. cache_len[b] + num_accepted[b] hold the accepted path.
    Returns cache.
    """
    cache_t = arr.as_tensor(cache, "cache")
    arr.require_contiguous(cache_t, "cache")
    ndim = cache_t.dim()
    b_dim, t_dim = batch_dim % ndim if ndim else 0, seq_dim % ndim if ndim else 0
    if ndim < 2 or not b_dim < t_dim:
        raise ValueError(f"batch_dim / seq_dim: need batch_dim before seq_dim in a cache of "
                         f"shape {tuple(cache_t.shape)}")
    shape = cache_t.shape
    planes, batch = math.prod(shape[:b_dim]), shape[b_dim]
    groups, max_len = math.prod(shape[b_dim + 1:t_dim]), shape[t_dim]
    entry_bytes = cache_t.element_size() * math.prod(shape[t_dim + 1:])
    device = cache_t.device
    accept_t = arr.integer_tensor(accept_index, "accept_index", torch.int32, device, (batch, None))
    n_max = accept_t.shape[1]
    num_accepted_t = arr.integer_tensor(num_accepted, "num_accepted", torch.int32, device, (batch,))
    cache_len_t = arr.integer_tensor(cache_len, "cache_len", torch.int32, device, (batch,))
    row_status = torch.empty((batch,), dtype=torch.int32, device=device)
    _C.compact_kv(arr.ptr(cache_t), planes, batch, groups, max_len, entry_bytes,
                  arr.ptr(cache_len_t), arr.ptr(accept_t), arr.ptr(num_accepted_t), n_max,
                  arr.ptr(row_status), *arr.launch_target(device))
    if validate:
        _raise_row_status(row_status)
    return cache


def philox_uniforms(seeds: Any, offsets: Any, count: int) -> Any:
    """(B, count) float32 uniforms in [0, 1): Philox4x32-10 of (offsets[b], i) under key
    seeds[b], 24 random bits each. Bit-identical on CPU and CUDA."""
    kind = arr.array_kind(seeds)
    seeds_t = arr.as_tensor(seeds, "seeds")
    if seeds_t.dim() != 1:
        raise ValueError(f"seeds: expected shape (B,), got {tuple(seeds_t.shape)}")
    device = seeds_t.device
    seeds_t = arr.integer_tensor(seeds_t, "seeds", torch.int64, device, (None,))
    offsets_t = arr.per_row(offsets, "offsets", torch.int64, seeds_t.shape[0], device)
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count: must be a non-negative int, got {count!r}")
    return arr.give_back(_philox(seeds_t, offsets_t, count), kind)


def _philox(seeds: torch.Tensor, offsets: torch.Tensor, count: int) -> torch.Tensor:
    uniforms = torch.empty((seeds.shape[0], count), dtype=torch.float32, device=seeds.device)
    _C.philox_uniforms(arr.ptr(seeds), arr.ptr(offsets), seeds.shape[0], count, arr.ptr(uniforms),
                       *arr.launch_target(seeds.device))
    return uniforms
