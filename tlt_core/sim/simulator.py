"""A scale simulator: rollout makespan, idle worker time and end-to-end speedup for N workers,
from a step-cost model and response lengths, without running the model.

Each worker gets whole GRPO groups (group g on worker g mod N, as `WorkerGroup.shard`), admits
up to `max_batch` of its requests and decodes in steps. A step at running batch B with plan P
(None: plain decoding) takes B * c(P) / rate(B, P, context) seconds (`step_seconds`), where rate
is the cost model's measured tokens per second and c(P) the tokens a row emitted per step in
that calibration (1 for plain decoding): the step's duration; the context is the running rows'
mean tokens in the cache, as the engine counts it. Every row advances 1 + k tokens, k drawn per
row and step with the mean acceptance of the simulated workload (given by the caller, per plan
or per plan and running batch, `AcceptanceByBatch`; default c(P)): the draws matter, because
the makespan is the slowest row's, and a noisy row finishes later than an average one; a row
finishes when it has produced its length; a finished row's slot takes the next waiting request.
Admitting rows costs what the calibration measured outside the decode steps for that many fresh
rows (prefill, scheduling, collecting results): it weighs on short rollouts.
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
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from tlt_core.adaptive.cost_model import SD_OFF, CostModel
from tlt_core.drafting.plan import DraftPlan


@dataclass(frozen=True)
class Prediction:
    makespan_s: float
    busy_s: tuple[float, ...]  # per worker
    idle_worker_s: float  # sum over workers of makespan - busy
    steps: int  # decode steps of the slowest worker
    # of the slowest worker's busy time, what admitting rows took; its decode steps the rest
    admission_s: float = 0.0


@dataclass(frozen=True)
class AcceptanceByBatch:
    """Tokens a row emits per step, per plan key and running batch: what a workload accepts
    where in a rollout. It is not one number per plan: rows decoded past their natural end (a
    forced length) accept few drafts, and those rows are the tail's, so the small batches of a
    rollout accept less than its full ones (`tlt bench rollout`'s traces: 7.0 tokens per row
    step at 64 rows, 1.3-1.9 below 8). A batch a plan has no entry for takes the entry nearest
    in log2(batch)."""
    table: Mapping[str, Mapping[int, float]]  # plan key -> {running batch: tokens per row step}

    @classmethod
    def constant(cls, means: Mapping[str, float]) -> AcceptanceByBatch:
        """One mean per plan key, at every batch."""
        return cls({key: {1: float(mean)} for key, mean in means.items()})

    def at(self, key: str, batch: int) -> float | None:
        """The key's tokens per row step at batch; None if the table has no entry for key."""
        by_batch = self.table.get(key)
        return by_batch[nearest_batch(by_batch, batch)] if by_batch else None


def nearest_batch(batches: Iterable[int], batch: int) -> int:
    """The batch among batches nearest to batch in log2 (the smaller one on a tie)."""
    return min(batches, key=lambda b: (abs(math.log2(b) - math.log2(batch)), b))


def step_seconds(cost: CostModel, batch: int, plan, context: float | None = None) -> float:
    """A decode step's duration at a running batch, mean row context (tokens in the cache) and
    plan (SD_OFF, None for a plain step of a loop that may speculate, or a plan): the
    calibration's, whose rate counts the tokens the calibration's rows emitted per step. The
    workload's acceptance sets a step's progress, not its duration."""
    emitted = 1.0 if plan is None or plan is SD_OFF else cost.acceptance.get(plan.key, 1.0)
    return batch * emitted / cost.rate(batch, plan, context)


