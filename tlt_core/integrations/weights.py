"""A trainer's weights into the engine's target, in Hugging Face naming: what every adapter's
weight sync does (TRL's model state_dict, veRL's stream of (name, tensor) pairs).

The names map 1:1 onto a tlt_core Transformer's (as in tlt_core.model.checkpoint); a tied
`lm_head.weight` may be absent (it is the embedding). Each tensor is copied into the target's
parameter in place as it arrives: a streamed tensor may be a view of a buffer the sender reuses
for the next one, and the in-place copy is what the target's packed inference weights and the
drafter (which reads the target's embedding, norm and head) follow. Every name and shape is
checked before anything is written, for a mapping; for a stream, each tensor before its copy
and the set of names at the end.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from tlt_core.model.transformer import Transformer

TIED_HEAD = "lm_head.weight"
SHOW_NAMES = 3  # names listed in an error before "..."


def load_hf_weights(target: Transformer,
                    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    *, source: str = "weights", strict: bool = True) -> int:
    """Copies weights (a state_dict, or (name, tensor) pairs in any order) into target's
    parameters in place; returns the number of tensors copied. source names the sender in
    errors. Raises ValueError naming the tensor for a shape mismatch, for a name the target
    lacks (strict; strict=False skips it, as load_state_dict does), and naming the missing
    ones when the weights did not cover the target."""
    wanted = target.state_dict()  # name -> the parameter's tensor (tied head: the embedding)
    optional = {TIED_HEAD} if target.config.tie_word_embeddings else set()
    if isinstance(weights, Mapping):
        pairs = [(name, tensor) for name, tensor in weights.items()
                 if strict or name in wanted]
        for name, tensor in pairs:  # all checked before the first copy
            _check(name, tensor, wanted, source)
        _check_complete({name for name, _ in pairs}, wanted, optional, source)
    else:
        pairs = weights
    seen = set()
    with torch.no_grad():
        for name, tensor in pairs:
            if not strict and name not in wanted:
                continue
            _check(name, tensor, wanted, source)
            wanted[name].copy_(tensor)
            seen.add(name)
    _check_complete(seen, wanted, optional, source)
    return len(seen)


def _check(name: str, tensor: torch.Tensor, wanted: dict[str, torch.Tensor], source: str) -> None:
    if name not in wanted:
        raise ValueError(f"{source}: {name!r} names no tensor of the engine's target; is it "
                         "the same architecture, in Hugging Face naming?")
    if tuple(tensor.shape) != tuple(wanted[name].shape):
        raise ValueError(f"{source}: {name} is {tuple(tensor.shape)}, the engine's target's is "
                         f"{tuple(wanted[name].shape)}")


def _check_complete(seen: set[str], wanted: dict[str, torch.Tensor], optional: set[str],
                    source: str) -> None:
    missing = [name for name in wanted if name not in seen and name not in optional]
    if missing:
        more = ", ..." if len(missing) > SHOW_NAMES else ""
        raise ValueError(f"{source}: lacks {len(missing)} tensor(s) the engine's target needs: "
                         f"{', '.join(missing[:SHOW_NAMES])}{more}")
