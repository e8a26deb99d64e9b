"""The rollout engine: requests in, rollouts out (token ids, the target's log-probs, finish
reasons, timings, the running-batch trace), speculative where a policy says so and lossless
either way.

`engine.py` is `RolloutEngine` (admit, step, retire; a step plain or draft, verify, accept,
commit); `records.py` what goes in and comes out; `hooks.py` the protocols it is given (a plan
policy, step observers, a harvest sink); `sampling.py` the one sampling path (the verification
kernel on root-only trees) and per-sample seeds; `rows.py` and `drafter_rows.py` the per-row
state of the target and of the drafter; `passes.py` the decode passes a step runs, eagerly
or (`step_graphs.py`) at fixed shapes, captured as CUDA graphs in a `graph_pool.py` pool;
`host_read.py` a step's one device-to-host read and `step_clock.py` its timing without a sync.
The engine knows nothing about tokenizers, rewards, workers or training (tlt_core.rl,
tlt_core.workers); it imports only ops, model and drafting.
"""

from tlt_core.engine.drafter_rows import DrafterRows
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.graph_pool import GraphPool
from tlt_core.engine.hooks import HarvestSink, PlanPolicy, Speculation, StepObserver, StepOutcome
from tlt_core.engine.records import (Request, RequestTiming, Rollout, RolloutResult,
                                     SamplingParams, SpecStepStats, seconds_at_or_below,
                                     step_trace_rows)
from tlt_core.engine.sampling import sample_roots, sample_seed

__all__ = ["DrafterRows", "EngineConfig", "GraphPool", "HarvestSink", "PlanPolicy", "Request", "RequestTiming",
           "Rollout", "RolloutEngine", "RolloutResult", "SamplingParams", "SpecStepStats",
           "Speculation", "StepObserver", "StepOutcome", "sample_roots", "sample_seed",
           "seconds_at_or_below", "step_trace_rows"]
