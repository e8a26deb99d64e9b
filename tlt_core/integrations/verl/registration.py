"""The tlt rollout in veRL's rollout registry, so that `actor_rollout_ref.rollout.name: tlt`
selects it (veRL 0.9: `verl.workers.rollout.base.get_rollout_class(name, mode)` looks
(name, mode) up and imports the class it names; mode is "async", the only one veRL keeps). veRL offers no function to add to that registry: the
module-level dict `_ROLLOUT_REGISTRY` is what get_rollout_class reads, so register() writes it.

Importing this module registers: that is what veRL's plugin hooks do with a module, both the
`verl.plugins` entry points it loads at `import verl` and VERL_USE_EXTERNAL_MODULES
(`VERL_USE_EXTERNAL_MODULES=tlt_core.integrations.verl.registration`). `register()` is the same
step, for a caller that imports it before building veRL's workers.
"""

from __future__ import annotations

ROLLOUT_NAME = "tlt"
ROLLOUT_MODE = "async"
ROLLOUT_CLASS = "tlt_core.integrations.verl.rollout.TLTVerlRollout"


def register() -> None:
    """Adds (ROLLOUT_NAME, ROLLOUT_MODE) -> ROLLOUT_CLASS to veRL's rollout registry (again:
    no change)."""
    from verl.workers.rollout import base

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, ROLLOUT_MODE)] = ROLLOUT_CLASS


register()
