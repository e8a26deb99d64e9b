"""A run's outputs: what `tlt train` leaves in its run folder, and the rules for that folder.

`metrics.py` the stable names of a step's metrics and where they are written (JSONL,
TensorBoard); `wandb_logger.py` those metrics as a Weights & Biases run (optional: the wandb
package); `report.py` a run's summary and plots; `policy_folder.py` a trained policy as a
Hugging Face folder transformers loads; `run_folder.py` a run folder's parts and when a run may
use it (resume, overwrite, its lock). It reads what the RL layer produces and never changes it.
"""

from tlt_core.outputs.metrics import METRICS, RECORD_FIELDS, MetricsWriter
from tlt_core.outputs.policy_folder import SpecialTokenIds, write_policy_folder
from tlt_core.outputs.report import summarize, write_report
from tlt_core.outputs.run_folder import RunFolderError, hold_run_folder, resume_point
from tlt_core.outputs.wandb_logger import WandbLogger, WandbSettings

__all__ = ["METRICS", "MetricsWriter", "RECORD_FIELDS", "RunFolderError", "SpecialTokenIds",
           "WandbLogger", "WandbSettings", "hold_run_folder", "resume_point", "summarize",
           "write_policy_folder", "write_report"]
