"""tlt_core: a toolkit for taming the long tail of RL rollouts of reasoning language models.

Layers, lowest first (a layer imports only the ones before it): `ops` (fused draft-verify
kernels, C++ and CUDA, and their PyTorch oracle), `model` (the target, KV cache, checkpoints),
`drafting` (drafter, draft plans, drafter training, export), `engine` (the rollout engine),
`adaptive` (SD switch, bandit, cost model, graph pool), `workers` (ranks, harvest, idle
detector, spot trainer, refresh, watchdog), `rl` (GRPO math and driver, rewards, data),
`integrations` (TRL), `sim` (traces, simulator), `embedded` (the default task and model),
`bench`, `cli`. The names below are what most users need.
"""

from tlt_core._version import __version__
from tlt_core.adaptive import DEFAULT_PLANS, AdaptivePolicy
from tlt_core.drafting import Drafter, DrafterConfig, DraftPlan, Strategy, SuffixMatch
from tlt_core.engine import (EngineConfig, PlanPolicy, Request, Rollout, RolloutEngine,
                             RolloutResult, SamplingParams, StepOutcome)
from tlt_core.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from tlt_core.rl import RLDriver, Prompt, TrainConfig

__all__ = ["AdaptivePolicy", "DEFAULT_PLANS", "DraftPlan", "Drafter", "DrafterConfig",
           "EngineConfig", "RLDriver", "ModelConfig", "PlanPolicy", "Prompt", "Request",
           "Rollout", "RolloutEngine", "RolloutResult", "SamplingParams", "StepOutcome",
           "Strategy", "SuffixMatch", "TrainConfig", "Transformer", "__version__",
           "load_checkpoint", "save_checkpoint"]
