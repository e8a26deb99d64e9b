"""pure-PyTorch reference of every tlt_core op; slow, obviously correct, the oracle in tests.

The contract is the text of the C++ headers in csrc/include/tlt/ (common.h, tree.h, verify.h,
kv_cache.h, random.h, rope.h, rms_norm.h, panel_matmul.h); every function here follows that
text literally and cites it. Tensors are CPU tensors; loops over rows and tree nodes are plain
Python.

Notation:
    B  rows (batch)               N  tree nodes per row (node 0 = root)
    V  vocabulary size            M  draft candidates per row (select_tree)
    W  words of the packed mask, W = ceil(N / 32)
    P, G, T  planes, groups and token slots of a KV cache viewed as [P, B, G, T, ...]
    p_target  the processed target distribution p_v = w / S at a tree node v (verify.h)
    q_draft   the draft distribution draft_probs[b, v, :] that v's children were sampled from

Float conventions (the headers fix no summation order and no expf implementation):
    * a sum of float32 values is accumulated in float64 and rounded once to float32
      (the float32 nearest the exact sum, up to double rounding);
    * expf(x) / logf(x) are evaluated in float64 and rounded once to float32;
    * every other operation the header writes (l / T, z - m, u * S, u * q(x) * S, S - w(x),
      top_p * Z, w - q * S, ...) is one IEEE float32 operation, in the header's order.
    Integer outputs of a kernel can therefore differ from this reference only where a value
    lies within float rounding of a decision threshold, which verify.h allows.

Invalid inputs: where a kernel reports a per-row status (common.h RowStatus), the reference
raises ValueError instead -- it is the oracle for valid inputs. The exception is compact_kv_,
whose header defines the state of a bad row (left untouched), so it returns row_status.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from tlt_core.ops import MIN_TEMPERATURE

__all__ = [
    "K_MAX_TREE_NODES",
    "K_MAX_CANDIDATES",
    "K_MAX_VOCAB",
    "ROW_OK",
    "ROW_BAD_CACHE_RANGE",
    "VerifyOutput",
    "mask_words",
    "select_tree",
    "tree_metadata",
    "tree_attention_mask",
    "unpack_tree_mask",
    "processed_target_probs",
    "processed_logprobs",
    "verify_tree_greedy",
    "verify_tree_sampling",
    "default_residual",
    "compact_kv_",
    "compact_kv",
    "philox4x32_10",
    "philox_uniforms",
    "rope_kv_write",
    "add_rms_norm",
    "panel_matmul",
]

# common.h limits (checked on the host by the kernels).
K_MAX_TREE_NODES = 1024  # N
K_MAX_CANDIDATES = 4096  # M
K_MAX_VOCAB = 1 << 24  # V

# common.h RowStatus codes used here.
ROW_OK = 0
ROW_BAD_CACHE_RANGE = 7

Number = Union[int, float]
ParamLike = Union[Number, torch.Tensor]


class VerifyOutput(NamedTuple):
    """Outputs shared by both verifiers (verify.h), padding after the valid entries."""

    accept_index: torch.Tensor  # [B, N] int32, root 0 first, then accepted nodes; -1 after
    num_accepted: torch.Tensor  # [B] int32, accepted draft nodes (path length - 1)
    emitted_tokens: torch.Tensor  # [B, N] int64, accepted drafts then the final token; -1 after
    emitted_logprobs: torch.Tensor  # [B, N] float32, log p of each emitted token; 0 after


# ---------------------------------------------------------------------------------------
# small helpers


def mask_words(num_nodes: int) -> int:
    """common.h mask_words: words of the bit-packed ancestor mask per node."""
    return (num_nodes + 31) // 32


def _sum32(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum of float32 values: accumulated in float64, rounded once to float32."""
    return x.double().sum(dim).float()


def _exp32(x: torch.Tensor) -> torch.Tensor:
    """expf of float32 values: float64 exp rounded once to float32."""
    return x.double().exp().float()


def _log32(x: torch.Tensor) -> torch.Tensor:
    """logf of float32 values: float64 log rounded once to float32."""
    return x.double().log().float()


def _argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, lowest index on ties (torch documents first occurrence)."""
    return x.argmax(dim=-1)  # [...] int64


def _to_int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bit pattern (two's-complement wrap)."""
    if bool(((words < 0) | (words >= (1 << 32))).any()):
        raise ValueError("mask word out of 32-bit range")
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def _row_param(x: Optional[ParamLike], batch: int, dtype: torch.dtype, name: str,
               default: Optional[Number] = None) -> torch.Tensor:
    """A per-row parameter: scalar or [B] tensor -> [B] tensor of dtype."""
    if x is None:
        if default is None:
            raise ValueError(f"{name} is required")
        x = default
    t = torch.as_tensor(x)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape [{batch}], got {tuple(t.shape)}")
    return t.to(dtype)


