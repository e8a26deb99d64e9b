"""The losses of the policy update and of the critic, the KL estimators, the loss aggregation
modes, and the log-probs the trainer recomputes.

Notation: B sequences of a micro-batch, T response positions (right-padded; `mask` marks the
tokens that count); the mini-batch is what one optimizer step sees.

- aggregation (veRL's `loss_agg_mode`): a token loss l_t becomes the mini-batch's loss
  sum_t w_t l_t with weights from the whole mini-batch (so micro-batches and ranks add up):
      token-mean               w = 1 / #tokens                      (DAPO; TRL "dapo"/"bnpo")
      seq-mean-token-mean      w = 1 / (#sequences len_i)           (GRPO paper; TRL "grpo")
      seq-mean-token-sum       w = 1 / #sequences
      seq-mean-token-sum-norm  w = 1 / (#sequences max_new_tokens)  (Dr. GRPO; TRL "dr_grpo")
- policy loss, with ratio_t = exp(logp_t - old_logp_t) and clip-higher's asymmetric range:
      l_t = -min(ratio_t A_t, clip(ratio_t, 1 - epsilon_low, 1 + epsilon_high) A_t)
  (+ kl_coef kl_t when the KL is a loss term). At ratio 1 its gradient is REINFORCE's,
  -sum_t w_t A_t grad logp_t.
- KL estimators of KL(policy || reference) per token, with d = ref_t - logp_t (Schulman's):
      k1 = -d,  k2 = d^2 / 2,  k3 = exp(d) - d - 1 (>= 0, low variance; TRL's, veRL's
      "low_var_kl").
- value loss (PPO's critic), clipped around the values of the rollout's critic:
      l_t = max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2) / 2.
- `old_logp` comes from the rollout (the engine returns each token's log-prob under the
  distribution it sampled from) or the trainer's own pass before updating; the trainer logs the
  largest gap between the two: speculative decoding is lossless, so in float32 it is ~0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_weights(mask: torch.Tensor, mode: str, *, batch_tokens: float, batch_sequences: int,
                  max_new_tokens: int) -> torch.Tensor:
    """mask (B, T) of a micro-batch -> its tokens' weights w (B, T) in the mini-batch's loss
    (module docstring), given the mini-batch's counted tokens and sequences."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: must be one of {LOSS_AGG_MODES}, got {mode!r}")
    mask = mask.float()
    if mode == "token-mean":
        return mask / max(batch_tokens, 1.0)
    sequences = max(batch_sequences, 1)
    if mode == "seq-mean-token-mean":
        return mask / (mask.sum(dim=1, keepdim=True).clamp(min=1) * sequences)
    if mode == "seq-mean-token-sum":
        return mask / sequences
    return mask / (sequences * max_new_tokens)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3"
                ) -> torch.Tensor:
    """Per-token estimates of KL(policy || reference) from the sampled tokens' log-probs."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: must be one of {KL_ESTIMATORS}, got {estimator!r}")
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # what to backpropagate: sum_t w_t l_t
    policy_loss: float  # the clipped-surrogate part of it (KL excluded)
    kl_sum: float  # sum of the KL estimate over counted tokens (0 without a KL loss term)
    clipped_tokens: float  # counted tokens whose clipped term was the smaller one
    tokens: float  # counted tokens


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                  ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                  kl_estimator: str = "k3") -> LossParts:
    """logp, old_logp, ref_logp, weights (B, T) (token_weights; zero where a token does not
    count); advantages (B,) or (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    counted = (weights > 0).to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages
    policy_loss = -(torch.minimum(unclipped, clipped) * weights).sum()
    loss, kl_sum = policy_loss, 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * (kl * weights).sum()
        kl_sum = float((kl.detach() * counted).sum())
    return LossParts(loss, float(policy_loss.detach()), kl_sum,
                     float(((clipped < unclipped).to(logp.dtype) * counted).sum()),
                     float(counted.sum()))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               weights: torch.Tensor, cliprange_value: float) -> tuple[torch.Tensor, float]:
    """(sum_t w_t l_t, counted tokens where the clipped error was the larger one), all (B, T)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    plain_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(plain_error, clipped_error) * weights).sum()
    return loss, float(((clipped_error > plain_error) & (weights > 0)).sum())


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
