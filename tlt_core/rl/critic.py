"""PPO's critic: a value model beside the policy, V(prefix) for every response position.

The critic is a separate model, not a head on the policy's trunk: the engine decodes and
`tlt train` exports exactly the policy's weights, so the value loss's gradients must not move
them (a shared trunk would also need a value-loss coefficient balancing two objectives in one
set of weights). It starts as a copy of the policy's decoder stack (embeddings, the first
`layers` decoder layers, the final norm: a model that already reads the task's text, as veRL and
OpenRLHF initialise theirs from the policy) with a zero-initialised scalar head, so it predicts
V = 0 until it has trained. Fewer layers make it cheaper; the rollout, most of a step, never
runs it.

V_t is read at the position whose logits predict response token t: the state before the token
(the prompt and response tokens < t).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tlt_core.model.attention_plan import attention_plan
from tlt_core.model.transformer import Transformer


class ValueModel(nn.Module):
    """A decoder stack copied from `policy` (its first `layers` layers; None: all) and a scalar
    head, in the policy's dtype and device."""

    def __init__(self, policy: nn.Module, layers: int | None = None):
        super().__init__()
        if not isinstance(policy, Transformer):
            raise ValueError(f"policy: PPO's critic is built from a tlt_core Transformer, got "
                             f"{type(policy).__name__}; use algorithm 'grpo' for this policy")
        total = policy.config.num_layers
        if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool)
                                   or not 1 <= layers <= total):
            raise ValueError(f"critic_layers: must be between 1 and the policy's {total} layers, "
                             f"got {layers!r}")
        self.trunk = copy.deepcopy(policy.model)
        if layers is not None:
            self.trunk.layers = self.trunk.layers[:layers]
        weight = policy.lm_head.weight
        self.value_head = nn.Linear(policy.config.hidden_size, 1, device=weight.device,
                                    dtype=weight.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.trunk.requires_grad_(True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (B, L) -> values (B, L) float32: V at each prefix ending there."""
        plan = attention_plan(input_ids.shape, None, None, input_ids.device)
        cos, sin = self.trunk.rotary_emb(positions, self.value_head.weight.dtype)
        h = self.trunk.embed_tokens(input_ids)  # (B, L, H)
        for layer in self.trunk.layers:
            h = layer.forward(h, cos, sin, plan, None)
        return self.value_head(self.trunk.norm.forward(h))[..., 0].float()


def response_values(critic: nn.Module, sequences: torch.Tensor, prompt_lengths: torch.Tensor,
                    response_mask: torch.Tensor) -> torch.Tensor:
    """V_t of every response position (B, T_resp), zero past a response's end; sequences (B, L)
    = prompt + response, right-padded (as losses.response_logprobs takes them)."""
    B, L = sequences.shape
    positions = torch.arange(L, device=sequences.device).expand(B, L)
    values = critic(sequences, positions)  # (B, L)
    T = response_mask.shape[1]
    index = (prompt_lengths[:, None] - 1 + torch.arange(T, device=sequences.device)).clamp(max=L - 1)
    return values.gather(1, index) * response_mask
