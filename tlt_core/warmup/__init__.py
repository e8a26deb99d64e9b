"""The drafter's warm-up: offline EAGLE training on the target's own responses before RL starts
(`tlt drafter train`), for any checkpoint.

`offline.py` runs it (`train_offline`: responses, draft vocabulary, training, held-out
acceptance, the drafter saved with its provenance); `config.py` its settings; `work_folder.py`
the resumable cache it keeps under `out/work/`; `responses.py` phase 1, the target's responses
and their hidden states; `draft_vocabulary.py` phase 2, the reduced vocabulary;
`training_loop.py` phase 3, the resumable training and the loop the embedded drafter shares;
`acceptance.py` the held-out acceptance length, greedy and at T = 1. It builds on the engine,
drafting and the harvest; it knows nothing of rewards or the policy update (tlt_core.rl).
"""

from tlt_core.warmup.acceptance import EVAL_SETTINGS, held_out_acceptance
from tlt_core.warmup.config import OfflineConfig
from tlt_core.warmup.offline import OfflineReport, train_offline
from tlt_core.warmup.training_loop import float32_twin, train_steps

__all__ = ["EVAL_SETTINGS", "OfflineConfig", "OfflineReport", "float32_twin",
           "held_out_acceptance", "train_offline", "train_steps"]
