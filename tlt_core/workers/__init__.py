"""The rollout workers: many engines as torch.distributed ranks, and the drafter kept current in
the time the long tail leaves idle.

`group.py` is the worker group (ranks, sharding GRPO groups, what they share); `round.py` one
rollout round on a rank (its shard, then spot training until every rank is done);
`harvest.py` the drafter's training data from target passes the rollout already made;
`idle.py` the NVML-based idle detector (C++); `spot_trainer.py` preemptible drafter training
on harvested data; `refresh.py` the step-weighted average of the drafter replicas;
`watchdog.py` rolls back a refresh that made drafting worse. It builds on the engine and
drafting; nothing here knows about rewards or the policy update (tlt_core.rl).
"""

from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.workers.idle import IdleDetector
from tlt_core.workers.refresh import refresh
from tlt_core.workers.round import WorkerRound, rollout_round
from tlt_core.workers.spot_trainer import SpotConfig, SpotSession, SpotTrainer
from tlt_core.workers.watchdog import DrafterWatchdog, Verdict

__all__ = ["DrafterWatchdog", "HarvestBuffer", "IdleDetector", "SpotConfig", "SpotSession",
           "SpotTrainer", "Verdict", "WorkerGroup", "WorkerRound", "refresh", "rollout_round"]
