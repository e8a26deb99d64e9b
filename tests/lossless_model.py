"""Exact analysis of tree speculative sampling on a toy vocabulary: the oracle for the
losslessness invariant (DESIGN.md, "Lossless, sampled").

A toy language: V tokens, and for every context (tuple of tokens) a fixed target logit row and a
fixed draft distribution q_draft, both pseudo-random functions of the context. The target
distribution p_target(. | ctx) is those logits after temperature / top-k / top-p (the reference's
processed_target_probs). One verification step on a tree emits a token sequence of random
length; "lossless" means that continuing it with target samples up to a fixed length L gives
exactly the target's distribution over V^L. `exact_emission` computes the emission
distribution by walking the verifier's decisions with probabilities instead of uniforms (and, for
sampled drafts, integrating over the draft tokens), so the check is exact up to float64 rounding.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tlt_core.ops import reference


@dataclass(frozen=True)
class ToyLanguage:
    vocab: int
    temperature: float
    top_k: int
    top_p: float
    seed: int = 0

    def logits(self, context: tuple[int, ...]) -> torch.Tensor:
        """(V,) float32 target logits for a context: sharp enough that trees get accepted."""
        return 2.0 * _gaussian(self.vocab, (self.seed, 0) + context)

    @functools.lru_cache(maxsize=None)
    def p_target(self, context: tuple[int, ...]) -> np.ndarray:
        """(V,) float64 processed target distribution, as the kernels compute it."""
        w, _ = reference.processed_target_probs(
            self.logits(context)[None], self.temperature, self.top_k, self.top_p)
        w = w[0].double()
        return (w / w.sum()).numpy()

    @functools.lru_cache(maxsize=None)
    def q_draft(self, context: tuple[int, ...]) -> np.ndarray:
        """(V,) float32-exact draft distribution: close to, but not equal to, p_target."""
        noisy = self.logits(context) + 1.5 * _gaussian(self.vocab, (self.seed, 1) + context)
        q = torch.softmax(noisy.double(), dim=-1).float().double()  # what a kernel is handed
        return (q / q.sum()).numpy()

    def sequence_probs(self, context: tuple[int, ...], length: int) -> dict[tuple, float]:
        """P_target(s) for every s in V^length after `context`."""
        probs = {}
        for seq in itertools.product(range(self.vocab), repeat=length):
            prob = 1.0
            for i, token in enumerate(seq):
                prob *= self.p_target(context + seq[:i])[token]
            probs[seq] = prob
        return probs


def _gaussian(size: int, key: tuple[int, ...]) -> torch.Tensor:
    # Tuples of ints hash identically in every process (strings would not).
    generator = torch.Generator().manual_seed(hash(key) % (2**31))
    return torch.randn(size, generator=generator)


Residual = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


def correct_residual(w: np.ndarray, q: np.ndarray, total: float) -> np.ndarray:
    return np.maximum(0.0, w - q * total)


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        kids[parent].append(node)
    return kids


def exact_emission(lang: ToyLanguage, context: tuple[int, ...], parents: list[int],
                   tokens: Optional[list[int]] = None, *, residual: Residual = correct_residual,
                   zero_rejected: bool = True) -> dict[tuple, float]:
    """Probability of each emitted sequence of one verification step.

    tokens given: deterministic drafts (q one-hot at each node's token). tokens None: sampled
    drafts, each child of node v drawn i.i.d. from q_draft(context of v), integrated exactly.
    zero_rejected=False / a wrong residual are the mutations the tests must catch.
    """
    kids = children_of(parents)
    emitted: dict[tuple, float] = {}

    def visit(node: int, prefix: tuple[int, ...], prob: float) -> None:
        w = lang.p_target(context + prefix).copy()
        total = w.sum()
        q = None if tokens is not None else lang.q_draft(context + prefix)
        for child in kids[node]:
            if tokens is not None:
                x = tokens[child]
                accept = min(1.0, w[x] / total) if total > 0 else 0.0
                if accept > 0:
                    visit(child, prefix + (x,), prob * accept)
                prob *= 1.0 - accept
                if zero_rejected:
                    total -= w[x]
                    w[x] = 0.0
            else:
                reject = 0.0
                for x in range(lang.vocab):
                    if q[x] == 0:
                        continue
                    accept = min(1.0, (w[x] / total) / q[x])
                    if accept > 0:
                        visit(child, prefix + (x,), prob * q[x] * accept)
                    reject += q[x] * (1.0 - accept)
                prob *= reject
                new_w = residual(w, q, total)
                if new_w.sum() > 0:
                    w, total = new_w, new_w.sum()
            if prob <= 0:
                return
        for y in range(lang.vocab):
            if w[y] > 0:
                emitted[prefix + (y,)] = emitted.get(prefix + (y,), 0.0) + prob * w[y] / total

    visit(0, (), 1.0)
    return emitted


def completed_distribution(lang: ToyLanguage, context: tuple[int, ...],
                           emitted: dict[tuple, float], length: int) -> dict[tuple, float]:
    """Distribution over V^length of an emitted sequence continued with target samples."""
    out = {seq: 0.0 for seq in itertools.product(range(lang.vocab), repeat=length)}
    for seq in out:
        for j in range(1, length + 1):
            prob = emitted.get(seq[:j], 0.0)
            if prob == 0.0:
                continue
            for i in range(j, length):
                prob *= lang.p_target(context + seq[:i])[seq[i]]
            out[seq] += prob
    return out


def complete_samples(lang: ToyLanguage, context: tuple[int, ...], sequences: list[tuple],
                     length: int, rng: np.random.Generator) -> list[tuple]:
    """Continue each emitted sequence with target samples up to `length` tokens."""
    out = []
    for seq in sequences:
        seq = tuple(seq)
        while len(seq) < length:
            seq = seq + (int(rng.choice(lang.vocab, p=lang.p_target(context + seq))),)
        out.append(seq[:length])
    return out
