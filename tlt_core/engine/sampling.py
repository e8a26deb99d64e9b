"""Sampling in the engine: the verification kernel on root-only trees, and per-sample seeds.

Sampling is `tlt_core.ops.verify_tree_sampling` on a one-node tree (the root alone): the same
code, and the same temperature / top-k / top-p math, that speculative verification uses. Each
sample has its own Philox stream (seed) and uses uniform index = tokens generated so far, so a
sample's tokens do not depend on what else is in the batch.

Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

import hashlib

import torch

import tlt_core.ops as ops


def sample_seed(base: int, request_index: int, sample_index: int) -> int:
    """A 63-bit seed per sample, stable across runs and batch compositions."""
    digest = hashlib.blake2b(f"{base}/{request_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def sample_roots(logits: torch.Tensor, roots: torch.Tensor, *, temperature, top_k, top_p, seed,
                 offset) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token and its target log-prob for each row: logits (B, V) at each row's last
    position, roots (B,) its last token, the per-row sampling tensors (B,) of RowState.sampling.
    Returns tokens (B,) int64 and logprobs (B,) float32. A row whose logits hold NaN or +inf
    gets token -1: pass the tokens, once on the host, to check_emitted."""
    batch = logits.shape[0]
    # Parameters are validated once in SamplingParams; the kernel flags a bad row with token
    # -1, checked by the caller on its host copy instead of a validation pass here (a sync).
    out = ops.verify_tree_sampling(
        logits[:, None, :].contiguous(), roots[:, None],
        torch.full((batch, 1), -1, dtype=torch.int32, device=logits.device),
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
        validate=False)
    return out.emitted_tokens[:, 0], out.emitted_logprobs[:, 0]  # (B,), (B,)


def check_emitted(first_tokens: list[int]) -> None:
    """Raises if the kernel flagged a row (token -1: NaN or +inf logits); first_tokens: each
    row's first emitted token, on the host."""
    for row, token in enumerate(first_tokens):
        if token < 0:
            raise FloatingPointError(f"logits: row {row} has NaN or +inf logits; the model "
                                     "diverged")
