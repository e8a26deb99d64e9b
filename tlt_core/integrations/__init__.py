"""Adapters that plug tlt_core into other frameworks. Each imports its framework only when used:
`tlt_core.integrations.trl` needs TRL (not a dependency of tlt_core)."""

from __future__ import annotations

__all__ = ["TLTRollout", "RolloutCall", "transformer_from_hf"]


def __getattr__(name: str):
    if name in __all__:
        from tlt_core.integrations import trl

        return getattr(trl, name)
    raise AttributeError(f"module 'tlt_core.integrations' has no attribute {name!r}")
