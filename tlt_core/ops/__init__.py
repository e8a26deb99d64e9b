"""tlt_core.ops: the fused tree speculative-decoding kernels, one function per kernel.

Every function accepts torch tensors (CPU or CUDA) or any DLPack array (NumPy, CuPy), returns
results of the same kind on the same device, and raises ValueError / TypeError naming the
offending argument. Semantics are those of the C++ headers in csrc/include/tlt/ and of the
pure-PyTorch oracle in tlt_core.ops.reference.

Notation: B rows, N tree nodes, V vocabulary, M draft candidates, W = ceil(N / 32).
p_target is the target's (temperature / top-k / top-p transformed) distribution, q_draft the
drafter's. A draft tree is tokens[B, N] and parents[B, N]: node 0 is the root (the last
committed token, not yet in the KV cache), parents[:, 0] = -1 and parents[b, i] < i.

validate: dtypes, shapes, devices and arguments given as Python numbers are always checked, as
that reads no tensor. validate=True also checks the values of arrays (trees, ranges, the
kernels' row status), which on a device is a host sync; validate=False skips those for inputs a
trusted loop built (the engine's), and a row with a bad value then gets an undefined, padded
output. Integers are never silently narrowed: an array value outside the int32 the kernel reads
raises with validate=True and saturates without it (tlt_core.ops._arrays), so it stays invalid.
Empty batches (B = 0) give empty outputs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tlt_core import _C
from tlt_core.ops import _arrays as arr
from tlt_core.ops._cpu_tensors import isa_code
from tlt_core.ops.records import DraftTree, TreeMetadata, VerifyOutput
from tlt_core.ops.attention import DecodeAttention, decode_attention
from tlt_core.ops.panel_matmul import pack_panels, panel_matmul
from tlt_core.ops.rms_norm import add_rms_norm
from tlt_core.ops.rope import RopeKVWriter, rope_kv_write
from tlt_core.ops.silu_mul import silu_mul
from tlt_core.ops.draft_sample import sample_draft
from tlt_core.ops.decoder_layers import DecoderLayers

__all__ = [
    "DraftTree", "TreeMetadata", "VerifyOutput", "select_tree", "tree_metadata",
    "unpack_tree_mask", "verify_tree_greedy", "verify_tree_sampling", "compact_kv_",
    "philox_uniforms", "rope_kv_write", "RopeKVWriter", "add_rms_norm", "pack_panels",
    "panel_matmul", "decode_attention", "DecodeAttention", "silu_mul", "sample_draft",
    "DecoderLayers",
    "built_with_cuda", "MIN_TEMPERATURE",
]

built_with_cuda: bool = _C.built_with_cuda

# The smallest positive temperature: below it l / T overflows float32 for ordinary logits, and
# the kernel would report the logits as bad when the temperature is what is wrong. Greedy is 0.
MIN_TEMPERATURE = 1e-6

# The most uniforms per row philox_uniforms makes in one call: far beyond what any tree uses, so
# a larger count is a mistake, reported as one rather than as a failed allocation.
_MAX_UNIFORMS_PER_ROW = (1 << 31) - 1

# RowStatus codes of csrc/include/tlt/common.h -> (argument, problem), worded per op in the
# names of that op's own arguments.
_TREE_PROBLEMS = {
    3: ("parents", "is not a topological tree (need parents[i] in [0, i) for valid nodes)"),
    5: ("num_nodes", "is outside [1, N]"),
}
_VERIFY_PROBLEMS = {
    **_TREE_PROBLEMS,
    1: ("logits", "has NaN or +inf, or only -inf, at a node the walk visited"),
    2: ("tokens", "has a token id outside [0, V) at a valid node"),
    4: ("draft_probs", "is negative, not finite, or does not sum to 1 (+-1e-3) at a visited node"),
    6: ("uniforms", "has a value outside [0, 1) that the walk used"),
}
_SELECT_PROBLEMS = {
    3: ("cand_parents", "has a candidate m whose parent is not in [-1, m)"),
}
_COMPACT_PROBLEMS = {
    7: ("accept_index", "with num_accepted and cache_len is not an increasing path "
                        "(accept_index[b, j] >= j) inside the cache's [0, T) slots"),
}


def _raise_row_status(row_status: torch.Tensor, problems: dict[int, tuple[str, str]]) -> None:
    bad = torch.nonzero(row_status).flatten()
    if bad.numel() == 0:
        return
    row, code = int(bad[0]), int(row_status[int(bad[0])])
    if code not in problems:  # a kernel wrote a code its header does not list for it
        raise RuntimeError(f"kernel reported row status {code} for row {row}")
    argument, problem = problems[code]
    raise ValueError(f"{argument}: row {row} {problem} ({bad.numel()} bad row(s) in all)")


def _check_tree(tokens: torch.Tensor | None, parents: torch.Tensor,
                num_nodes: torch.Tensor | None, vocab: int | None) -> None:
    """Host-side tree checks: cheap (B x N) and with better messages than the row status.
    num_nodes is already in [1, N] (_tree_inputs)."""
    batch, n_max = parents.shape
    index = torch.arange(n_max, device=parents.device)
    valid = torch.ones_like(parents, dtype=torch.bool)
    if num_nodes is not None:
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
                 batch: int | None, validate: bool):
    """(tokens int64 or None, parents int32, num_nodes int32 or None), checked and contiguous."""
    parents_t = arr.integer_tensor(parents, "parents", torch.int32, device, (batch, None),
                                   validate=validate)
    batch, n_max = parents_t.shape
    if not 1 <= n_max <= _C.max_tree_nodes:
        raise ValueError(f"parents: N = {n_max} nodes, must be in [1, {_C.max_tree_nodes}]")
    tokens_t = (None if tokens is None else
                arr.integer_tensor(tokens, "tokens", torch.int64, device, (batch, n_max),
                                   validate=validate))
    num_nodes_t = (None if num_nodes is None else
                   arr.integer_tensor(num_nodes, "num_nodes", torch.int32, device, (batch,),
                                      validate=validate, low=1, high=n_max))
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


def _verify_inputs(logits: Any, tokens: Any, parents: Any, num_nodes: Any, validate: bool):
    """The tree and logits of a verifier, checked against each other."""
    logits_t = _logits_input(logits)
    batch, n_max, _ = logits_t.shape
    tokens_t, parents_t, num_nodes_t = _tree_inputs(tokens, parents, num_nodes, logits_t.device,
                                                    batch, validate)
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
    num_nodes = arr.python_int(num_nodes, "num_nodes", 1, _C.max_tree_nodes)
    tokens = arr.integer_tensor(cand_tokens, "cand_tokens", torch.int64, device,
                                (batch, num_candidates), validate=validate)
    parents = arr.integer_tensor(cand_parents, "cand_parents", torch.int32, device,
                                 (batch, num_candidates), validate=validate, low=-1)
    roots = arr.integer_tensor(root_tokens, "root_tokens", torch.int64, device, (batch,),
                               validate=validate)
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
        _raise_row_status(row_status, _SELECT_PROBLEMS)
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
    _, parents_t, num_nodes_t = _tree_inputs(None, parents_t, num_nodes, device, None, validate)
    batch, n_max = parents_t.shape
    cache_len_t = (None if cache_len is None else
                   arr.integer_tensor(cache_len, "cache_len", torch.int32, device, (batch,),
                                      validate=validate, low=0))
    if validate:
        _check_tree(None, parents_t, num_nodes_t, None)
    depths = torch.empty((batch, n_max), dtype=torch.int32, device=device)
    positions = torch.empty((batch, n_max), dtype=torch.int64, device=device)
    mask = torch.empty((batch, n_max, (n_max + 31) // 32), dtype=torch.int32, device=device)
    row_status = torch.empty((batch,), dtype=torch.int32, device=device)
    _C.tree_metadata(arr.ptr(parents_t), arr.ptr(num_nodes_t), arr.ptr(cache_len_t), batch, n_max,
                     arr.ptr(depths), arr.ptr(positions), arr.ptr(mask), arr.ptr(row_status),
                     *arr.launch_target(device))
    if validate:
        _raise_row_status(row_status, _TREE_PROBLEMS)
    return TreeMetadata(*(arr.give_back(t, kind) for t in (depths, positions, mask)))


def unpack_tree_mask(mask: Any, num_nodes_max: int) -> Any:
    """(B, N, W) int32 (or uint32) bit-packed mask of N = num_nodes_max nodes -> (B, N, N)
    bool, True where row i may attend to j. Reads no values: every bit pattern is a mask."""
    kind = arr.array_kind(mask)
    mask_t = arr.as_tensor(mask, "mask")
    if mask_t.dtype not in (torch.int32, torch.uint32):
        raise TypeError(f"mask: dtype must be int32 (or uint32), got {mask_t.dtype}")
    num_nodes_max = arr.python_int(num_nodes_max, "num_nodes_max", 1, _C.max_tree_nodes)
    arr.check_shape(mask_t, "mask", (None, num_nodes_max, (num_nodes_max + 31) // 32))
    j = torch.arange(num_nodes_max, device=mask_t.device)
    words = mask_t.to(torch.int64)[..., j // 32]  # (B, N, N)
    return arr.give_back(((words >> (j % 32)) & 1).bool(), kind)


def verify_tree_greedy(logits: Any, tokens: Any, parents: Any, num_nodes: Any = None, *,
                       validate: bool = True, isa: str = "auto") -> VerifyOutput:
    """Greedy verification: the longest root path whose tokens equal the target's argmax, plus
    the argmax after it. Only the path's nodes are read.

    logits (B, N, V) float32/float16/bfloat16, contiguous: target logits at each node.
    tokens (B, N) int, parents (B, N) int, num_nodes (B,) int or None.
    emitted_logprobs are log_softmax(logits) at temperature 1 of the emitted tokens.
    validate=False skips the host-side checks and the row-status check (no host sync).
    isa: as verify_tree_sampling's.
    """
    logits_t, tokens_t, parents_t, num_nodes_t = _verify_inputs(logits, tokens, parents,
                                                                num_nodes, validate)
    kind, device, (batch, n_max, vocab) = arr.array_kind(logits), logits_t.device, logits_t.shape
    isa_code = _isa_code(isa, device)
    if validate:
        _check_tree(tokens_t, parents_t, num_nodes_t, vocab)
    outputs = _verify_outputs(batch, n_max, device)
    _C.verify_tree_greedy(arr.ptr(logits_t), arr.float_type_code(logits_t, "logits"),
                          arr.ptr(tokens_t), arr.ptr(parents_t), arr.ptr(num_nodes_t), batch,
                          n_max, vocab, *(arr.ptr(t) for t in outputs), *arr.launch_target(device),
                          isa_code)
    return _finish_verify(outputs, kind, validate)


def verify_tree_sampling(logits: Any, tokens: Any, parents: Any, *, temperature: Any,
                         top_k: Any = 0, top_p: Any = 1.0, uniforms: Any = None,
                         seed: Any = None, offset: Any = None, draft_probs: Any = None,
                         num_nodes: Any = None, validate: bool = True,
                         isa: str = "auto") -> VerifyOutput:
    """Lossless tree rejection sampling, fused with temperature / top-k / top-p.

    The emitted tokens are distributed exactly as sampling token by token from p_target, the
    target distribution after temperature, top-k (k <= 0 or k >= V: off) and top-p (1.0: off).
    Per-row parameters are numbers or (B,) arrays, read as float32 / int32 / float32:
    temperature is 0 (a greedy row) or in [MIN_TEMPERATURE, float32 max], top_p in (0, 1],
    top_k any integer.

    Drafts: draft_probs=None means deterministic drafts (q_draft one-hot at each draft token,
    as EAGLE / SGLang top-k trees); draft_probs (B, N, V) float32 means the children of node v
    were sampled i.i.d. from q_draft = draft_probs[b, v].
    Randomness: uniforms (B, N) float32 in [0, 1) (u[:, c] tests node c, u[:, 0] draws the
    final token), or seed (int or (B,)) and offset (int or (B,), default 0) for Philox
    uniforms that the CPU and CUDA kernels reproduce identically (philox_uniforms).
    emitted_logprobs are log p_target of each emitted token at the node that emitted it
    (temperature-0 rows: log_softmax at temperature 1).
    validate=False skips the checks of array values (tree, parameters, uniforms, row status);
    parameters given as numbers are checked either way.
    isa (CPU): "auto" runs the passes over V on AVX2 where the CPU has it (exp within 2 ulps,
    float64 sums in eight parts), "portable" the scalar loops (std::exp, sums in index order);
    their tokens agree but where a uniform lies within that rounding of a threshold. A GPU
    runs its one kernel: "auto" only.
    """
    logits_t, tokens_t, parents_t, num_nodes_t = _verify_inputs(logits, tokens, parents,
                                                                num_nodes, validate)
    kind, device, (batch, n_max, vocab) = arr.array_kind(logits), logits_t.device, logits_t.shape
    isa_code = _isa_code(isa, device)
    temperature_t = _per_row_checked(temperature, "temperature", batch, device, validate,
                                     _bad_temperature, "must be 0 (greedy) or, as float32, "
                                     f"finite and >= MIN_TEMPERATURE = {MIN_TEMPERATURE}")
    # Clamping top_k into int32 keeps its meaning: every k <= 0 and every k >= V is "off".
    top_k_t = arr.per_row_integer(top_k, "top_k", torch.int32, batch, device, validate=validate,
                                  saturate=True)
    top_p_t = _per_row_checked(top_p, "top_p", batch, device, validate, _bad_top_p,
                               "must be in (0, 1] as float32")
    if uniforms is None:
        if seed is None:
            raise ValueError("uniforms: pass uniforms (B, N) or a seed for Philox uniforms")
        uniforms_t = _philox(arr.per_row_bits64(seed, "seed", batch, device),
                             arr.per_row_bits64(0 if offset is None else offset, "offset", batch,
                                                device), n_max)
    else:
        if seed is not None:
            raise ValueError("seed: pass either uniforms or seed, not both")
        if offset is not None:
            raise ValueError("offset: is the Philox offset of seed; it has no use with uniforms")
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
        if bool(((uniforms_t < 0) | ~(uniforms_t < 1)).any()):
            raise ValueError("uniforms: every value must be in [0, 1)")
    outputs = _verify_outputs(batch, n_max, device)
    if batch == 0:  # the kernel takes no empty per-row arrays (their data pointers are null)
        return _finish_verify(outputs, kind, validate=False)
    workspace_bytes = _C.verify_tree_sampling_workspace_bytes(batch, vocab)
    workspace = (torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
                 if workspace_bytes and device.type == "cuda" else None)
    _C.verify_tree_sampling(arr.ptr(logits_t), arr.float_type_code(logits_t, "logits"),
                            arr.ptr(draft_t), arr.ptr(tokens_t), arr.ptr(parents_t),
                            arr.ptr(num_nodes_t), arr.ptr(temperature_t), arr.ptr(top_k_t),
                            arr.ptr(top_p_t), arr.ptr(uniforms_t), batch, n_max, vocab,
                            *(arr.ptr(t) for t in outputs), arr.ptr(workspace),
                            *arr.launch_target(device), isa_code)
    return _finish_verify(outputs, kind, validate)


def _isa_code(isa: Any, device: torch.device) -> int:
    """The CPU verifier's isa argument (verify.h); a GPU runs its one kernel."""
    code = isa_code(isa)
    if code and device.type != "cpu":
        raise ValueError(f"isa: {isa!r} picks a CPU path; on {device.type} pass \"auto\"")
    return code