def _expand_param(x: ParamLike, lead: torch.Size, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A distribution parameter for logits [..., V]: a scalar, or a tensor whose shape is a
    prefix of the leading dims (left-aligned: [B] for [B, L, V] logits means one value per
    row), expanded to the leading dims."""
    t = torch.as_tensor(x)
    if t.dim() > len(lead) or tuple(t.shape) != tuple(lead[: t.dim()]):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is not a prefix of the leading dims {tuple(lead)}")
    t = t.reshape(tuple(t.shape) + (1,) * (len(lead) - t.dim()))
    return t.expand(lead).to(dtype)


def _check_logits(l: torch.Tensor, what: str) -> None:
    """kRowBadLogits: a logit is NaN or +inf, or all logits of a node are -inf."""
    if bool(torch.isnan(l).any()) or bool(torch.isposinf(l).any()):
        raise ValueError(f"{what}: NaN or +inf logit")
    if bool(torch.isneginf(l).all(dim=-1).any()):
        raise ValueError(f"{what}: all logits are -inf")


def _check_tree(tokens: Optional[torch.Tensor], parents: torch.Tensor,
                num_nodes: Optional[torch.Tensor], vocab: Optional[int]) -> torch.Tensor:
    """tree.h / common.h validity of a tree; returns num_nodes as a [B] int64 tensor.

    num_nodes[b] in [1, N] (kRowBadNumNodes); for every valid node i >= 1,
    0 <= parents[b, i] < i (kRowBadParent); every valid non-root node's token in [0, V)
    (kRowBadToken). parents[b, 0] and tokens[b, 0] are never read (the root's parent is -1
    by definition, and its token is already committed).
    """
    if parents.dim() != 2:
        raise ValueError(f"parents must be [B, N], got {tuple(parents.shape)}")
    B, N = parents.shape
    if not 1 <= N <= K_MAX_TREE_NODES:
        raise ValueError(f"N = {N} outside [1, {K_MAX_TREE_NODES}]")
    if num_nodes is None:
        n = torch.full((B,), N, dtype=torch.int64)  # [B]
    else:
        n = torch.as_tensor(num_nodes).to(torch.int64)  # [B]
        if n.shape != (B,):
            raise ValueError(f"num_nodes must be [{B}], got {tuple(n.shape)}")
    for b in range(B):
        nb = int(n[b])
        if not 1 <= nb <= N:
            raise ValueError(f"row {b}: num_nodes {nb} outside [1, {N}]")
        for i in range(1, nb):
            p = int(parents[b, i])
            if not 0 <= p < i:
                raise ValueError(f"row {b}: parent {p} of node {i} not in [0, {i})")
        if tokens is not None:
            for i in range(1, nb):
                x = int(tokens[b, i])
                if not 0 <= x < vocab:
                    raise ValueError(f"row {b}: token {x} of node {i} not in [0, {vocab})")
    return n


def _children(parents_row: torch.Tensor, n: int, v: int) -> list:
    """children(v): the valid nodes c with parents[c] == v, in increasing index order."""
    return [c for c in range(1, n) if int(parents_row[c]) == v]


# ---------------------------------------------------------------------------------------
# tree.h: select_tree


def select_tree(cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                cand_parents: torch.Tensor, root_tokens: torch.Tensor, num_nodes: int
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the best N-1 draft candidates (plus the root) by cumulative score (tree.h).

    cand_tokens [B, M] int64, cand_scores [B, M] float32 (-inf: invalid), cand_parents [B, M]
    int32 (-1: child of the root, else a candidate index < m), root_tokens [B] int64,
    num_nodes = N. eff[m] = min(score[m], eff[parent[m]]) (eff of the root = +inf); rank by
    (eff desc, m asc); keep the best min(N-1, #{eff > -inf}); output root, then kept
    candidates by (depth asc, eff desc, m asc).
    A NaN score is treated as -inf (never selected, and neither is any descendant).

    Returns tokens [B, N] int64 (padding 0), parents [B, N] int32 (root and padding -1),
    source_index [B, N] int32 (root and padding -1), num_nodes [B] int32.
    Raises ValueError where the kernel reports kRowBadParent.
    """
    N = int(num_nodes)
    if not 1 <= N <= K_MAX_TREE_NODES:
        raise ValueError(f"num_nodes = {N} outside [1, {K_MAX_TREE_NODES}]")
    if cand_tokens.dim() != 2:
        raise ValueError(f"cand_tokens must be [B, M], got {tuple(cand_tokens.shape)}")
    B, M = cand_tokens.shape
    if cand_scores.shape != (B, M) or cand_parents.shape != (B, M):
        raise ValueError("cand_tokens, cand_scores and cand_parents must all be [B, M]")
    if root_tokens.shape != (B,):
        raise ValueError(f"root_tokens must be [{B}]")
    if M > K_MAX_CANDIDATES:
        raise ValueError(f"M = {M} > {K_MAX_CANDIDATES}")
    scores = cand_scores.to(torch.float32)  # [B, M]

    tokens = torch.zeros(B, N, dtype=torch.int64)  # [B, N]
    parents = torch.full((B, N), -1, dtype=torch.int32)  # [B, N]
    source_index = torch.full((B, N), -1, dtype=torch.int32)  # [B, N]
    out_num_nodes = torch.ones(B, dtype=torch.int32)  # [B]

    for b in range(B):
        eff = [0.0] * M
        depth = [0] * M
        par = [-1] * M
        for m in range(M):
            p = int(cand_parents[b, m])
            if not -1 <= p < m:
                raise ValueError(f"row {b}: candidate {m} has parent {p} not in [-1, {m})")
            s = float(scores[b, m])  # float32 values are exact Python floats
            if math.isnan(s):
                s = -math.inf
            par[m] = p
            eff[m] = s if p == -1 else min(s, eff[p])
            depth[m] = 1 if p == -1 else depth[p] + 1
        finite = [m for m in range(M) if eff[m] > -math.inf]
        ranked = sorted(finite, key=lambda m: (-eff[m], m))
        kept = ranked[: N - 1]
        order = sorted(kept, key=lambda m: (depth[m], -eff[m], m))
        node_of = {m: i + 1 for i, m in enumerate(order)}

        tokens[b, 0] = int(root_tokens[b])
        for i, m in enumerate(order, start=1):
            p = par[m]
            if p != -1 and p not in node_of:  # cannot happen: a parent outranks its child
                raise AssertionError("selection is not ancestor-closed")
            tokens[b, i] = int(cand_tokens[b, m])
            parents[b, i] = 0 if p == -1 else node_of[p]
            source_index[b, i] = m
        out_num_nodes[b] = 1 + len(order)
    return tokens, parents, source_index, out_num_nodes


# ---------------------------------------------------------------------------------------
# tree.h: tree_metadata and the ancestor mask


def tree_attention_mask(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """Unpacked ancestor relation: out[b, i, j] iff node j is node i or an ancestor of it;
    a padding node (i >= num_nodes[b]) sees only itself. Returns bool [B, N, N]."""
    n = _check_tree(None, parents, num_nodes, None)  # [B]
    B, N = parents.shape
    out = torch.zeros(B, N, N, dtype=torch.bool)  # [B, N, N]
    for b in range(B):
        for i in range(N):
            out[b, i, i] = True
            if i < int(n[b]):
                j = i
                while j != 0:
                    j = int(parents[b, j])
                    out[b, i, j] = True
    return out


def unpack_tree_mask(mask: torch.Tensor, num_nodes_max: int) -> torch.Tensor:
    """mask [B, N, W] int32 (bit (j & 31) of word (j >> 5)) -> bool [B, N, N]."""
    N = int(num_nodes_max)
    if mask.dim() != 3 or mask.shape[1:] != (N, mask_words(N)):
        raise ValueError(f"mask must be [B, {N}, {mask_words(N)}], got {tuple(mask.shape)}")
    words = mask.to(torch.int64) & 0xFFFFFFFF  # [B, N, W] the unsigned 32-bit pattern
    j = torch.arange(N)  # [N]
    bits = (words[:, :, j >> 5] >> (j & 31)) & 1  # [B, N, N]
    return bits.bool()


def _pack_tree_mask(rel: torch.Tensor) -> torch.Tensor:
    """bool [B, N, N] -> int32 [B, N, W], node j is bit (j & 31) of word (j >> 5)."""
    B, N, _ = rel.shape
    W = mask_words(N)
    padded = torch.zeros(B, N, W * 32, dtype=torch.int64)  # [B, N, 32W]
    padded[:, :, :N] = rel.to(torch.int64)
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)  # [32]
    words = (padded.view(B, N, W, 32) * weights).sum(-1)  # [B, N, W] in [0, 2^32)
    return _to_int32_bits(words)  # [B, N, W]


def tree_metadata(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None,
                  cache_len: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depths, positions and bit-packed ancestor mask of a tree (tree.h).

    parents [B, N] int32; num_nodes [B] int32 (None: all N); cache_len [B] int32 (None: 0),
    a length: in [0, 2^31).
    Returns depths [B, N] int32 (root 0, padding 0), positions [B, N] int64
    (cache_len + depth; cache_len for padding), mask [B, N, W] int32.
    Raises ValueError where the kernel reports kRowBadNumNodes / kRowBadParent.
    """
    n = _check_tree(None, parents, num_nodes, None)  # [B]
    B, N = parents.shape
    if cache_len is None:
        L = torch.zeros(B, dtype=torch.int64)  # [B]
    else:
        L = torch.as_tensor(cache_len).to(torch.int64)  # [B]
        if L.shape != (B,):
            raise ValueError(f"cache_len must be [{B}]")
        if bool(((L < 0) | (L >= 1 << 31)).any()):
            raise ValueError("cache_len must be in [0, 2^31)")
    depths = torch.zeros(B, N, dtype=torch.int32)  # [B, N]
    for b in range(B):
        for i in range(1, int(n[b])):
            depths[b, i] = depths[b, int(parents[b, i])] + 1
    positions = L.unsqueeze(1) + depths.to(torch.int64)  # [B, N]
    mask = _pack_tree_mask(tree_attention_mask(parents, num_nodes))  # [B, N, W]
    return depths, positions, mask


# ---------------------------------------------------------------------------------------
# verify.h: the processed target distribution p_v = w / S (the ONE copy of this math)


class _Processed(NamedTuple):
    greedy: torch.Tensor  # [...] bool, temperature == 0
    kept: torch.Tensor  # [..., V] bool, survives top-k and top-p (T == 0: the argmax)
    z: torch.Tensor  # [..., V] float32, l / T (T == 0: l)
    m: torch.Tensor  # [...] float32, max z
    w: torch.Tensor  # [..., V] float32, unnormalised p_target
    S: torch.Tensor  # [...] float32, sum w (T == 0: 1)


def _process(logits: torch.Tensor, temperature: ParamLike, top_k: ParamLike,
             top_p: ParamLike) -> _Processed:
    """verify.h "The target distribution p_v", vectorised over the leading dims."""
    l = logits.to(torch.float32)  # [..., V]
    _check_logits(l, "logits")
    lead, V = l.shape[:-1], l.shape[-1]
    T = _expand_param(temperature, lead, torch.float32, "temperature")  # [...]
    k = _expand_param(top_k, lead, torch.int64, "top_k")  # [...]
    p = _expand_param(top_p, lead, torch.float32, "top_p")  # [...]
    # tlt_core.ops.MIN_TEMPERATURE: a positive temperature below it (in float32) is an error,
    # not a near-greedy row whose l / T overflows.
    if not bool(((T == 0) | (torch.isfinite(T) & (T >= MIN_TEMPERATURE))).all()):
        raise ValueError(f"temperature must be 0 or finite and >= {MIN_TEMPERATURE}")
    if bool(torch.isnan(p).any()) or bool((p <= 0).any()) or bool((p > 1).any()):
        raise ValueError("top_p must be in (0, 1]")
    greedy = T == 0  # [...]

    # T > 0: z(x) = l(x) / T, one IEEE float32 division.
    z = l / torch.where(greedy, torch.ones_like(T), T).unsqueeze(-1)  # [..., V]
    # top-k: if 0 < k < V, theta = k-th largest z (duplicates counted), keep z >= theta.
    z_desc = z.sort(dim=-1, descending=True).values  # [..., V]
    topk_on = (k > 0) & (k < V)  # [...]
    theta = z_desc.gather(-1, (k.clamp(1, V) - 1).unsqueeze(-1)).squeeze(-1)  # [...]
    keep_k = torch.where(topk_on.unsqueeze(-1), z >= theta.unsqueeze(-1), True)  # [..., V]
    # m = max z; e(x) = expf(z(x) - m) for kept x, else 0; Z = sum e.
    m = z.max(dim=-1).values  # [...]
    d = z - m.unsqueeze(-1)  # [..., V] float32
    e = torch.where(keep_k, _exp32(d), torch.zeros_like(d))  # [..., V]
    Z = _sum32(e)  # [...]
    # top-p: if top_p < 1, keep x iff sum_{y: e(y) > e(x)} e(y) < top_p * Z.
    e_desc = e.sort(dim=-1, descending=True).values  # [..., V]
    e_asc = e_desc.flip(-1).contiguous()  # [..., V]
    # n_greater[x] = #{y: e(y) > e(x)}; the n_greater largest e are exactly those y
    n_greater = V - torch.searchsorted(e_asc, e.contiguous(), right=True)  # [..., V]
    csum = torch.cumsum(e_desc.double(), dim=-1)  # [..., V] float64
    csum_excl = torch.cat([torch.zeros_like(csum[..., :1]), csum[..., :-1]], dim=-1)  # [..., V]
    greater = csum_excl.gather(-1, n_greater).float()  # [..., V] sum_{e(y) > e(x)} e(y)
    keep_p = greater < (p * Z).unsqueeze(-1)  # [..., V]
    keep_p = torch.where((p < 1).unsqueeze(-1), keep_p, True)  # [..., V]
    kept = keep_k & keep_p  # [..., V]
    w = torch.where(kept, e, torch.zeros_like(e))  # [..., V]
    S = _sum32(w)  # [...]

    # T == 0: a = argmax l (lowest id on ties); w = one_hot(a); S = 1.
    a = _argmax_lowest(l)  # [...]
    onehot = torch.nn.functional.one_hot(a, V).to(torch.float32)  # [..., V]
    w = torch.where(greedy.unsqueeze(-1), onehot, w)  # [..., V]
    S = torch.where(greedy, torch.ones_like(S), S)  # [...]
    kept = torch.where(greedy.unsqueeze(-1), onehot > 0, kept)  # [..., V]
    if bool(torch.isnan(w).any()) or not bool(torch.isfinite(S).all()):
        # only when l / T overflows to +inf for finite l: the header leaves this undefined
        raise ValueError("logits / temperature overflows float32")
    return _Processed(greedy, kept, z, m, w, S)


def processed_target_probs(logits: torch.Tensor, temperature: ParamLike, top_k: ParamLike = 0,
                           top_p: ParamLike = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """p_target = w / S of verify.h for logits [..., V] (any float dtype, widened to float32).

    temperature / top_k / top_p: scalars, or tensors whose shape is a prefix of the leading
    dims (left-aligned). T > 0: temperature, top-k, top-p exactly as verify.h; T == 0:
    w = one_hot(argmax l, lowest id on ties), S = 1.
    Returns w [..., V] float32 and S [...] float32.
    """
    r = _process(logits, temperature, top_k, top_p)
    return r.w, r.S


def processed_logprobs(logits: torch.Tensor, temperature: ParamLike, top_k: ParamLike = 0,
                       top_p: ParamLike = 1.0) -> torch.Tensor:
    """log p_target as verify.h's emitted log-probabilities, for logits [..., V].

    T > 0: z(x) - m - logf(S) for tokens that survive top-k / top-p (float32, in that
    order), -inf for dropped tokens; T == 0: log_softmax(l) at temperature 1 (float64,
    rounded to float32). Returns [..., V] float32.
    """
    return _logprobs(_process(logits, temperature, top_k, top_p), logits)


def _logprobs(r: _Processed, logits: torch.Tensor) -> torch.Tensor:
    """processed_logprobs from an already processed distribution r of logits [..., V]."""
    d = r.z - r.m.unsqueeze(-1)  # [..., V] float32
    lp = d - _log32(r.S).unsqueeze(-1)  # [..., V] float32
    lp = torch.where(r.kept, lp, torch.full_like(lp, -math.inf))  # [..., V]
    ls = torch.log_softmax(logits.to(torch.float64), dim=-1).float()  # [..., V]
    return torch.where(r.greedy.unsqueeze(-1), ls, lp)  # [..., V]


def _node_distribution(l: torch.Tensor, temperature: ParamLike, top_k: ParamLike,
                       top_p: ParamLike) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [V], S [], log p [V]) at one tree node: processed_target_probs and
    processed_logprobs of l [V] from a single _process call."""
    r = _process(l, temperature, top_k, top_p)
    return r.w, r.S, _logprobs(r, l)


# ---------------------------------------------------------------------------------------
# verify.h: the verifiers


def _empty_outputs(B: int, N: int):
    accept_index = torch.full((B, N), -1, dtype=torch.int32)  # [B, N]
    num_accepted = torch.zeros(B, dtype=torch.int32)  # [B]
    emitted_tokens = torch.full((B, N), -1, dtype=torch.int64)  # [B, N]
    emitted_logprobs = torch.zeros(B, N, dtype=torch.float32)  # [B, N]
    return accept_index, num_accepted, emitted_tokens, emitted_logprobs


def _check_verify_inputs(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                         num_nodes: Optional[torch.Tensor]) -> torch.Tensor:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, N, V], got {tuple(logits.shape)}")
    B, N, V = logits.shape
    if tokens.shape != (B, N) or parents.shape != (B, N):
        raise ValueError("tokens and parents must be [B, N] like logits[:, :, 0]")
    if not 1 <= V <= K_MAX_VOCAB:
        raise ValueError(f"V = {V} outside [1, {K_MAX_VOCAB}]")
    return _check_tree(tokens, parents, num_nodes, V)  # [B]


def verify_tree_greedy(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       num_nodes: Optional[torch.Tensor] = None) -> VerifyOutput:
    """verify.h verify_tree_greedy.

    logits [B, N, V], tokens [B, N] int64, parents [B, N] int32, num_nodes [B] int32 or None.
    Walk from the root: at node v, a = argmax logits[b, v] (lowest id on ties); move to the
    first child of v in sibling (index) order whose token is a; when none matches, emit a.
    Emitted log-probabilities: log_softmax(logits[b, v]) at temperature 1 at the emitting v.
    Raises ValueError where the kernel reports a row status (bad tree, bad visited logits).
    """
    n = _check_verify_inputs(logits, tokens, parents, num_nodes)  # [B]
    B, N, V = logits.shape
    outputs = VerifyOutput(*_empty_outputs(B, N))
    for b in range(B):
        nb = int(n[b])
        path = [0]
        emitted: list = []
        v = 0
        while True:
            l = logits[b, v].to(torch.float32)  # [V]
            _check_logits(l, f"row {b} node {v}")
            w, _, lp = _node_distribution(l, 0.0, 0, 1.0)  # [V] one_hot(argmax), [V] log_softmax
            a = int(_argmax_lowest(w))
            nxt = next((c for c in _children(parents[b], nb, v) if int(tokens[b, c]) == a), None)
            emitted.append((a, float(lp[a])))
            if nxt is None:
                break
            path.append(nxt)
            v = nxt
        _write_row(outputs, b, path, emitted)
    return outputs


def _write_row(outputs: VerifyOutput, b: int, path: list[int], emitted: list) -> None:
    """Row b of the verify outputs: the accepted path's node indices and the emitted
    (token, log-prob) pairs."""
    for j, node in enumerate(path):
        outputs.accept_index[b, j] = node
    outputs.num_accepted[b] = len(path) - 1
    for j, (x, logprob) in enumerate(emitted):
        outputs.emitted_tokens[b, j] = x
        outputs.emitted_logprobs[b, j] = logprob


ResidualFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_residual(w: torch.Tensor, q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """verify.h residual after a rejected sampled draft: w(y) = max(0, w(y) - q(y) * S).

    w [V] float32, q [V] float32, S 0-dim float32; float32 ops in the header's order."""
    return torch.clamp_min(w - q * S, 0.0)  # [V]


def _uniform(uniforms: torch.Tensor, b: int, c: int) -> torch.Tensor:
    """u[b, c] as a 0-dim float32 tensor; kRowBadUniform when outside [0, 1)."""
    u = uniforms[b, c]
    if not (0.0 <= float(u) < 1.0):
        raise ValueError(f"row {b}: uniform u[{b}, {c}] = {float(u)} outside [0, 1)")
    return u


def _check_q_row(q: torch.Tensor, b: int, v: int) -> None:
    """kRowBadDraftProbs: a visited q row is negative / non-finite / does not sum to 1 (1e-3)."""
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        raise ValueError(f"row {b}: draft_probs[{b}, {v}] has negative or non-finite entries")
    if abs(float(q.double().sum()) - 1.0) > 1e-3:
        raise ValueError(f"row {b}: draft_probs[{b}, {v}] does not sum to 1 (1e-3)")


def _first_accepted_child(w: torch.Tensor, S: torch.Tensor, q: Optional[torch.Tensor],
                          children: list, tokens_row: torch.Tensor, uniforms: torch.Tensor,
                          b: int, v: int, residual: ResidualFn):
    """The children of node v tried in sibling order against (w [V], S []): the first accepted
    child (None if none is) and the (w, S) left after the rejections. q [V] is q_draft at v, or
    None for a deterministic draft."""
    w, S = w.clone(), S.clone()
    if q is not None and children:
        _check_q_row(q, b, v)
    for c in children:
        x = int(tokens_row[c])
        u = _uniform(uniforms, b, c)  # [] float32
        if q is None:
            if bool(u * S < w[x]):
                return c, w, S
            S = S - w[x]
            w[x] = 0.0
        else:
            if bool((u * q[x]) * S < w[x]):
                return c, w, S
            w_new = residual(w.clone(), q, S.clone()).to(torch.float32)  # [V]
            S_new = _sum32(w_new)  # []
            if bool(S_new != 0):
                w, S = w_new, S_new
    return None, w, S


def _final_token(w: torch.Tensor, S: torch.Tensor, w_fresh: torch.Tensor, u0: torch.Tensor
                 ) -> int:
    """The token drawn when no child is accepted: with t = u0 * S, the smallest x with
    w(x) > 0 whose running sum exceeds t, else the largest x with w(x) > 0; argmax of the
    fresh w (lowest id) when w is all zero."""
    positive = w > 0  # [V]
    if not bool(positive.any()):
        return int(_argmax_lowest(w_fresh))
    t = u0 * S  # [] float32
    running = torch.cumsum(w.double(), dim=0).float()  # [V] running sums
    hit = torch.nonzero(positive & (running > t)).flatten()
    return int(hit[0]) if hit.numel() > 0 else int(torch.nonzero(positive).flatten()[-1])


def verify_tree_sampling(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                         temperature: ParamLike, top_k: ParamLike, top_p: ParamLike,
                         uniforms: torch.Tensor, draft_probs: Optional[torch.Tensor] = None,
                         num_nodes: Optional[torch.Tensor] = None,
                         residual: Optional[ResidualFn] = None) -> VerifyOutput:
    """verify.h verify_tree_sampling: lossless tree rejection sampling.

    logits [B, N, V]; tokens [B, N] int64; parents [B, N] int32; temperature [B] float32,
    top_k [B] int32, top_p [B] float32 (or scalars); uniforms [B, N] float32 in [0, 1)
    (u[b, c], c >= 1, tests child c; u[b, 0] draws the final token); draft_probs [B, N, V]
    float32 (q_draft: draft_probs[b, v] is the distribution v's children were sampled from)
    or None for deterministic (one-hot) drafts; num_nodes [B] int32 or None.
    residual: sampled mode only, (w [V], q [V], S 0-dim) -> new w [V]; default
    max(0, w - q * S). Tests pass a wrong one to check that the lossless test notices.

    At each visited node v, fresh (w, S) = processed_target_probs(logits[b, v]); children in
    sibling order, x = tokens[b, c], u = u[b, c]:
      deterministic: accept iff u * S < w(x); else S -= w(x), w(x) = 0;
      sampled:       accept iff (u * q(x)) * S < w(x); else w = residual(w, q, S),
                     S = sum w, and if that mass is 0, w and S stay as they were.
    Accepting emits x (log-prob at v) and restarts at c. When no child is accepted: with
    t = u[b, 0] * S, the smallest x with w(x) > 0 whose running sum sum_{y <= x} w(y)
    exceeds t (for S >= 0 the condition w(x) > 0 is implied); if none, the largest x with
    w(x) > 0; if w is all zero, argmax of the fresh p_v (lowest id).
    Emitted log-probabilities: processed_logprobs(logits[b, v]) at the emitting node.
    Raises ValueError where the kernel reports a row status.
    """
    n = _check_verify_inputs(logits, tokens, parents, num_nodes)  # [B]
    B, N, V = logits.shape
    if uniforms.shape != (B, N):
        raise ValueError(f"uniforms must be [{B}, {N}], got {tuple(uniforms.shape)}")
    uniforms = uniforms.to(torch.float32)  # [B, N]
    if draft_probs is not None:
        if draft_probs.shape != (B, N, V):
            raise ValueError(f"draft_probs must be [{B}, {N}, {V}]")
        draft_probs = draft_probs.to(torch.float32)  # [B, N, V]
    res_fn = default_residual if residual is None else residual
    temp = _row_param(temperature, B, torch.float32, "temperature")  # [B]
    topk = _row_param(top_k, B, torch.int64, "top_k")  # [B]
    topp = _row_param(top_p, B, torch.float32, "top_p")  # [B]
    outputs = VerifyOutput(*_empty_outputs(B, N))
    for b in range(B):
        path, emitted, v = [0], [], 0
        while True:
            l = logits[b, v].to(torch.float32)  # [V]
            _check_logits(l, f"row {b} node {v}")
            w_fresh, S_fresh, lp = _node_distribution(l, temp[b], topk[b], topp[b])  # [V], [], [V]
            q = draft_probs[b, v] if draft_probs is not None else None  # [V] q_draft at v
            accepted, w, S = _first_accepted_child(
                w_fresh, S_fresh, q, _children(parents[b], int(n[b]), v), tokens[b], uniforms,
                b, v, res_fn)
            if accepted is None:
                x = _final_token(w, S, w_fresh, _uniform(uniforms, b, 0))
                emitted.append((x, float(lp[x])))
                break
            x = int(tokens[b, accepted])
            emitted.append((x, float(lp[x])))
            path.append(accepted)
            v = accepted
        _write_row(outputs, b, path, emitted)
    return outputs


# ---------------------------------------------------------------------------------------
# kv_cache.h: compaction


def compact_kv_(cache: torch.Tensor, accept_index: torch.Tensor, num_accepted: torch.Tensor,
                cache_len: torch.Tensor) -> torch.Tensor:
    """kv_cache.h compact_kv, in place, on cache [P, B, G, T, ...] (any dtype; the trailing
    dims form one token's entry). For each row b and j = 0..num_accepted[b], in increasing
    j, copies slot cache_len[b] + accept_index[b, j] to slot cache_len[b] + j in every plane
    and group. A row is left untouched and flagged kRowBadCacheRange (7) when a slot would
    leave [0, T), when accept_index[b, 0..num_accepted[b]] is not strictly increasing with
    accept_index[b, j] >= j (a failed verification's row, accept_index[b, 0] = -1, is one), or
    when num_accepted[b] is outside [0, N) (the path would not fit in accept_index).
    Returns row_status [B] int32.
    """
    if cache.dim() < 4:
        raise ValueError(f"cache must be [P, B, G, T, ...], got {tuple(cache.shape)}")
    P, B, G, T = cache.shape[:4]
    if accept_index.dim() != 2 or accept_index.shape[0] != B:
        raise ValueError(f"accept_index must be [{B}, N]")
    N = accept_index.shape[1]
    if num_accepted.shape != (B,) or torch.as_tensor(cache_len).shape != (B,):
        raise ValueError(f"num_accepted and cache_len must be [{B}]")
    status = torch.zeros(B, dtype=torch.int32)  # [B]
    for b in range(B):
        L = int(cache_len[b])
        na = int(num_accepted[b])
        if not 0 <= na < N:
            status[b] = ROW_BAD_CACHE_RANGE
            continue
        path = [int(a) for a in accept_index[b, : na + 1]]
        in_range = (all(0 <= L + a < T for a in path) and all(0 <= L + j < T for j in range(na + 1))
                    and all(a >= j for j, a in enumerate(path)))
        increasing = all(path[j] < path[j + 1] for j in range(na))
        if not (in_range and increasing):
            status[b] = ROW_BAD_CACHE_RANGE
            continue
        for j, a in enumerate(path):
            if a != j:
                cache[:, b, :, L + j] = cache[:, b, :, L + a].clone()  # [P, G, ...]
    return status


def compact_kv(cache: torch.Tensor, accept_index: torch.Tensor, num_accepted: torch.Tensor,
               cache_len: torch.Tensor) -> torch.Tensor:
    """Non-mutating compact_kv_: returns a compacted copy of cache [P, B, G, T, ...]
    (bad rows copied unchanged; use compact_kv_ on a clone to get row_status)."""
    out = cache.clone()
    compact_kv_(out, accept_index, num_accepted, cache_len)
    return out


# ---------------------------------------------------------------------------------------
# random.h: Philox4x32-10

_MASK32 = 0xFFFFFFFF
_PHILOX_MUL0, _PHILOX_MUL1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_WEYL0, _PHILOX_WEYL1 = 0x9E3779B9, 0xBB67AE85


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """random.h philox4x32_10, line for line. Arguments are Python ints or numpy uint64
    arrays (broadcastable) holding 32-bit values; returns the 4 output words alike."""
    for _ in range(10):
        prod0 = _PHILOX_MUL0 * c0  # < 2^64: exact in uint64
        prod1 = _PHILOX_MUL1 * c2
        hi0, lo0 = prod0 >> 32, prod0 & _MASK32
        hi1, lo1 = prod1 >> 32, prod1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_WEYL0) & _MASK32
        k1 = (k1 + _PHILOX_WEYL1) & _MASK32
    return c0, c1, c2, c3


def philox_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, count: int) -> torch.Tensor:
    """random.h philox_uniforms: out[b, i] = philox_uniform(seeds[b], offsets[b], i).

    seeds [B] int64, offsets [B] int64 (reinterpreted as uint64); counter = (offset lo,
    offset hi, i lo, i hi), key = (seed lo, seed hi); u = (x0 >> 8) * 2^-24.
    Returns float32 [B, count].
    """
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    offsets = torch.as_tensor(offsets, dtype=torch.int64)
    if seeds.dim() != 1 or offsets.shape != seeds.shape:
        raise ValueError("seeds and offsets must both be [B]")
    if count < 0:
        raise ValueError("count must be >= 0")
    B = seeds.shape[0]
    s = seeds.numpy().view(np.uint64)[:, None]  # [B, 1]
    o = offsets.numpy().view(np.uint64)[:, None]  # [B, 1]
    i = np.arange(count, dtype=np.uint64)[None, :]  # [1, count]
    m32, sh = np.uint64(_MASK32), np.uint64(32)
    zeros = np.zeros((B, count), dtype=np.uint64)  # [B, count]
    x0, _, _, _ = philox4x32_10(
        (o & m32) + zeros, (o >> sh) + zeros, (i & m32) + zeros, (i >> sh) + zeros,
        (s & m32) + zeros, (s >> sh) + zeros)  # [B, count] uint64 < 2^32
    top24 = (x0 >> np.uint64(8)).astype(np.float32)  # exact: < 2^24
    u = top24 * np.float32(1.0 / 16777216.0)  # [B, count] float32, exact
    return torch.from_numpy(np.ascontiguousarray(u, dtype=np.float32))


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, cache_kv: torch.Tensor,
                  q_out: torch.Tensor) -> None:
    """rope.h in tensor ops (what a decoder layer computes without the kernel): qkv (B, T,
    H_q + 2 H_kv, d); cos, sin_signed (P, d); positions, slots (B, T) int64; cache_kv (2, B,
    H_kv, S, d); q_out (B, H_q, T, d). Raises ValueError naming positions or slots when one
    is out of range, before writing anything."""
    cache_k, cache_v = cache_kv[0], cache_kv[1]
    B, T, heads, d = qkv.shape
    q_heads = q_out.shape[1]
    kv_heads = (heads - q_heads) // 2
    if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < cos.shape[0]):
        raise ValueError(f"positions: outside the tables' [0, {cos.shape[0]})")
    if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < cache_k.shape[2]):
        raise ValueError(f"slots: outside the cache's [0, {cache_k.shape[2]})")
    qk = qkv[:, :, :q_heads + kv_heads]  # (B, T, H_q + H_kv, d)
    c, s = cos[positions][:, :, None], sin_signed[positions][:, :, None]  # (B, T, 1, d)
    rotated = torch.addcmul(qk * c, qk.roll(d // 2, -1), s)
    q_out.copy_(rotated[:, :, :q_heads].transpose(1, 2))
    rows = torch.arange(B)[:, None]  # (B, 1)
    cache_k[rows, :, slots] = rotated[:, :, q_heads:].to(cache_k.dtype)  # (B, T, H_kv, d)
    cache_v[rows, :, slots] = qkv[:, :, q_heads + kv_heads:].to(cache_v.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm.h literally, bit for bit: h, delta (R, H) and weight (H,) bfloat16 (delta None:
    no add); returns (h_out, normed). Every float32 operation is one torch op on float32
    tensors, in the header's order (the sum of squares in its 16 lanes)."""
    summed = h if delta is None else (h.float() + delta.float()).to(torch.bfloat16)
    values = summed.float()  # (R, H)
    rows, hidden = values.shape
    lanes = 16
    partial = torch.zeros(rows, lanes)
    for start in range(0, hidden, lanes):
        chunk = values[:, start:start + lanes]
        partial[:, :chunk.shape[1]] += chunk * chunk
    squares = partial[:, 0].clone()
    for lane in range(1, lanes):
        squares = squares + partial[:, lane]
    scale = 1.0 / torch.sqrt(squares / float(hidden) + torch.tensor(eps, dtype=torch.float32))
    normed = (weight.float() * (values * scale[:, None]).to(torch.bfloat16).float())
    return summed, normed.to(torch.bfloat16)


def _fma_float32(a: float, b: float, c: float) -> float:
    """fma(a, b, c) of float32 values, rounded once to float32 (ties to even) as C's fmaf does:
    exactly, through fractions (float64 could round twice)."""
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
        return float(np.float32(a * b + c))  # non-finite either way, as fmaf's
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:  # an exact zero sum is +0, but (-0) + (-0) is -0
        product = a * b
        both_negative_zeros = product == 0 and math.copysign(1, product) < 0 \
            and math.copysign(1, c) < 0
        return -0.0 if both_negative_zeros else 0.0
    with np.errstate(over="ignore"):
        guess = np.float32(float(exact))
    if not math.isfinite(guess):
        return float(guess)  # past float32's largest: overflow to +-inf
    candidates = [guess, np.nextafter(guess, np.float32(math.inf)),
                  np.nextafter(guess, np.float32(-math.inf))]
    finite = [v for v in candidates if math.isfinite(v)]
    best = min(abs(Fraction(float(v)) - exact) for v in finite)
    nearest = [v for v in finite if abs(Fraction(float(v)) - exact) == best]
    even = [v for v in nearest if int(np.array(v).view(np.uint32)) % 2 == 0]
    return float((even or nearest)[0])


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: Optional[torch.Tensor] = None,
                 addend: Optional[torch.Tensor] = None) -> torch.Tensor:
    """panel_matmul.h literally, bit for bit: x (M, K), panels (ceil(N / 16), K, 16), bias
    (N,) and addend (M, N), all float32 or all bfloat16; returns y (M, N) of their dtype. Each
    y[r, n] is a chain of fmaf over k in order from 0, then + bias[n], then + addend[r, n], each
    one float32 add, on the operands widened to float32; in bfloat16 that float32 value rounded
    once to bfloat16 (nearest even; any NaN as 0x7FC0, where torch's conversion may keep a
    NaN's sign and payload). Pairs panels (ceil(N / 16), ceil(K / 2), 16, 2), bfloat16 only:
    the chain runs k = 1, 0, 3, 2, ... (x and W zero past K), each operand and each sum with a
    subnormal value taken as a zero of its sign."""
    rows, K = x.shape
    width = panels.shape[2] if panels.dim() == 4 else panels.shape[-1]
    # W (N, K) as float32 columns of the chain's operands, and the order the chain takes k in
    if panels.dim() == 4:
        pair_count = panels.shape[1]
        flush = _flush_subnormal
        ws = [[flush(v) for v in column] for column in
              panels.float().permute(0, 2, 1, 3).reshape(-1, 2 * pair_count).tolist()]
        xs = [[flush(v) for v in row] + [0.0] * (2 * pair_count - K) for row in x.float().tolist()]
        order = [k for i in range(pair_count) for k in (2 * i + 1, 2 * i)]
    else:
        flush = float
        ws = panels.float().transpose(1, 2).reshape(-1, K).tolist()
        xs = x.float().tolist()
        order = list(range(K))
    bs = None if bias is None else bias.float().tolist()
    adds = None if addend is None else addend.float().tolist()
    y = np.zeros((rows, out_features), dtype=np.float32)
    for r in range(rows):
        for n in range(out_features):
            acc = 0.0
            for k in order:
                acc = flush(_fma_float32(xs[r][k], ws[n][k], acc))
            value = np.float32(acc)
            with np.errstate(all="ignore"):  # inf and NaN are values here, as in C
                if bs is not None:
                    value = np.float32(value + np.float32(bs[n]))
                if adds is not None:
                    value = np.float32(value + np.float32(adds[r][n]))
            y[r, n] = value
    wide = torch.from_numpy(y)
    if x.dtype != torch.bfloat16:
        return wide
    narrow = wide.to(torch.bfloat16)
    narrow.view(torch.int16)[wide.isnan()] = 0x7FC0
    return narrow


_FLOAT32_TINY = 2.0 ** -126  # the smallest normal float32


def _flush_subnormal(value: float) -> float:
    """A subnormal float32 as a zero of its sign (VDPBF16PS's DAZ and FTZ)."""
    return math.copysign(0.0, value) if 0 < abs(value) < _FLOAT32_TINY else value


def decode_attention(q: torch.Tensor, cache_kv: torch.Tensor, slots: int,
                     mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """attention.h's math in float64, one query at a time over the slots it sees: q (B, H_q,
    T, d), cache_kv (2, B, H_kv, max_len, d), mask None or bool (B or 1, 1, T or 1, slots).
    Returns (B T, H_q d) float64; a query that sees no slot gets zeros. The kernel's float32
    sums and exp agree with it to float32 rounding."""
    B, H_q, T, d = q.shape
    H_kv = cache_kv.shape[2]
    group = H_q // H_kv
    out = torch.zeros(B, T, H_q, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            keys = cache_kv[0, b, h // group, :slots].double()  # (S, d)
            values = cache_kv[1, b, h // group, :slots].double()
            for t in range(T):
                sees = (torch.ones(slots, dtype=torch.bool) if mask is None
                        else mask[b % mask.shape[0], 0, t % mask.shape[2]])
                if not bool(sees.any()):
                    continue
                scores = keys[sees] @ q[b, h, t].double() / math.sqrt(d)
                weights = torch.softmax(scores, 0)
                out[b, t, h] = weights @ values[sees]
    return out.reshape(B * T, H_q * d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul.h's math in float64: gate_up (R, 2 I) -> silu(gate) * up, (R, I) float64. The
    kernel's float32 (and its one bf16 rounding) agrees with it to rounding."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def sample_draft(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor,
                 draft_to_target: Optional[torch.Tensor] = None, vocab: Optional[int] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """draft_sample.h's math, row by row: logits (M, V') float32, uniforms (M, n), temperature
    (M,) -> (ids (M, n) int64, q (M, V) float32). q is softmax(logits / T) in float32 (e / S,
    S summed in float64), one-hot at the lowest argmax for T <= 0; each id is the smallest
    index whose float64 running sum of q exceeds u times the float64 total. ValueError for a
    row whose logits hold NaN or +inf or only -inf, or a uniform outside [0, 1)."""
    rows, draft_vocab = logits.shape
    vocab = draft_vocab if draft_to_target is None else vocab
    q = torch.zeros(rows, vocab, dtype=torch.float32)
    ids = torch.empty(uniforms.shape, dtype=torch.int64)
    for m in range(rows):
        t = float(temperature[m])
        z = logits[m] / torch.tensor(t, dtype=torch.float32) if t > 0 else logits[m].clone()
        if bool(torch.isnan(z).any() | (z == math.inf).any()) or bool((z == -math.inf).all()):
            raise ValueError(f"logits: row {m} has NaN or +inf, or only -inf")
        if bool(((uniforms[m] < 0) | ~(uniforms[m] < 1)).any()):
            raise ValueError(f"uniforms: row {m} has a value outside [0, 1)")
        if t > 0:
            e = torch.exp(z - z.max())
            row_q = e / torch.tensor(float(e.double().sum()), dtype=torch.float32)
            running = row_q.double().cumsum(0)
            total = float(row_q.double().sum())
            picks = []
            for u in uniforms[m].tolist():
                above = torch.nonzero((running > u * total) & (row_q > 0))
                picks.append(int(above[0]) if above.numel()
                             else int(torch.nonzero(row_q > 0)[-1]))
        else:
            row_q = torch.zeros(draft_vocab)
            top = int(_argmax_lowest(z))
            row_q[top] = 1.0
            picks = [top] * uniforms.shape[1]
        target_ids = torch.tensor(picks)
        if draft_to_target is None:
            q[m] = row_q
        else:
            q[m, draft_to_target] = row_q
            target_ids = draft_to_target[target_ids]
        ids[m] = target_ids
    return ids, q