def simulate(lengths: Sequence[int], cost: CostModel, *, workers: int = 1, max_batch: int = 64,
             group_size: int = 8, plan: Callable[[int], DraftPlan | None] | None = None,
             acceptance: Mapping[str, float] | AcceptanceByBatch | None = None,
             prompt_lengths: float | Sequence[float] = 8.0, seed: int = 0) -> Prediction:
    """plan: None, speculation off for the whole rollout; or plan(batch) -> the plan of a step
    at that running batch (None: a plain step of a loop that may speculate); acceptance: plan
    key -> tokens a row emits per step on this workload, or those per running batch (default
    and fallback: the calibration's). A step's duration comes from the calibration
    (step_seconds); its progress from the workload's acceptance; its context dependence (when
    calibrated) from the running rows' mean context, as the engine counts it: the tokens in a
    row's cache before the step, its prompt (prompt_lengths: one for every request, or one
    per request) plus what it produced less the token just sampled, which the step feeds."""
    if workers < 1 or max_batch < 1:
        raise ValueError("workers, max_batch: must be >= 1")
    if isinstance(prompt_lengths, (int, float)):
        prompt_lengths = [float(prompt_lengths)] * len(lengths)
    if len(prompt_lengths) != len(lengths):
        raise ValueError(f"prompt_lengths: {len(prompt_lengths)} for {len(lengths)} requests; "
                         "give one number or one per request")
    if not isinstance(acceptance, AcceptanceByBatch):
        acceptance = AcceptanceByBatch.constant(acceptance or {})
    fallback = AcceptanceByBatch.constant(cost.acceptance)

    rng = random.Random(seed)
    alphas: dict[tuple[str, float], float] = {}

    def progress(p, batch: int) -> float:
        """Tokens one row emits in one step: 1 without a plan; with one, 1 + k accepted, k
        drawn so that P(k >= i) = alpha^i for i <= depth (a chain accepts a prefix, each
        draft token with about the same chance), alpha matched to the mean acceptance."""
        if p is None or p is SD_OFF:
            return 1.0
        mean = acceptance.at(p.key, batch)
        mean = fallback.at(p.key, batch) if mean is None else mean
        mean = 1.0 if mean is None else mean
        if (p.key, mean) not in alphas:
            alphas[(p.key, mean)] = _solve_alpha(mean - 1.0, p.depth)
        alpha, accepted = alphas[(p.key, mean)], 0
        while accepted < p.depth and rng.random() < alpha:
            accepted += 1
        return 1.0 + accepted

    shards = [[] for _ in range(workers)]
    for index, (length, prompt) in enumerate(zip(lengths, prompt_lengths)):
        shards[(index // group_size) % workers].append((float(length), float(prompt)))
    busy, admissions, step_counts = [], [], []
    for shard in shards:
        # a row: [tokens left, its context: tokens in its cache before the next step]
        waiting, running, clock, admission_s, steps = list(shard), [], 0.0, 0.0, 0
        while waiting or running:
            admitted = 0
            while waiting and len(running) < max_batch:
                # the prefill fills the cache with the prompt and samples a row's first token:
                # a row of length L decodes L - 1
                length, prompt = waiting.pop(0)
                running.append([length - 1.0, prompt])
                admitted += 1
            if admitted:  # prefill and scheduling, outside the decode steps
                admit_s = cost.admission(admitted, SD_OFF if plan is None
                                         else plan(len(running)))
                clock += admit_s
                admission_s += admit_s
                running = [row for row in running if row[0] > 1e-9]
                if not running:
                    continue
            batch = len(running)
            chosen = SD_OFF if plan is None else plan(batch)
            context = sum(c for _, c in running) / batch
            clock += step_seconds(cost, batch, chosen, context)
            stepped = []
            for left, c in running:
                e = progress(chosen, batch)
                if left - e > 1e-9:
                    stepped.append([left - e, c + e])
            running = stepped
            steps += 1
        busy.append(clock)
        admissions.append(admission_s)
        step_counts.append(steps)
    makespan = max(busy)
    slowest = busy.index(makespan)
    return Prediction(makespan, tuple(busy), sum(makespan - b for b in busy),
                      step_counts[slowest], admissions[slowest])


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
