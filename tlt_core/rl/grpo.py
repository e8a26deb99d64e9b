"""GRPO's math: group-normalized advantages, the token-level PPO-clip loss with an optional KL
penalty to a frozen reference, and the log-probs the trainer recomputes.

Notation: G groups (prompts) of n samples; B = G n sequences; T response positions (right-
padded, `mask` marks real tokens).

- advantages: A_i = (r_i - mean(r_group)) / (std(r_group) + eps) (population std), the same for
  every token of sample i; a group whose rewards are all equal gets A = 0 (nothing to learn).
- loss: with ratio_t = exp(logp_t - old_logp_t),
      L = -(1/#tokens) sum_t min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A)
          + kl_coef (1/#tokens) sum_t k3_t,   k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
  (token-level averaging over the whole mini-batch, as DAPO and TRL's default; k3 is the
  low-variance, always >= 0 estimator of KL(policy || reference)). At ratio 1 its gradient is
  the REINFORCE gradient -(1/#tokens) sum_t A grad logp_t.
- `old_logp` comes from the rollout (the engine returns each token's log-prob under the
  distribution it sampled from); the trainer recomputes them before updating and logs the
  largest gap: speculative decoding is lossless, so it must be ~0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards (G, n) -> advantages (G, n)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected (groups, samples), got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return (rewards - mean) / (std + eps)


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float  # share of tokens where the clipped term was the smaller one


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> LossParts:
    """logp, old_logp, ref_logp, mask (B, T); advantages (B,) or (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    mask = mask.to(logp.dtype)
    tokens = mask.sum().clamp(min=1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    policy_loss = -(surrogate * mask).sum() / tokens
    loss, kl_value = policy_loss, 0.0
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        k3 = (torch.exp(delta) - delta - 1) * mask
        kl = k3.sum() / tokens
        loss = loss + kl_coef * kl
        kl_value = float(kl.detach())
    clip_fraction = float(((clipped < unclipped).to(logp.dtype) * mask).sum() / tokens)
    return LossParts(loss, float(policy_loss.detach()), kl_value, clip_fraction)


def response_logprobs(model, sequences: torch.Tensor, prompt_lengths: torch.Tensor,
                      response_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_t | x_<t) of every response token under model at temperature, (B, T_resp).

    sequences (B, L) = prompt + response, right-padded; prompt_lengths (B,); response_mask
    (B, T_resp) marks real response tokens. One forward over the full sequences (with autograd
    when enabled)."""
    B, L = sequences.shape
    positions = torch.arange(L, device=sequences.device).expand(B, L)
    logits = model(sequences, positions).logits.float()  # (B, L, V)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # predicts x_1 .. x_{L-1}
    T = response_mask.shape[1]
    index = (prompt_lengths[:, None] - 1 + torch.arange(T, device=sequences.device)).clamp(max=L - 2)
    targets = sequences.gather(1, (index + 1).clamp(max=L - 1))
    chosen = logp_all.gather(1, index[..., None].expand(B, T, logp_all.shape[-1]))
    return chosen.gather(2, targets[..., None])[..., 0] * response_mask
