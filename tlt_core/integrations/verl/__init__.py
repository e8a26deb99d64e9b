"""veRL generating with tlt_core's engine: a rollout backend veRL selects by name
(`actor_rollout_ref.rollout.name: tlt`).

`rollout.py`: the backend (`TLTVerlRollout`, veRL's BaseRollout); `batch.py`: veRL's batch
layout in and out; `options.py`: its settings under `engine_kwargs.tlt`; `registration.py`:
its entry in veRL's registry. Only rollout.py and registration.py import veRL, so this package
imports without it.
"""

from tlt_core.integrations.verl.batch import (PromptBatch, VerlSampling, read_prompts,
                                              read_sampling, response_tensors)
from tlt_core.integrations.verl.options import TLTRolloutOptions

__all__ = ["PromptBatch", "TLTRolloutOptions", "VerlSampling", "read_prompts", "read_sampling",
           "response_tensors"]
