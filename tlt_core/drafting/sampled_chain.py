"""Sampled chain drafts: the learned drafter's chain with each token sampled from its own
distribution instead of taken as its argmax, verified by the sampled-draft rule.

Why: at temperature T > 0 a deterministic draft token x is accepted with the target's
probability p(x) (the deterministic-draft rule), which on a flat distribution is small however
good the drafter is. A token sampled from a draft distribution q and tested with
min(1, p(x) / q(x)) is accepted with probability sum_x min(p(x), q(x)): 1 - TV(p, q), which
is high whenever q is close to p, flat or not. The drafter learned the target's soft
distribution (the EAGLE loss, and 1 - TV itself: tlt_core.drafting.training), so
q = softmax(drafter logits / T) is its best guess of p.
Lossless either way: the verification kernel's sampled-draft rule (residual max(0, p - q))
keeps the emitted tokens exactly the target's distribution, given that each draft token was
drawn from the q it is handed.

Greedy rows (T = 0) draft the argmax with a one-hot q, exactly as the deterministic chain.
Randomness: each row's draft uniforms are Philox draws under the row's own seed, on a counter
stream (offset + DRAFT_STREAM) disjoint from the verifier's (offset), so they are independent
of the uniforms that test them and a row's drafts do not depend on which rows run beside it.
The leaf's q row (no children) is uniform: the kernel reads q only at nodes it tests children
of.

Shapes: B rows, D depth, N = D + 1 nodes, V' draft vocabulary, V target vocabulary, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tlt_core.ops as ops
import tlt_core.ops.draft_sample as sample_draft
from tlt_core.drafting.plan import ChainPlan, DraftContext
from tlt_core.drafting.tree import chain_levels

DRAFT_STREAM = 1 << 40  # Philox counter offset of the draft uniforms (the verifier's: 0..)


@dataclass(frozen=True)
class SampledChain(ChainPlan):
    """D draft tokens per row, each sampled from the drafter's distribution."""

    @property
    def key(self) -> str:
        return f"sampled({self.depth})"

    @property
    def fed_nodes(self) -> int:
        return self.depth - 1

    @property
    def uses_drafter(self) -> bool:
        return True

    def draft(self, context: DraftContext) -> ops.DraftTree:
        check_sampled_context(self.key, context)
        return sampled_chain(context, self.depth)


def check_sampled_context(key: str, context: DraftContext) -> None:
    """A ValueError naming the plan (`key`) when the step has no drafter or no sampling
    parameters, which every sampled plan drafts from."""
    if context.drafter is None:
        raise ValueError(f"strategy: {key} drafts with the learned drafter, and this step has "
                         "none")
    if context.sampling is None:
        raise ValueError(f"strategy: {key} samples its drafts and needs the rows' sampling "
                         "parameters (DraftContext.sampling)")


def sampled_chain(context: DraftContext, depth: int) -> ops.DraftTree:
    drafter, cache, roots = context.drafter, context.drafter_cache, context.roots
    B, device = roots.shape[0], roots.device
    shortest, longest = int(cache.host_lengths.min()), cache.longest()  # host mirror: no sync
    if longest + depth - 1 > cache.shape.max_len:
        raise ValueError(f"strategy: sampled({depth}) drafts {depth - 1} nodes past the "
                         f"drafter cache's {cache.shape.max_len} slots; raise the engine's "
                         "spec_reserve")
    sampling = context.sampling
    temperature = sampling["temperature"].to(torch.float32)  # (B,)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # (B,)
    uniforms = ops.philox_uniforms(sampling["seed"], sampling["offset"] + DRAFT_STREAM,
                                   depth)  # (B, D)
    vocab = drafter.target.config.vocab_size
    draft_probs = torch.empty(B, depth + 1, vocab, dtype=torch.float32, device=device)
    draft_probs[:, depth] = 1.0 / vocab  # the leaf: never read

    def sample(level: int, logits: torch.Tensor) -> torch.Tensor:  # logits (B, V')
        return draw(drafter, logits[:, None], uniforms[:, level, None, None], greedy, scale,
                    draft_probs[:, level:level + 1]).view(B, 1)

    tokens = chain_levels(drafter, cache, context.root_hidden, depth, shortest == longest,
                          longest, sample, context.read_len)
    parents = torch.arange(-1, depth, dtype=torch.int32, device=device).expand(B, depth + 1)
    return ops.DraftTree(torch.cat([roots[:, None]] + tokens, 1), parents.contiguous(),
                         torch.arange(-1, depth, dtype=torch.int32, device=device)
                         .expand(B, depth + 1).contiguous(),
                         torch.full((B,), depth + 1, dtype=torch.int32, device=device),
                         draft_probs)


def draw(drafter, logits: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor,
         scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Draft tokens from the drafter's distribution at R nodes per row: logits (B, R, V'),
    u (B, R, n) uniforms, one per token drawn; greedy (B,) rows take the argmax with a one-hot
    q; scale (B,) the rows' temperatures. Writes q = softmax(logits / scale) over the target's
    ids into out (B, R, V), the q the verifier tests those tokens against, and returns the
    (B, R, n) target ids drawn by inverse CDF. On the CPU one kernel call
    (tlt_core.ops.sample_draft: the same q and draws, to float32 rounding); elsewhere tensor ops
    (a GPU replays the level as a CUDA graph, where ops cost nothing extra)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        B, R, _ = logits.shape
        # each node's row's temperature, 0 for a greedy row (B R,)
        temperature = scale.masked_fill(greedy, 0.0).repeat_interleave(R)
        # q straight into out where its (B R) rows are evenly strided (a chain's level, one
        # row's nodes), else into a new tensor copied over
        flat = out.view(B * R, -1) if R == 1 or B == 1 or out.stride(0) == R * out.stride(1) \
            else None
        # dense rows, as the kernel reads them (u is often a column of the step's uniforms)
        ids, q, status = sample_draft.launch(logits.reshape(B * R, -1).contiguous(),
                                             u.reshape(B * R, -1).contiguous(), temperature,
                                             drafter.draft_to_target, out.shape[-1], flat)
        if bool(status.any()):  # host memory: no sync; the uniforms are Philox's, so: logits
            row = int(torch.nonzero(status)[0, 0]) // R
            raise FloatingPointError(f"drafter logits: row {row} has NaN or +inf (or only "
                                     "-inf); the drafter diverged")
        if flat is None:
            out.copy_(q.view(out.shape))
        return ids.view(B, R, -1)
    return draw_tensor_ops(drafter, logits, u, greedy, scale, out)


def draw_tensor_ops(drafter, logits: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor,
                    scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """draw in tensor ops, on any device (draw's arguments and result)."""
    q = torch.softmax(logits / scale[:, None, None], dim=-1)  # (B, R, V')
    top = logits.argmax(-1, keepdim=True)  # (B, R, 1)
    one_hot = greedy[:, None, None]
    q = torch.where(one_hot, torch.zeros_like(q).scatter_(-1, top, 1.0), q)
    # inverse CDF: the first index whose cumulative mass exceeds u (clamped for rounding)
    cumulative = q.cumsum(-1)
    index = torch.searchsorted(cumulative, u * cumulative[..., -1:], right=True)
    index = torch.where(one_hot, top.expand_as(index), index.clamp_(max=q.shape[-1] - 1))
    if drafter.draft_to_target is None:
        out.copy_(q)
    else:
        out.zero_()
        out.scatter_(-1, drafter.draft_to_target.expand(*q.shape[:-1], -1), q)
    return drafter.to_target_ids(index)
