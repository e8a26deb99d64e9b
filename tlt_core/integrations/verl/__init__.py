"""veRL generating with tlt_core's engine: a rollout backend veRL selects by name
(`actor_rollout_ref.rollout.name: tlt`).

`rollout.py`: the backend (`TLTVerlRollout`, veRL's BaseRollout); `server.py`: the server
replica veRL's agent loop sends requests to (`TLTReplica`, `TLTTokenServer`); `batch.py` and
`token_requests.py`: veRL's batch layout and its per-request sampling, in and out;
`options.py`: its settings under `engine_kwargs.tlt`; `registration.py`: its entries in veRL's
registries. Only rollout.py, server.py and registration.py import veRL, so this package imports
without it.
"""

from tlt_core.integrations.verl.batch import (PromptBatch, VerlSampling, left_padded_prompts,
                                              read_prompts, read_sampling, response_tensors)
from tlt_core.integrations.verl.options import TLTRolloutOptions

__all__ = ["PromptBatch", "TLTRolloutOptions", "VerlSampling", "left_padded_prompts",
           "read_prompts", "read_sampling",
           "response_tensors"]
