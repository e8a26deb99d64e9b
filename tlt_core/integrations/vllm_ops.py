"""vLLM's packed rejection-sampling layout over tlt_core's verify kernels, as a torch.library op.

vLLM's v1 sampler (vllm/v1/sample/rejection_sampler.py, `rejection_sample`) verifies a batch of
linear drafts flattened request after request. `rejection_sample` here takes that layout, runs
each request's draft as a one-branch tree through tlt_core.ops.verify_tree_greedy /
verify_tree_sampling, and writes vLLM's output in place. It is the custom op
`torch.ops.tlt.vllm_rejection_sample`, with a fake (meta) implementation, so torch.compile
traces it (fullgraph) and, with validate=False, it reads no value on the host and can be
captured in a CUDA graph.

Shapes: B requests, K = max_spec_len, T = total draft tokens, V vocabulary.
    draft_token_ids     (T,) int32/int64        request b's drafts at [start_b, end_b)
    cu_num_draft_tokens (B,) int32/int64        end_b, the inclusive cumulative draft counts
    draft_probs         (T, V) float32 or None  q_draft each draft token was sampled from; None:
                                                deterministic drafts (n-gram, greedy EAGLE),
                                                q one-hot at the draft token
    target_probs        (T, V) float32          p_target at each draft position, after vLLM's
                                                temperature / top-k / top-p (greedy requests:
                                                any scores whose argmax is the target's token)
    bonus_token_ids     (B, 1) or (B,) int      the token emitted when every draft is accepted
    output_token_ids    (B, K + 1) int32        written: accepted drafts, then one recovered or
                                                bonus token, then PLACEHOLDER_TOKEN_ID (-1)
    is_greedy           (B,) bool or None       None: every request is greedy
    uniform_probs       (T,) float32/float64    u tested against draft token t (random requests)
    recovery_uniforms   (B,) float32/float64    u that draws request b's recovered token

Semantics, per request (those of vLLM's kernels; Leviathan et al. 2023):
    greedy:  draft t is accepted iff it equals argmax target_probs[t] (lowest id on ties); the
             first mismatch emits that argmax; all accepted: the bonus token. draft_probs and
             the uniforms do not affect greedy requests (as in vLLM).
    random:  draft x at t is accepted iff uniform_probs[t] < p(x) / q(x) (q = 1 without
             draft_probs); the first rejection emits a token drawn from max(p - q, 0),
             normalised (n-gram: p with x removed), by inverse CDF with recovery_uniforms[b];
             all accepted: the bonus token.

Where this differs from vLLM, by design:
    * randomness is an input: vLLM draws uniform_probs itself (from per-request generators)
      and draws recovered tokens with exponential noise over the vocabulary (argmax p / E); here
      the caller passes uniform_probs and one recovery uniform per request. Acceptance
      decisions are the same given the same uniform_probs (up to float32 rounding of the
      uniform: the kernel reads float32, so a float64 u within 2^-24 of p / q may decide
      differently); recovered tokens have the same distribution but are different draws.
    * vLLM rejects a draft whose draft probability q(x) is 0; a drafted token has q(x) > 0, and
      validate=True raises on one that does not.
    * top-k / top-p / temperature are applied by vLLM before this op (they are in target_probs);
      the verify kernel then runs at temperature 1 on log(target_probs).
validate=True checks every value (host syncs) and raises naming the argument; validate=False
checks only shapes, dtypes and devices (use it under CUDA-graph capture), and a request with bad
values gets an undefined row (never an out-of-bounds access).
"""

from __future__ import annotations

from typing import Optional

import torch

from tlt_core import ops
from tlt_core.ops import _arrays as arr

__all__ = ["PLACEHOLDER_TOKEN_ID", "rejection_sample"]

PLACEHOLDER_TOKEN_ID = -1

# The largest float32 below 1: a float64 uniform in [0, 1) can round up to 1.0 in float32, which
# the kernel rightly refuses.
_BELOW_ONE = 1.0 - 2.0 ** -24
# verify.h's tolerance on a draft distribution's sum (kRowBadDraftProbs).
_DRAFT_SUM_TOLERANCE = 1e-3

