"""The tlt rollout in veRL's two registries, so that `actor_rollout_ref.rollout.name: tlt`
selects it (veRL 0.9):

- the rollout registry, read by `verl.workers.rollout.base.get_rollout_class(name, mode)` on
  every rollout worker, which imports the class it names (mode is "async", the only one veRL
  keeps): the TLTVerlRollout that holds the model. veRL offers no function to add to it: the
  module-level dict `_ROLLOUT_REGISTRY` is what get_rollout_class reads, so register() writes
  it.
- `RolloutReplicaRegistry`, where veRL's agent loop (the PPO trainer's generation path) looks up
  the server replica of the rollout's name: TLTReplica (server.py), loaded on first use.

Importing this module registers: that is what veRL's plugin hooks do with a module, both the
`verl.plugins` entry points it loads at `import verl` and VERL_USE_EXTERNAL_MODULES
(`VERL_USE_EXTERNAL_MODULES=tlt_core.integrations.verl.registration`). `register()` is the same
step, for a caller that imports it before building veRL's workers.
"""

from __future__ import annotations

import importlib

ROLLOUT_NAME = "tlt"
ROLLOUT_MODE = "async"
ROLLOUT_CLASS = "tlt_core.integrations.verl.rollout.TLTVerlRollout"
# By path, as veRL names ROLLOUT_CLASS: server.py subclasses veRL's classes, and veRL imports
# this module while `import verl` runs, so importing server.py here would be circular.
REPLICA_MODULE, REPLICA_CLASS = "tlt_core.integrations.verl.server", "TLTReplica"


def load_replica_class() -> type:
    """TLTReplica; RolloutReplicaRegistry calls this when a trainer asks for "tlt"."""
    return getattr(importlib.import_module(REPLICA_MODULE), REPLICA_CLASS)


def register() -> None:
    """Adds the tlt rollout to both registries (again: no change)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, ROLLOUT_MODE)] = ROLLOUT_CLASS
    RolloutReplicaRegistry.register(ROLLOUT_NAME, load_replica_class)


register()
