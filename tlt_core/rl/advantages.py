"""Advantages: GRPO's group-relative ones (with the reward scalings of Dr. GRPO and TRL), PPO's
GAE over a critic's values, the batch whitening PPO applies, DAPO's soft overlong penalty and
dynamic sampling's test of a group.

Notation: G groups (prompts) of n samples; a response has T tokens t = 0 .. T-1; the reward of
a response arrives at its last token.

- group advantages (one number per sample, the same for every token of it):
      A_i = (r_i - mean(r_group)) / scale,  scale = std(r_group) + eps   ("group", GRPO)
                                                   std(r_batch) + eps   ("batch", TRL's option)
                                                   1                    ("none", Dr. GRPO)
  (population std). A group whose rewards are all equal gets A = 0 under every scaling.
- GAE (Schulman et al. 2016), per response, with V_T = 0 after the last token:
      delta_t = r_t + gamma V_{t+1} - V_t,  A_t = sum_l (gamma lam)^l delta_{t+l},
      returns R_t = A_t + V_t (the critic's regression target).
  With gamma = lam = 1 and V = 0, A_t = R_t = sum_{s >= t} r_s: REINFORCE with the return.
- soft overlong penalty (DAPO): with L_max = max_new_tokens and a buffer of L_buf tokens,
      penalty(L) = 0 for L <= L_max - L_buf,  -factor (L - (L_max - L_buf)) / L_buf  beyond.
"""

from __future__ import annotations

import torch

REWARD_SCALINGS = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6
                     ) -> torch.Tensor:
    """rewards (G, n) -> advantages (G, n), scaled as the module docstring says."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected (groups, samples), got {tuple(rewards.shape)}")
    if scale not in REWARD_SCALINGS:
        raise ValueError(f"scale_rewards: must be one of {REWARD_SCALINGS}, got {scale!r}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        return centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    if scale == "batch":
        return centered / (rewards.std(unbiased=False) + eps)
    return centered


def varied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (G, n) -> (G,) bool: the groups whose rewards are not all equal, the ones with a
    learning signal (dynamic sampling keeps these and drops the rest)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected (groups, samples), got {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One response's token rewards and values (T,) -> (advantages (T,), returns (T,)), float32;
    the response ends after its last token (V_T = 0)."""
    if rewards.shape != values.shape or rewards.dim() != 1:
        raise ValueError(f"rewards, values: expected two (T,) tensors, got "
                         f"{tuple(rewards.shape)} and {tuple(values.shape)}")
    # Python floats (double precision): a long response sums many terms, and a loop over tensor
    # elements would cost a dispatch per token
    r, v = rewards.tolist(), values.tolist()
    advantages = [0.0] * len(r)
    running, next_value = 0.0, 0.0
    for t in range(len(r) - 1, -1, -1):
        running = r[t] + gamma * next_value - v[t] + gamma * lam * running
        advantages[t] = running
        next_value = v[t]
    returns = [a + b for a, b in zip(advantages, v)]
    return (torch.tensor(advantages, dtype=torch.float32),
            torch.tensor(returns, dtype=torch.float32))


def whiten(values: torch.Tensor, count: float, total: float, total_squares: float,
           eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over a whole batch whose `count` elements sum to `total` and
    whose squares sum to `total_squares` (the sums may come from every rank)."""
    if count < 1:
        raise ValueError(f"count: need at least one value to whiten, got {count}")
    mean = total / count
    variance = max(total_squares / count - mean * mean, 0.0)
    return (values - mean) / (variance ** 0.5 + eps)


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong penalty of a response of `length` tokens (<= 0; 0 with buffer_len
    0)."""
    if buffer_len <= 0:
        return 0.0
    expected = max_new_tokens - buffer_len
    return -factor * min(max(length - expected, 0), buffer_len) / buffer_len
