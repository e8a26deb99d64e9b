"""A learned drafter: what the engine, its fixed-shape passes and the draft plans need of the
model that proposes tokens from the target's features.

A learned drafter is anything with the `LearnedDrafter` protocol. Two ship:
`tlt_core.drafting.drafter.Drafter` (EAGLE-1/2, and EAGLE-3 style fusion over a fc) and
`tlt_core.drafting.eagle3.Eagle3Drafter` (published EAGLE-3 checkpoints, with their own layer,
norm and head). The engine runs either the same way:

- `target` is the model it drafts for; `config.feature_layers` the target layers whose outputs
  form its feature f_t; `fc.weight`'s dtype is the dtype of those features;
- `new_cache(batch, max_len)` its KV cache, `features(target_hidden)` f_t from those layers'
  outputs, and calling it, `drafter(tokens, features, positions, cache, plan=...)`, runs its
  layer over pairs (f_t, x_{t+1}) and returns f' (the position bookkeeping is
  tlt_core.drafting.drafter's);
- `logits(f')` scores its draft vocabulary (`vocab_size` V' wide), `to_target_ids` maps an
  index of it to a target token id, and `draft_to_target` is that map as a (V',) tensor, or
  None when the draft vocabulary is the target's;
- for CUDA graphs (tlt_core.engine.step_graphs): `reserve_positions(bound)` prepares every
  table a pass at positions < bound reads, so a graph never reads one replaced later, and
  `refresh_inference()` brings what the passes read up to date, returning a generation that
  changes only when a tensor they read was replaced (its graphs must then be captured again).

`check_drafter` is where a drafter enters (RolloutEngine): it names the first missing member.

Shapes: B rows, T tokens, H hidden size, V' draft vocabulary.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from tlt_core.model.attention_plan import AttentionPlan
from tlt_core.model.kv_cache import KVCache
from tlt_core.model.transformer import Transformer


@runtime_checkable
class FeatureConfig(Protocol):
    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs form the feature f_t, in the order features() takes."""


@runtime_checkable
class LearnedDrafter(Protocol):
    fc: torch.nn.Linear  # its weight's dtype is the features' dtype
    draft_to_target: torch.Tensor | None  # (V',) target id of each draft index; None: identity

    @property
    def target(self) -> Transformer:
        """The target model whose embedding (and features) the drafter reads."""

    @property
    def config(self) -> FeatureConfig:
        """Its configuration: at least the feature layers."""

    @property
    def vocab_size(self) -> int:
        """V': the width of logits()."""

    def new_cache(self, batch: int, max_len: int, budget_bytes: int | None = None) -> KVCache:
        """An empty cache of `batch` rows and `max_len` slots for the drafter's layer."""

    def features(self, target_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """f_t (..., H) from the target's outputs at config.feature_layers (each (..., H))."""

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache | None = None, *, tree_mask: torch.Tensor | None = None,
                 plan: AttentionPlan | None = None) -> torch.Tensor:
        """f' (B, T, H) over the pairs (features (B, T, H), tokens (B, T)) at positions (B, T)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) drafter outputs -> (..., V') float32 logits over the draft vocabulary."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Indices into logits()'s last dimension -> target token ids."""

    def reserve_positions(self, bound: int) -> None:
        """Prepares what a pass at positions < bound reads (a CUDA graph must not outgrow it)."""

    def refresh_inference(self) -> tuple[int, ...]:
        """Brings what the passes read up to date; a changed result: a tensor was replaced."""


def _members(protocol: type) -> tuple[str, ...]:
    """The names a protocol declares, in order (typing.get_protocol_members from Python 3.13)."""
    declared = list(getattr(protocol, "__annotations__", {})) + list(vars(protocol))
    return tuple(dict.fromkeys(name for name in declared
                               if not name.startswith("_") or name == "__call__"))


def check_drafter(drafter: object, argument: str = "drafter") -> LearnedDrafter:
    """`drafter` if it has every LearnedDrafter member (config's feature_layers included);
    else a TypeError naming `argument` and the first member it lacks."""
    for owner, protocol, prefix in ((drafter, LearnedDrafter, ""),
                                    (getattr(drafter, "config", None), FeatureConfig, "config.")):
        missing = [name for name in _members(protocol) if not hasattr(owner, name)]
        if missing:
            raise TypeError(f"{argument}: {type(drafter).__name__} is not a learned drafter: it "
                            f"has no {prefix}{missing[0]} (tlt_core.drafting.learned."
                            "LearnedDrafter); use Drafter, Eagle3Drafter or load_drafter")
    return drafter
