"""The drafter unrolled over its own outputs, exactly as drafting runs it: the forward pass of
the training-time test (EAGLE-3, arXiv 2503.01840; HASS, arXiv 2408.15766) that
`tlt_core.drafting.training.unrolled_loss` trains.

Teacher-forced training hands the drafter the target's feature f_t at every position, but a
chain draft (tlt_core.drafting.tree.chain_levels) from root pair t — the drafter cache holding
the committed pairs (f_s, x_{s+1}) for s <= t — feeds each later level the drafter's own output
in place of a feature. `unrolled_forward` replays that draft at every root t of a sequence at
once, with the sequence's own tokens in place of the drafted ones:

    step 1: (f_t,          x_{t+1}) at position t          the committed pair at t
    step k: (g^(k-1)_t,    x_{t+k}) at position t + k - 1  level k - 1 of the chain from t

g^(k-1)_t is step k - 1's output at t, fed back as it is (both forms: chain_levels applies no
norm or projection to it). Step k's output is the drafter's guess of the target's feature at
t + k; its logits are its distribution of x_{t+k+1}.

Attention is the drafter cache's during that draft: step k at root t sees step 1's keys at
roots s <= t (the committed pairs) and the keys of steps 2..k at its own root (the levels fed
before it, and itself), nothing of another root's later steps, which a draft from t never
wrote:

    keys of:     step 1          step 2          ...   step k
    query t:     s <= t          s == t                s == t

The keys of every step so far are one (B, H_kv, k P, d) tensor per step: the previous step's
copied with room for this step's (never written in place once read, so autograd keeps what
earlier steps attended). Step 1 is causal with no mask, as the teacher-forced pass is; later
steps pass a boolean mask over k P keys, so their attention costs k times step 1's where a
causal kernel would skip half (fine at the drafter's lengths; the layer and the head dominate).

Shapes: B rows, T positions, P = T - 1 pairs (roots), H hidden, H_kv key/value heads, d head
dimension.
"""

from __future__ import annotations

import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.model.attention_plan import AttentionPlan


def check_unroll(unroll: object) -> int:
    """`unroll` if it is an int >= 1 (1: the teacher-forced EAGLE loss alone), else a
    ValueError naming it."""
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(f"unroll: must be an int >= 1 (drafting steps trained on the drafter's "
                         f"own outputs; 1 is the teacher-forced EAGLE loss), got {unroll!r}")
    return unroll


def unrolled_forward(drafter: Drafter, tokens: torch.Tensor, features: torch.Tensor,
                     unroll: int) -> list[torch.Tensor]:
    """tokens (B, T) int64: x_0 .. x_{T-1}; features (B, P, H): f_t for t < P (drafter.features
    of the target's outputs). Returns `unroll` tensors (B, P, H), step k's outputs at every root
    t (module docstring). Where t + k > T - 1 there is no token x_{t+k}: the step is fed token 0
    and its output there is meaningless (the loss masks it); no valid root attends to it."""
    check_unroll(unroll)
    B, T = tokens.shape
    P, device = T - 1, tokens.device
    roots = torch.arange(P, device=device)  # (P,)
    config = drafter.target.config
    no_keys = features.new_zeros(B, config.num_kv_heads, 0, config.head_dim)
    keys, values = no_keys, no_keys  # (B, H_kv, (k - 1) P, d): the earlier steps'
    fed, outputs = features, []  # fed: (B, P, H), g^(k-1)
    for step in range(1, unroll + 1):
        room = features.new_zeros(B, config.num_kv_heads, P, config.head_dim)  # step k's slots
        keys, values = torch.cat((keys, room), dim=2), torch.cat((values, room), dim=2)
        next_tokens = torch.cat((tokens[:, step:], tokens.new_zeros(B, step - 1)), 1)  # (B, P)
        positions = (roots + step - 1).expand(B, P)  # (B, P): t + k - 1
        plan = AttentionPlan(_step_mask(step, P, device, B), ((step - 1) * P + roots).expand(B, P),
                             step * P)
        # Gradients flow through `fed` (as in EAGLE-3): step k's loss also trains step k - 1 to
        # emit a feature the next level drafts well from, not only one near the target's, and
        # that is the point of training on its own outputs.
        fed = drafter.forward_over_keys(next_tokens, fed, positions, plan, (keys, values))
        outputs.append(fed)
    return outputs


def _step_mask(step: int, P: int, device: torch.device, B: int) -> torch.Tensor | None:
    """(B, 1, P, step P) bool: query t of `step` sees step 1's keys at s <= t and its own root's
    keys of steps 2..step; None (causal) for step 1."""
    if step == 1:
        return None
    committed = torch.ones(P, P, dtype=torch.bool, device=device).tril()  # (P, P)
    own_root = torch.eye(P, dtype=torch.bool, device=device)  # (P, P)
    mask = torch.cat((committed,) + (own_root,) * (step - 1), dim=1)  # (P, step P)
    return mask.expand(B, 1, P, step * P)