def _bad_temperature(given: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """A temperature is 0, or positive and at least MIN_TEMPERATURE after float32 rounding
    (compared in float32, as the kernel reads it); a positive one that rounds to 0 is bad."""
    greedy = (given == 0) & (rounded == 0)
    return ~(greedy | (torch.isfinite(rounded) & (rounded >= MIN_TEMPERATURE)))


def _bad_top_p(given: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return ~((rounded > 0) & (rounded <= 1))


def _per_row_checked(value: Any, name: str, batch: int, device: torch.device, validate: bool,
                     bad_values, rule: str) -> torch.Tensor:
    """A per-row real parameter as float32 (B,), its values checked by bad_values(given,
    float32): always when given as a number (on the host, no sync), with validate for arrays."""
    rounded, given = arr.per_row_real(value, name, batch, device)
    if isinstance(given, float):
        given_t = torch.tensor([given], dtype=torch.float64)
        bad = bad_values(given_t, given_t.to(torch.float32))
        if bool(bad.any()):
            raise ValueError(f"{name}: {rule}, got {given!r}")
    elif validate and batch:
        bad = bad_values(given, rounded)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(f"{name}: {rule}, got {float(given[row])!r} in row {row}")
    return rounded


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
        _raise_row_status(row_status, _VERIFY_PROBLEMS)
    return VerifyOutput(*(arr.give_back(t, kind) for t in results))


def compact_kv_(cache: Any, accept_index: Any, num_accepted: Any, cache_len: Any, *,
                batch_dim: int = -4, seq_dim: int = -2, validate: bool = True) -> Any:
    """Move each row's accepted path to contiguous slots after its committed prefix, in place.

    cache: one contiguous tensor holding K and V (any dtype), with a batch dim and a sequence
    dim; the defaults fit the head-major layout (..., B, H_kv, T, head_dim), e.g. the engine's
    (layers, 2, B, H_kv, T, head_dim). For a token-major cache (..., B, T, H_kv * d) pass
    batch_dim=-3, seq_dim=-2. Node i of row b must have been written to slot cache_len[b] + i;
    afterwards slots cache_len[b] .. cache_len[b] + num_accepted[b] hold the accepted path.
    accept_index (B, N) and num_accepted (B,) are a verifier's outputs, cache_len (B,) the
    committed lengths. validate=True checks every row before anything moves; validate=False
    leaves a bad row untouched (kv_cache.h) without saying so. Returns cache.
    """
    cache_t = arr.as_tensor(cache, "cache")
    arr.require_contiguous(cache_t, "cache")
    ndim = cache_t.dim()
    if ndim < 2:
        raise ValueError(f"cache: needs a batch dim and a sequence dim, got shape "
                         f"{tuple(cache_t.shape)}")
    b_dim = arr.python_int(batch_dim, "batch_dim", -ndim, ndim - 1) % ndim
    t_dim = arr.python_int(seq_dim, "seq_dim", -ndim, ndim - 1) % ndim
    if not b_dim < t_dim:
        raise ValueError(f"batch_dim: must come before seq_dim in a cache of shape "
                         f"{tuple(cache_t.shape)}")
    shape = cache_t.shape
    planes, batch = math.prod(shape[:b_dim]), shape[b_dim]
    groups, max_len = math.prod(shape[b_dim + 1:t_dim]), shape[t_dim]
    entry_bytes = cache_t.element_size() * math.prod(shape[t_dim + 1:])
    if entry_bytes == 0:
        raise ValueError(f"cache: a token's entry is empty (shape {tuple(shape)} after seq_dim)")
    device = cache_t.device
    accept_t = arr.integer_tensor(accept_index, "accept_index", torch.int32, device, (batch, None),
                                  validate=validate)
    n_max = accept_t.shape[1]
    if not 1 <= n_max <= _C.max_tree_nodes:
        raise ValueError(f"accept_index: N = {n_max} nodes, must be in [1, {_C.max_tree_nodes}]")
    num_accepted_t = arr.integer_tensor(num_accepted, "num_accepted", torch.int32, device,
                                        (batch,), validate=validate, low=0, high=n_max - 1)
    cache_len_t = arr.integer_tensor(cache_len, "cache_len", torch.int32, device, (batch,),
                                     validate=validate, low=0)
    if validate and batch:
        _check_paths(accept_t, num_accepted_t, cache_len_t, max_len)
    row_status = torch.empty((batch,), dtype=torch.int32, device=device)
    _C.compact_kv(arr.ptr(cache_t), planes, batch, groups, max_len, entry_bytes,
                  arr.ptr(cache_len_t), arr.ptr(accept_t), arr.ptr(num_accepted_t), n_max,
                  arr.ptr(row_status), *arr.launch_target(device))
    if validate:
        _raise_row_status(row_status, _COMPACT_PROBLEMS)
    return cache


def _check_paths(accept_index: torch.Tensor, num_accepted: torch.Tensor,
                 cache_len: torch.Tensor, max_len: int) -> None:
    """kv_cache.h's row checks on the host, before the kernel moves anything, each naming the
    argument at fault. num_accepted is in [0, N) and cache_len >= 0 already. (Destinations
    cache_len + j lie below the sources cache_len + accept_index[b, j], so checking the
    sources covers both.)"""
    n_max = accept_index.shape[1]
    j = torch.arange(n_max, device=accept_index.device)
    on_path = j[None, :] <= num_accepted[:, None]  # (B, N)
    path = accept_index.to(torch.int64)  # (B, N)
    previous = torch.cat((torch.full_like(path[:, :1], -1), path[:, :-1]), dim=1)  # (B, N)
    not_path = on_path & ((path < j[None, :]) | (path <= previous))
    if bool(not_path.any()):
        row, node = (int(v) for v in torch.nonzero(not_path)[0])
        raise ValueError(
            f"accept_index: row {row} is not an accepted path: accept_index[{row}, {node}] = "
            f"{int(path[row, node])} (need accept_index[b, j] >= j, increasing, for j <= "
            "num_accepted[b])")
    # The tree's slots start at cache_len: a path past the cache's end means the cache had no
    # room for the tree there.
    source = cache_len.to(torch.int64)[:, None] + path  # (B, N)
    beyond = on_path & (source >= max_len)
    if bool(beyond.any()):
        row, node = (int(v) for v in torch.nonzero(beyond)[0])
        raise ValueError(f"cache_len: row {row}'s accepted node {int(path[row, node])} sits at "
                         f"slot cache_len + {int(path[row, node])} = {int(source[row, node])}, "
                         f"outside the cache's T = {max_len} slots")


def philox_uniforms(seeds: Any, offsets: Any, count: int) -> Any:
    """(B, count) float32 uniforms in [0, 1): Philox4x32-10 of (offsets[b], i) under key
    seeds[b], 24 random bits each. Bit-identical on CPU and CUDA. seeds (B,) and offsets (int
    or (B,)) are 64-bit patterns (random.h reads them as uint64): any integer dtype, signed
    values sign-extended, and ints in [-2**63, 2**64). count in [0, 2**31 - 1]."""
    kind = arr.array_kind(seeds)
    seeds_t = arr.as_tensor(seeds, "seeds")
    device = seeds_t.device
    seeds_t = arr.bits64_tensor(seeds_t, "seeds", device, (None,))
    offsets_t = arr.per_row_bits64(offsets, "offsets", seeds_t.shape[0], device)
    count = arr.python_int(count, "count", 0, _MAX_UNIFORMS_PER_ROW)
    return arr.give_back(_philox(seeds_t, offsets_t, count), kind)


def _philox(seeds: torch.Tensor, offsets: torch.Tensor, count: int) -> torch.Tensor:
    uniforms = torch.empty((seeds.shape[0], count), dtype=torch.float32, device=seeds.device)
    _C.philox_uniforms(arr.ptr(seeds), arr.ptr(offsets), seeds.shape[0], count, arr.ptr(uniforms),
                       *arr.launch_target(seeds.device))
    return uniforms
