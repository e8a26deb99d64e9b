"""The drafter's warm-up: offline EAGLE training on the target's own responses before RL starts
(`tlt drafter train`), for any checkpoint.

`offline.py` runs it (`train_offline`: responses, draft vocabulary, training, held-out
acceptance, the drafter saved with its provenance, all resumable from its work folder). It
builds on the engine, drafting and the harvest; it knows nothing of rewards or the policy
update (tlt_core.rl).
"""

from tlt_core.warmup.offline import (EVAL_STRATEGIES, OfflineConfig, OfflineReport, float32_twin,
                                     held_out_acceptance, train_offline)

__all__ = ["EVAL_STRATEGIES", "OfflineConfig", "OfflineReport", "float32_twin",
           "held_out_acceptance", "train_offline"]
