"""A scale simulator: rollout makespan, idle worker time and end-to-end speedup for N workers,
from a step-cost model and response lengths, without running the model.

Each worker gets whole GRPO groups (group g on worker g mod N, as `WorkerGroup.shard`), admits
up to `max_batch` of its requests and decodes in steps. A step at running batch B with plan P
(None: plain decoding) takes B * c(P) / rate(B, P) seconds, where rate is the cost model's
measured tokens per second and c(P) the tokens a row emitted per step in that calibration (1
for plain decoding): the step's duration. Every row advances 1 + k tokens, k drawn per row and step with
the mean acceptance of the simulated workload (given by the caller; default c(P)): the draws
matter, because the makespan is the slowest row's, and a noisy row finishes later than an
average one; a row finishes when it has produced its length; a finished row's slot takes the next
waiting request. Admitting rows costs what the calibration measured outside the decode steps for
that many fresh rows (prefill, scheduling, collecting results): it weighs on short rollouts.
Plans: speculation off for the whole rollout (no drafter in the loop: the calibration's SD_OFF
steps), or a plan per step (a fixed plan, or the adaptive choice: SD on at or below the
threshold, the plan with the highest rate at that batch), whose plain steps (None) keep the
drafter up to date as the adaptive loop does.

Outputs: each worker's busy time, the makespan (the slowest worker), the idle worker-seconds
(sum over workers of makespan - busy: the time spot training can use), and, given the training
time of a step, the end-to-end speedup of one mode over another. `Calibration` files (JSON) carry
a cost model measured on another machine (the GPU script writes one), so a projection for a GPU
cluster uses GPU numbers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tlt_core.adaptive.cost_model import SD_OFF, CostModel
from tlt_core.drafting.plan import DraftPlan


@dataclass(frozen=True)
class Prediction:
    makespan_s: float
    busy_s: tuple[float, ...]  # per worker
    idle_worker_s: float  # sum over workers of makespan - busy
    steps: int  # decode steps of the slowest worker


def simulate(lengths: Sequence[int], cost: CostModel, *, workers: int = 1, max_batch: int = 64,
             group_size: int = 8, plan: Callable[[int], DraftPlan | None] | None = None,
             acceptance: dict[str, float] | None = None, prompt_length: float = 8.0,
             seed: int = 0) -> Prediction:
    """plan: None, speculation off for the whole rollout; or plan(batch) -> the plan of a step
    at that running batch (None: a plain step of a loop that may speculate); acceptance:
    plan key -> tokens a row emits per step on this workload (default: the calibration's).
    A step's duration comes from the calibration (its rate at the calibration's acceptance);
    its progress from the workload's acceptance; its context dependence (when calibrated) from
    the running rows' mean context, prompt_length plus what they produced."""
    if workers < 1 or max_batch < 1:
        raise ValueError("workers, max_batch: must be >= 1")
    acceptance = {**cost.acceptance, **(acceptance or {})}

    def calibrated(p):
        return 1.0 if p is None else cost.acceptance.get(p.key, 1.0)

    rng = random.Random(seed)
    alphas: dict[str, float] = {}

    def progress(p) -> float:
        """Tokens one row emits in one step: 1 without a plan; with one, 1 + k accepted, k
        drawn so that P(k >= i) = alpha^i for i <= depth (a chain accepts a prefix, each
        draft token with about the same chance), alpha matched to the mean acceptance."""
        if p is None or p is SD_OFF:
            return 1.0
        key = p.key
        if key not in alphas:
            alphas[key] = _solve_alpha(acceptance.get(key, 1.0) - 1.0, p.depth)
        alpha, accepted = alphas[key], 0
        while accepted < p.depth and rng.random() < alpha:
            accepted += 1
        return 1.0 + accepted

    shards = [[] for _ in range(workers)]
    for index, length in enumerate(lengths):
        shards[(index // group_size) % workers].append(float(length))
    busy, steps_max = [], 0
    for shard in shards:
        # a row: [tokens left, tokens done]; its context is the prompt plus what it produced
        waiting, running, clock, steps = list(shard), [], 0.0, 0
        while waiting or running:
            admitted = 0
            while waiting and len(running) < max_batch:
                # the prefill samples a row's first token: a row of length L decodes L - 1
                running.append([waiting.pop(0) - 1.0, 1.0])
                admitted += 1
            if admitted:  # prefill and scheduling, outside the decode steps
                clock += cost.admission(admitted, SD_OFF if plan is None else plan(len(running)))
                running = [row for row in running if row[0] > 1e-9]
                if not running:
                    continue
            batch = len(running)
            chosen = SD_OFF if plan is None else plan(batch)
            context = prompt_length + sum(done for _, done in running) / batch
            clock += batch * calibrated(chosen) / cost.rate(batch, chosen, context)
            stepped = []
            for left, done in running:
                e = progress(chosen)
                if left - e > 1e-9:
                    stepped.append([left - e, done + e])
            running = stepped
            steps += 1
        busy.append(clock)
        steps_max = max(steps_max, steps)
    makespan = max(busy)
    return Prediction(makespan, tuple(busy), sum(makespan - b for b in busy), steps_max)


def _solve_alpha(mean_accepted: float, depth: int) -> float:
    """alpha in [0, 1) with sum_{i=1..depth} alpha^i = mean_accepted (bisection)."""
    if mean_accepted <= 0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid ** i for i in range(1, depth + 1)) < mean_accepted:
            low = mid
        else:
            high = mid
    return min(low, 1.0)


def adaptive_plan(cost: CostModel, plans: Sequence[DraftPlan], threshold: int
                  ) -> Callable[[int], DraftPlan | None]:
    """The adaptive loop's choice with a perfectly informed bandit: SD at or below threshold,
    the highest-rate plan at that batch."""
    def choose(batch: int):
        if batch > threshold:
            return None
        return max(plans, key=lambda p: cost.rate(batch, p))
    return choose


def end_to_end_speedup(rollout_base_s: float, rollout_new_s: float, train_s: float) -> float:
    return (rollout_base_s + train_s) / (rollout_new_s + train_s)


def calibration_dict(cost: CostModel, device: str) -> dict:
    """A cost model as plain JSON data (tables keyed "batch|plan key")."""
    def flat(table):
        return {f"{b}|{k}": v for (b, k), v in table.items()}

    return {"device": device, "rates": flat(cost.rates), "acceptance": cost.acceptance,
            "context_slope": flat(cost.context_slope), "context_mean": flat(cost.context_mean),
            "context_max": flat(cost.context_max), "admission_s": flat(cost.admission_s)}


def save_calibration(cost: CostModel, path: str | Path, device: str) -> None:
    Path(path).write_text(json.dumps(calibration_dict(cost, device), indent=1) + "\n")


def load_calibration(path: str | Path) -> CostModel:
    try:
        return cost_model_from_dict(json.loads(Path(path).read_text()))
    except ValueError as error:
        raise ValueError(f"calibration: {path} is not a calibration file ({error})") from None


def cost_model_from_dict(data: dict) -> CostModel:
    """calibration_dict's inverse."""
    def table(flat):
        return {(int(key.split("|")[0]), key.split("|")[1]): float(v) for key, v in flat.items()}

    try:
        return CostModel(table(data["rates"]), acceptance=dict(data.get("acceptance", {})),
                         context_slope=table(data.get("context_slope", {})),
                         context_mean=table(data.get("context_mean", {})),
                         context_max=table(data.get("context_max", {})),
                         admission_s=table(data.get("admission_s", {})))
    except (KeyError, ValueError, IndexError, AttributeError) as error:
        raise ValueError(f"not a calibration ({error})") from None
