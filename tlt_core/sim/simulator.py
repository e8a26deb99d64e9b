"""A scale simulator: rollout makespan, idle worker time and end-to-end speedup for N workers,
from a step-cost model and response lengths, without running the model.

Each worker gets whole GRPO groups (group g on worker g mod N, as `WorkerGroup.shard`), admits
up to `max_batch` of its requests and decodes in steps. A step at running batch B with plan P
(None: plain decoding) takes B * c(P) / rate(B, P, context) seconds (`step_seconds`), where rate
is the cost model's measured tokens per second and c(P) the tokens a row emitted per step in
that calibration (1 for plain decoding): the step's duration; the context is the running rows'
mean tokens in the cache, as the engine counts it. Every row advances 1 + k tokens, k drawn per
row and step with the mean acceptance of the simulated workload (given by the caller, per plan
or per plan and row context, `AcceptanceByContext`; default c(P)): the draws matter, because
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


CONTEXT_BUCKETS_PER_OCTAVE = 4  # AcceptanceByContext's buckets: contexts within 2^(1/4)


@dataclass(frozen=True)
class AcceptanceByContext:
    """Tokens a row emits per step, per plan key and the row's context (tokens in its cache),
    pooled in buckets 2^(1/4) wide: what a workload accepts where in its responses. One number
    per plan runs the rows too evenly: a response's opening takes whole drafts and a row decoded
    past its natural end (a forced length) few, and where a row is in its text, not how many rows
    run, says which (`tlt bench rollout`'s no_tail traces on the embedded model: 8.3, 7.2, 6.1
    and 3.6 tokens per row step in the first four steps at 64 rows, then about 2; simulated with
    one mean per running batch instead, those rollouts took 16 steps for the 10 measured). A
    context a plan has no entry for takes the nearest bucket that has one."""
    table: Mapping[str, Mapping[int, float]]  # plan key -> {context bucket: tokens per row step}

    @staticmethod
    def bucket(context: float) -> int:
        return math.floor(CONTEXT_BUCKETS_PER_OCTAVE * math.log2(max(context, 1.0)))

    @classmethod
    def constant(cls, means: Mapping[str, float]) -> AcceptanceByContext:
        """One mean per plan key, at every context."""
        return cls({key: {0: float(mean)} for key, mean in means.items()})

    @classmethod
    def measured(cls, steps: Iterable[tuple[str, float, int, int]]) -> AcceptanceByContext:
        """From steps of (plan key, the rows' mean context, rows, tokens the step emitted): per
        key and bucket, tokens over row steps."""
        sums: dict[str, dict[int, list[int]]] = {}
        for key, context, rows, emitted in steps:
            total = sums.setdefault(key, {}).setdefault(cls.bucket(context), [0, 0])
            total[0] += emitted
            total[1] += rows
        return cls({key: {bucket: emitted / rows for bucket, (emitted, rows) in buckets.items()}
                    for key, buckets in sums.items()})

    def at(self, key: str, context: float) -> float | None:
        """The key's tokens per row step at a row context; None if the table has no entry for
        key."""
        by_bucket = self.table.get(key)
        if not by_bucket:
            return None
        bucket = self.bucket(context)
        return by_bucket[min(by_bucket, key=lambda b: (abs(b - bucket), b))]


def step_seconds(cost: CostModel, batch: int, plan, context: float | None = None) -> float:
    """A decode step's duration at a running batch, mean row context (tokens in the cache) and
    plan (SD_OFF, None for a plain step of a loop that may speculate, or a plan): the
    calibration's, whose rate counts the tokens the calibration's rows emitted per step. The
    workload's acceptance sets a step's progress, not its duration."""
    emitted = 1.0 if plan is None or plan is SD_OFF else cost.acceptance.get(plan.key, 1.0)
    return batch * emitted / cost.rate(batch, plan, context)


def simulate(lengths: Sequence[int], cost: CostModel, *, workers: int = 1, max_batch: int = 64,
             group_size: int = 8, plan: Callable[[int], DraftPlan | None] | None = None,
             acceptance: Mapping[str, float] | AcceptanceByContext | None = None,
             prompt_lengths: float | Sequence[float] = 8.0, seed: int = 0) -> Prediction:
    """plan: None, speculation off for the whole rollout; or plan(batch) -> the plan of a step
    at that running batch (None: a plain step of a loop that may speculate), asked once per
    step in order, so a plan may replay a sequence; acceptance: plan key -> tokens a row emits
    per step on this workload, or those per row context (default and fallback: the
    calibration's). A step's duration comes from the calibration
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
    if not isinstance(acceptance, AcceptanceByContext):
        acceptance = AcceptanceByContext.constant(acceptance or {})
    fallback = AcceptanceByContext.constant(cost.acceptance)

    rng = random.Random(seed)
    alphas: dict[tuple[str, float], float] = {}

    def progress(p, context: float) -> float:
        """Tokens a row at context emits in one step: 1 without a plan; with one, 1 + k
        accepted, k drawn so that P(k >= i) = alpha^i for i <= depth (a chain accepts a prefix,
        each draft token with about the same chance), alpha matched to the mean acceptance."""
        if p is None or p is SD_OFF:
            return 1.0
        mean = acceptance.at(p.key, context)
        mean = fallback.at(p.key, context) if mean is None else mean
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
            running = [row for row in running if row[0] > 1e-9]
            # plan is asked once per step, in order: the step's plan (a policy that may
            # speculate with no step to come admits as its plain steps run)
            chosen = SD_OFF if plan is None else plan(len(running)) if running else None
            if admitted:  # prefill and scheduling, outside the decode steps, of that plan
                admit_s = cost.admission(admitted, chosen)
                clock += admit_s
                admission_s += admit_s
            if not running:
                continue
            batch = len(running)
            context = sum(c for _, c in running) / batch
            clock += step_seconds(cost, batch, chosen, context)
            stepped = []
            for left, c in running:
                e = progress(chosen, c)
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
