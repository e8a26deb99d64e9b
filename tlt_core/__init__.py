"""tlt_core: a toolkit for taming the long tail of RL rollouts of reasoning language models.

Layers, lowest first (a layer imports only the ones before it): `ops` (fused draft-verify
kernels, C++ and CUDA, and their PyTorch oracle), `persistence` (atomic writes, checkpoint
folders, folder locks), `optim` (learning-rate schedule, master weights), `model` (the target,
KV cache, checkpoints), `drafting` (drafter, draft plans, drafter training, export), `engine`
(the rollout engine), `adaptive` (buckets, arm table, cost model, policy), `workers` (ranks,
harvest, idle detector, spot trainer, refresh, watchdog), `warmup` (the drafter's offline EAGLE
warm-up), `tasks` (prompt data, rewards, a run's inputs), `rl` (GRPO and PPO math, the driver),
`outputs` (a run's metrics, report, policy folder, run folder), `integrations` (TRL), `sim`
(traces, simulator), `embedded` (the default task and model), `bench`, `cli`. The names below
are what most users need.

Logging: every module logs to `logging.getLogger(__name__)`, under the `tlt_core` logger, which
has only a NullHandler: an application that embeds tlt_core shows its messages by configuring
logging (`logging.basicConfig(level=logging.INFO)`, or a handler on "tlt_core"); the `tlt`
command configures it itself (tlt_core.cli.logs).
"""

import logging

from tlt_core._version import __version__
from tlt_core.adaptive import DEFAULT_PLANS, AdaptivePolicy
from tlt_core.drafting import Drafter, DrafterConfig, DraftPlan, Strategy, SuffixMatch
from tlt_core.engine import (EngineConfig, PlanPolicy, Request, Rollout, RolloutEngine,
                             RolloutResult, SamplingParams, StepOutcome)
from tlt_core.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from tlt_core.rl import RLDriver, TrainConfig
from tlt_core.tasks import Prompt

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["AdaptivePolicy", "DEFAULT_PLANS", "DraftPlan", "Drafter", "DrafterConfig",
           "EngineConfig", "RLDriver", "ModelConfig", "PlanPolicy", "Prompt", "Request",
           "Rollout", "RolloutEngine", "RolloutResult", "SamplingParams", "StepOutcome",
           "Strategy", "SuffixMatch", "TrainConfig", "Transformer", "__version__",
           "load_checkpoint", "save_checkpoint"]