_INDEX_DTYPES = (torch.int32, torch.int64)
_UNIFORM_DTYPES = (torch.float32, torch.float64)


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                     draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     bonus_token_ids: torch.Tensor, output_token_ids: torch.Tensor, *,
                     is_greedy: Optional[torch.Tensor] = None,
                     uniform_probs: Optional[torch.Tensor] = None,
                     recovery_uniforms: Optional[torch.Tensor] = None,
                     validate: bool = True) -> torch.Tensor:
    """Verify vLLM's flattened drafts and fill output_token_ids (B, K + 1) in place; returns it.

    The layout, the semantics and what differs from vLLM are in the module docstring. Requests
    that are all greedy (is_greedy=None) take no uniforms; otherwise uniform_probs and
    recovery_uniforms are required.
    """
    torch.ops.tlt.vllm_rejection_sample(output_token_ids, draft_token_ids, cu_num_draft_tokens,
                                        draft_probs, target_probs, bonus_token_ids, is_greedy,
                                        uniform_probs, recovery_uniforms, validate)
    return output_token_ids


def _check_layout(output_token_ids: torch.Tensor, draft_token_ids: torch.Tensor,
                  cu_num_draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                  target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                  is_greedy: Optional[torch.Tensor], uniform_probs: Optional[torch.Tensor],
                  recovery_uniforms: Optional[torch.Tensor]) -> None:
    """Shapes, dtypes and devices, each error naming its argument. Reads no values, so the fake
    implementation runs it too and torch.compile reports a bad layout while tracing."""
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs: expected shape (T, V), got {tuple(target_probs.shape)}")
    if target_probs.dtype != torch.float32:
        raise TypeError(f"target_probs: dtype must be float32, got {target_probs.dtype}")
    num_tokens, vocab = target_probs.shape
    device = target_probs.device
    if output_token_ids.dim() != 2 or output_token_ids.shape[1] < 1:
        raise ValueError("output_token_ids: expected shape (B, max_spec_len + 1), got "
                         f"{tuple(output_token_ids.shape)}")
    if output_token_ids.dtype != torch.int32:
        raise TypeError(f"output_token_ids: dtype must be int32 (vLLM's sampled_token_ids), "
                        f"got {output_token_ids.dtype}")
    batch = output_token_ids.shape[0]
    for name, tensor, shape in (("draft_token_ids", draft_token_ids, (num_tokens,)),
                                ("cu_num_draft_tokens", cu_num_draft_tokens, (batch,))):
        if tensor.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name}: dtype must be int32 or int64, got {tensor.dtype}")
        arr.check_shape(tensor, name, shape)
    if bonus_token_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"bonus_token_ids: dtype must be int32 or int64, got "
                        f"{bonus_token_ids.dtype}")
    if tuple(bonus_token_ids.shape) not in ((batch,), (batch, 1)):
        raise ValueError(f"bonus_token_ids: expected shape ({batch}, 1) or ({batch},), got "
                         f"{tuple(bonus_token_ids.shape)}")
    if draft_probs is not None:
        if draft_probs.dtype != torch.float32:
            raise TypeError(f"draft_probs: dtype must be float32, got {draft_probs.dtype}")
        if draft_probs.dim() == 2 and draft_probs.shape[1] != vocab:
            raise ValueError(f"draft_probs: vocabulary {draft_probs.shape[1]} differs from "
                             f"target_probs' V = {vocab}")
        arr.check_shape(draft_probs, "draft_probs", (num_tokens, vocab))
    if is_greedy is None:
        for name, given in (("uniform_probs", uniform_probs),
                            ("recovery_uniforms", recovery_uniforms)):
            if given is not None:
                raise ValueError(f"{name}: is_greedy=None makes every request greedy, which "
                                 "draws nothing; pass is_greedy to sample")
    else:
        if is_greedy.dtype != torch.bool:
            raise TypeError(f"is_greedy: dtype must be bool, got {is_greedy.dtype}")
        arr.check_shape(is_greedy, "is_greedy", (batch,))
        for name, given, shape in (("uniform_probs", uniform_probs, (num_tokens,)),
                                   ("recovery_uniforms", recovery_uniforms, (batch,))):
            if given is None:
                raise ValueError(f"{name}: required when is_greedy is given (random requests "
                                 "draw with it)")
            if given.dtype not in _UNIFORM_DTYPES:
                raise TypeError(f"{name}: dtype must be float32 or float64, got {given.dtype}")
            arr.check_shape(given, name, shape)
    for name, tensor in (("output_token_ids", output_token_ids),
                         ("draft_token_ids", draft_token_ids),
                         ("cu_num_draft_tokens", cu_num_draft_tokens),
                         ("draft_probs", draft_probs), ("bonus_token_ids", bonus_token_ids),
                         ("is_greedy", is_greedy), ("uniform_probs", uniform_probs),
                         ("recovery_uniforms", recovery_uniforms)):
        if tensor is not None:
            arr.check_device(tensor, name, device)


