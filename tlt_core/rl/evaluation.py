"""Held-out evaluation: pass@k from n samples per prompt, and a pass's summary.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of a prompt of which c
pass, the chance that k of them drawn without replacement hold at least one pass,
    pass@k = 1 - C(n - c, k) / C(n, k),
averaged over prompts. A sample passes when its reward is at least `pass_threshold` (1 for the
math verifier: a correct answer; its format bonus alone does not pass).
"""

from __future__ import annotations

from math import comb
from typing import Sequence

PASS_AT_K = (1, 2, 4, 8, 16, 32, 64)  # the k reported; eval_samples bounds which apply


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n samples, c of which pass, hold at least one pass."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise ValueError(f"n, c, k: must be ints, got {n!r}, {c!r}, {k!r}")
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluation_metrics(rewards: Sequence[Sequence[float]], pass_threshold: float = 1.0
                       ) -> dict[str, float | None]:
    """rewards[prompt][sample] (n samples each) -> {"eval/reward": mean reward,
    "eval/pass@k": mean pass@k for each k of PASS_AT_K (None where k > n)}."""
    if not rewards or any(len(group) != len(rewards[0]) or not group for group in rewards):
        raise ValueError("rewards: need the same number (>= 1) of samples for every prompt")
    n = len(rewards[0])
    passes = [sum(r >= pass_threshold for r in group) for group in rewards]
    out: dict[str, float | None] = {
        "eval/reward": sum(map(sum, rewards)) / (n * len(rewards))}
    for k in PASS_AT_K:
        out[f"eval/pass@{k}"] = (sum(pass_at_k(n, c, k) for c in passes) / len(passes)
                                 if k <= n else None)
    return out