def _check_values(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                  draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                  bonus_token_ids: torch.Tensor, uniform_probs: Optional[torch.Tensor],
                  recovery_uniforms: Optional[torch.Tensor], max_spec_len: int) -> None:
    """validate=True: every value the kernels would read, on the host, naming the argument."""
    num_tokens, vocab = target_probs.shape
    ends = cu_num_draft_tokens.to(torch.int64)  # (B,)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # (B,)
    if bool((counts < 0).any()):
        row = int(torch.nonzero(counts < 0)[0])
        raise ValueError(f"cu_num_draft_tokens: must be non-decreasing from 0; request {row} "
                         f"has {int(counts[row])} draft tokens")
    total = int(ends[-1]) if ends.numel() else 0
    if total != num_tokens:
        raise ValueError(f"cu_num_draft_tokens: counts {total} draft tokens in all, but "
                         f"draft_token_ids and target_probs hold T = {num_tokens}")
    if bool((counts > max_spec_len).any()):
        row = int(torch.nonzero(counts > max_spec_len)[0])
        raise ValueError(f"cu_num_draft_tokens: request {row} has {int(counts[row])} draft "
                         f"tokens, more than output_token_ids' max_spec_len = {max_spec_len}")
    for name, tokens in (("draft_token_ids", draft_token_ids),
                         ("bonus_token_ids", bonus_token_ids.reshape(-1))):
        bad = (tokens < 0) | (tokens >= vocab)
        if bool(bad.any()):
            at = int(torch.nonzero(bad)[0])
            raise ValueError(f"{name}: entry {at} is {int(tokens[at])}, outside the vocabulary "
                             f"[0, {vocab}) of target_probs")
    bad_rows = ~torch.isfinite(target_probs).all(-1) | (target_probs < 0).any(-1)
    bad_rows |= ~(target_probs.sum(-1) > 0)
    if bool(bad_rows.any()):
        at = int(torch.nonzero(bad_rows)[0])
        raise ValueError(f"target_probs: row {at} is not a distribution (negative, non-finite "
                         "or no mass)")
    if draft_probs is not None:
        bad_rows = ~torch.isfinite(draft_probs).all(-1) | (draft_probs < 0).any(-1)
        bad_rows |= (draft_probs.double().sum(-1) - 1).abs() > _DRAFT_SUM_TOLERANCE
        if bool(bad_rows.any()):
            at = int(torch.nonzero(bad_rows)[0])
            raise ValueError(f"draft_probs: row {at} is negative, non-finite or does not sum "
                             f"to 1 (+-{_DRAFT_SUM_TOLERANCE})")
        drafted = draft_probs.gather(1, draft_token_ids.long()[:, None]).squeeze(1)  # (T,)
        if bool((drafted <= 0).any()):
            at = int(torch.nonzero(drafted <= 0)[0])
            raise ValueError(f"draft_probs: draft token {at} ({int(draft_token_ids[at])}) has "
                             "probability 0 under the distribution it was drawn from")
    for name, uniforms in (("uniform_probs", uniform_probs),
                           ("recovery_uniforms", recovery_uniforms)):
        if uniforms is not None and bool(((uniforms < 0) | ~(uniforms < 1)).any()):
            raise ValueError(f"{name}: every value must be in [0, 1)")


@torch.library.custom_op("tlt::vllm_rejection_sample", mutates_args=("output_token_ids",))
def _rejection_sample_op(output_token_ids: torch.Tensor, draft_token_ids: torch.Tensor,
                         cu_num_draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                         target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                         is_greedy: Optional[torch.Tensor], uniform_probs: Optional[torch.Tensor],
                         recovery_uniforms: Optional[torch.Tensor], validate: bool) -> None:
    _check_layout(output_token_ids, draft_token_ids, cu_num_draft_tokens, draft_probs,
                  target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_uniforms)
    batch, num_nodes_max = output_token_ids.shape  # N = K + 1: the root, then K drafts
    if validate:
        _check_values(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                      bonus_token_ids, uniform_probs, recovery_uniforms, num_nodes_max - 1)
    if batch == 0:
        return
    chain = _ChainLayout.of(cu_num_draft_tokens, target_probs.shape[0], num_nodes_max)
    tokens = chain.node_values(draft_token_ids.to(torch.int64), shift=1, fill=0)  # (B, N)
    target = chain.node_values(target_probs, shift=0, fill=0.0)  # (B, N, V)
    bonus = bonus_token_ids.reshape(-1).to(torch.int64)  # (B,)
    if is_greedy is None:
        out = ops.verify_tree_greedy(target, tokens, chain.parents, chain.num_nodes,
                                     validate=validate)
    else:
        # Greedy rows keep the probabilities (temperature 0 takes their argmax); random rows
        # become logits whose softmax at temperature 1 is target_probs. The bonus position has
        # no target distribution: 0 logits stand there, and the bonus token replaces the draw.
        logits = torch.where(is_greedy[:, None, None], target, torch.log(target))  # (B, N, V)
        logits = torch.where(chain.has_target[..., None], logits, 0.0)  # (B, N, V)
        draft = (None if draft_probs is None else
                 chain.node_values(draft_probs, shift=0, fill=0.0))  # (B, N, V)
        tests = chain.node_values(uniform_probs, shift=1, fill=0.0)  # (B, N)
        uniforms = torch.cat((recovery_uniforms[:, None].to(tests.dtype), tests[:, 1:]), 1)
        uniforms = uniforms.to(torch.float32).clamp_(max=_BELOW_ONE)  # (B, N)
        temperature = torch.where(is_greedy, 0.0, 1.0).to(torch.float32)  # (B,)
        out = ops.verify_tree_sampling(logits, tokens, chain.parents, temperature=temperature,
                                       uniforms=uniforms, draft_probs=draft,
                                       num_nodes=chain.num_nodes, validate=validate)
    emitted = out.emitted_tokens  # (B, N) int64, -1 after num_accepted + 1 tokens
    last = out.num_accepted.to(torch.int64)[:, None]  # (B, 1)
    drawn = emitted.gather(1, last).squeeze(1)  # (B,)
    final = torch.where(last.squeeze(1) == chain.num_drafts, bonus, drawn)  # (B,)
    emitted.scatter_(1, last, final[:, None])
    output_token_ids.copy_(emitted)


@_rejection_sample_op.register_fake
def _rejection_sample_fake(output_token_ids, draft_token_ids, cu_num_draft_tokens, draft_probs,
                           target_probs, bonus_token_ids, is_greedy, uniform_probs,
                           recovery_uniforms, validate) -> None:
    _check_layout(output_token_ids, draft_token_ids, cu_num_draft_tokens, draft_probs,
                  target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_uniforms)


class _ChainLayout:
    """Each request's drafts as a one-branch tree of N = K + 1 nodes: node 0 is the root (the
    last committed token), node j >= 1 the j-th draft token, parents[j] = j - 1. Node j's
    target distribution is the flattened row start_b + j (for j < n_b; node n_b is where the
    bonus token comes from). Built with tensor ops only: no host sync."""

    def __init__(self, num_drafts: torch.Tensor, flat_index: torch.Tensor,
                 node: torch.Tensor, num_tokens: int) -> None:
        self.num_drafts = num_drafts  # (B,) int64, n_b
        self.flat_index = flat_index  # (B, N) int64, start_b + j (clamped where it is read)
        self.num_tokens = num_tokens
        self.has_target = node[None, :] < num_drafts[:, None]  # (B, N)
        batch, num_nodes_max = flat_index.shape
        self.parents = (node - 1).to(torch.int32).expand(batch, num_nodes_max)  # (B, N)
        self.num_nodes = (num_drafts + 1).to(torch.int32)  # (B,)
        self._node = node

    @classmethod
    def of(cls, cu_num_draft_tokens: torch.Tensor, num_tokens: int,
           num_nodes_max: int) -> "_ChainLayout":
        ends = cu_num_draft_tokens.to(torch.int64)  # (B,)
        # Clamped so that, with validate=False, bad counts give a bad row and never an index
        # outside the flattened inputs.
        num_drafts = torch.diff(ends, prepend=ends.new_zeros(1)).clamp(0, num_nodes_max - 1)
        node = torch.arange(num_nodes_max, device=ends.device)  # (N,)
        flat = (ends - num_drafts)[:, None] + node[None, :]  # (B, N)
        return cls(num_drafts, flat, node, num_tokens)

    def node_values(self, flat: torch.Tensor, shift: int, fill: float) -> torch.Tensor:
        """flat (T, ...) per-draft-token values placed at nodes: node j takes row start_b + j -
        shift where that row belongs to request b (shift 1: a draft token sits one node after
        the distribution it was tested against), `fill` elsewhere. (B, N, ...)"""
        batch, num_nodes_max = self.flat_index.shape
        if self.num_tokens == 0:
            return flat.new_full((batch, num_nodes_max) + tuple(flat.shape[1:]), fill)
        index = (self.flat_index - shift).clamp(0, self.num_tokens - 1)  # (B, N)
        node = self._node[None, :] - shift  # (1, N)
        present = (node >= 0) & (node < self.num_drafts[:, None])  # (B, N)
        values = flat[index]  # (B, N, ...)
        present = present.reshape(present.shape + (1,) * (values.dim() - 2))
        return torch.where(present, values, fill)
