"""`tlt bench simulate --rollout FILE`: the simulator checked against every measured run of a
`tlt bench rollout` JSON (tlt_core.bench.rollout_file), one rank, no model run.

Per workload, mode and round, the simulator predicts the run's makespan from what the file
says the run was, never from its measured times:
- the cost model: the workload's calibration (each file keeps the one its runs shared);
- the lengths: each sample's prompt and response length, max_batch the engine's;
- the plans: off and off_reseeded, SD off with no drafter in the loop (the calibration's SD_OFF
  steps); always, the file's SD-always plan on every step; adaptive, at each running batch the
  arms the run's own trace chose there, in order (ReplayedArms; plain: a plain step of a loop
  that may speculate), the most frequent at the nearest traced batch (in log2) for a batch the
  trace never ran;
- the acceptance: per arm and context, the tokens a row emitted per step in the run's trace
  (sim.simulator.AcceptanceByContext: where a row is in its text says what it accepts).
The prediction is the mean of `simulations` simulations (the acceptance draws differ).

error = predicted / measured - 1, and three parts that add up to it, each over the measured
makespan, so a reader sees where it comes from:
- admission: the predicted time outside decode steps (the calibration's admission of that many
  fresh rows) against the run's (total_s minus its steps' seconds);
- step cost: the cost model's price of the run's own steps (step_seconds at each traced batch,
  context and arm) against their measured seconds: what the cost model gets wrong about a step;
- schedule: the simulated steps against the run's own steps, both priced by the cost model:
  what the simulation gets wrong about how many steps run at which batch (acceptance draws,
  the adaptive plan's reconstruction).
The noise floor: off and off_reseeded run the same kind of steps (on trace and no_tail the same
lengths), so the ratio of their measured step seconds to the cost model's price, one against
the other, is the machine's run-to-run noise in the same file. A prediction cannot be held to
an error below it. And where the step cost part comes from: per mode and cell (running batch x
mean context), the runs' step seconds over the cost model's price of them.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Callable, Iterable

from tlt_core.adaptive.buckets import StepBuckets
from tlt_core.adaptive.cost_model import SD_OFF
from tlt_core.bench.rollout_file import PLAIN_ARM, MeasuredRun, TraceStep, WorkloadRuns
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.plan_keys import plan_from_key
from tlt_core.sim.simulator import AcceptanceByContext, simulate, step_seconds

SD_OFF_MODES = ("off", "off_reseeded")
DIAGNOSTIC_CONTEXT_EDGES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
TARGET_ERROR = 0.15  # the simulator's error bound on a measured rollout


def arm_by_batch(steps: tuple[TraceStep, ...]) -> dict[int, str]:
    """Running batch -> the arm the trace ran most often at it (the first seen on a tie)."""
    counts: dict[int, Counter] = defaultdict(Counter)
    for step in steps:
        counts[step.batch][step.arm] += 1
    return {batch: arms.most_common(1)[0][0] for batch, arms in counts.items()}


def acceptance_by_context(steps: tuple[TraceStep, ...]) -> AcceptanceByContext:
    """Per speculative arm and context bucket: tokens emitted per row step."""
    return AcceptanceByContext.measured((s.arm, s.context, s.batch, s.emitted) for s in steps
                                        if s.arm != PLAIN_ARM)


def nearest_batch(batches: Iterable[int], batch: int) -> int:
    """The batch among batches nearest to batch in log2 (the smaller one on a tie)."""
    return min(batches, key=lambda b: (abs(math.log2(b) - math.log2(batch)), b))


def _plan_of(arm: str) -> DraftPlan | None:
    return None if arm == PLAIN_ARM else plan_from_key(arm)


class ReplayedArms:
    """An adaptive run's plans replayed by running batch: the k-th simulated step at batch b
    runs the arm of the run's k-th step at b (its last there once those run out); a batch the
    run never stepped at runs the arm most frequent at the nearest one it did. In order, not the
    most frequent arm alone: at one batch the loop may speculate first and decode plainly later
    (a no_tail rollout's 64 rows as their contexts grow). One per simulation: it counts."""

    def __init__(self, steps: tuple[TraceStep, ...]):
        self._sequences: dict[int, list[str]] = defaultdict(list)
        for step in steps:
            self._sequences[step.batch].append(step.arm)
        self._most_frequent = arm_by_batch(steps)
        self._asked: Counter = Counter()

    def __call__(self, batch: int) -> DraftPlan | None:
        arms = self._sequences.get(batch)
        if not arms:
            return _plan_of(self._most_frequent[nearest_batch(self._most_frequent, batch)])
        arm = arms[min(self._asked[batch], len(arms) - 1)]
        self._asked[batch] += 1
        return _plan_of(arm)


def mode_plan(run: MeasuredRun, always: str) -> Callable[[int], DraftPlan | None] | None:
    """A fresh simulator plan for a run of its mode (module docstring); None: SD off."""
    if run.mode in SD_OFF_MODES:
        return None
    if run.mode == "always":
        plan = plan_from_key(always)
        return lambda batch: plan
    if not run.steps:
        return lambda batch: None
    return ReplayedArms(run.steps)


def _priced(run: MeasuredRun, workload: WorkloadRuns) -> list[float]:
    """The cost model's seconds for each of the run's own steps."""
    return [step_seconds(workload.cost, s.batch, SD_OFF if run.mode in SD_OFF_MODES
                         else _plan_of(s.arm), s.context) for s in run.steps]


def priced_steps_s(run: MeasuredRun, workload: WorkloadRuns) -> float:
    return sum(_priced(run, workload))


def step_cost_cells(workload: WorkloadRuns) -> dict[str, dict[str, dict]]:
    """Where the step cost part comes from: per mode and cell (running batch x mean context,
    DIAGNOSTIC_CONTEXT_EDGES), pooled over rounds, the cell's largest batch, the steps, their
    measured seconds, the cost model's price of them and the ratio measured / priced."""
    buckets = StepBuckets.covering(workload.max_batch, context_edges=DIAGNOSTIC_CONTEXT_EDGES)
    cells: dict[str, dict[int, list[float]]] = {}
    for mode, runs in workload.runs.items():
        for run in runs:
            for step, priced in zip(run.steps, _priced(run, workload)):
                total = cells.setdefault(mode, {}).setdefault(
                    buckets.cell(step.batch, int(step.context)), [0, 0.0, 0.0])
                total[0] += 1
                total[1] += step.seconds
                total[2] += priced
    columns = len(buckets.context_edges) + 1
    return {mode: {buckets.label(cell): {"batch_max": buckets.batch_edges[cell // columns],
                                         "steps": steps, "measured_s": measured,
                                         "priced_s": priced, "ratio": measured / priced}
                   for cell, (steps, measured, priced) in sorted(by_cell.items())}
            for mode, by_cell in cells.items()}


def predict_run(run: MeasuredRun, workload: WorkloadRuns, simulations: int = 8) -> dict:
    """One row: measured, predicted, error and its parts (module docstring)."""
    if simulations < 1:
        raise ValueError(f"simulations: must be >= 1, got {simulations}")
    predictions = [simulate(run.response_lengths, workload.cost, workers=1,
                            max_batch=workload.max_batch, plan=mode_plan(run, workload.always),
                            acceptance=acceptance_by_context(run.steps),
                            prompt_lengths=run.prompt_lengths, seed=seed)
                   for seed in range(simulations)]
    predicted = statistics.mean(p.makespan_s for p in predictions)
    admission = statistics.mean(p.admission_s for p in predictions)
    priced = priced_steps_s(run, workload)
    measured = run.total_s
    return {"workload": run.workload, "mode": run.mode, "round": run.round,
            "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1,
            "error_admission": (admission - run.outside_steps_s) / measured,
            "error_step_cost": (priced - run.steps_s) / measured,
            "error_schedule": (predicted - admission - priced) / measured,
            "measured_steps": len(run.steps),
            "predicted_steps": statistics.mean(p.steps for p in predictions),
            "measured_admission_s": run.outside_steps_s, "predicted_admission_s": admission,
            "measured_steps_s": run.steps_s, "priced_steps_s": priced,
            "predicted_steps_s": predicted - admission, "catch_up_s": run.catch_up_s}


def noise_floor(workload: WorkloadRuns) -> float | None:
    """The largest |r(off_reseeded) / r(off) - 1| over rounds, r a run's measured step seconds
    over the cost model's price of them; None without both SD-off modes."""
    pairs = [(first, again) for first, again in zip(workload.runs.get("off", ()),
                                                    workload.runs.get("off_reseeded", ()))
             if first.steps_s > 0 and again.steps_s > 0]
    ratios = [(again.steps_s / priced_steps_s(again, workload))
              / (first.steps_s / priced_steps_s(first, workload)) - 1 for first, again in pairs]
    return max(map(abs, ratios)) if ratios else None


def validate_rollout(workloads: dict[str, WorkloadRuns], simulations: int = 8) -> dict:
    rows = [predict_run(run, workload, simulations)
            for workload in workloads.values() for runs in workload.runs.values()
            for run in runs]
    return {"rows": rows, "simulations": simulations,
            "noise_floor": {name: noise_floor(w) for name, w in workloads.items()},
            "step_cost_cells": {name: step_cost_cells(w) for name, w in workloads.items()},
            "max_abs_error": max(abs(r["error"]) for r in rows),
            "target_error": TARGET_ERROR}


def format_rollout_table(result: dict) -> str:
    lines = [f"{'workload':<10}{'mode':<13}{'round':>5}{'measured':>10}{'predicted':>10}"
             f"{'error':>8} | {'admission':>9}{'step cost':>10}{'schedule':>9} | "
             f"{'steps':>6}{'sim':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['workload']:<10}{r['mode']:<13}{r['round']:>5}{r['measured_s']:>10.3f}"
                     f"{r['predicted_s']:>10.3f}{100 * r['error']:>+7.1f}% | "
                     f"{100 * r['error_admission']:>+8.1f}%{100 * r['error_step_cost']:>+9.1f}%"
                     f"{100 * r['error_schedule']:>+8.1f}% | {r['measured_steps']:>6}"
                     f"{r['predicted_steps']:>7.1f}")
    floors = ", ".join(f"{name} {'-' if floor is None else f'{100 * floor:.1f}%'}"
                       for name, floor in result["noise_floor"].items())
    lines.append(f"max |error| {100 * result['max_abs_error']:.1f}% (target "
                 f"{100 * result['target_error']:.0f}%); error = admission + step cost + "
                 "schedule, each over the measured makespan")
    lines.append(f"noise floor (off_reseeded vs off, step seconds over the cost model's): "
                 f"{floors}")
    lines.append("step cost, measured / cost model, per running batch (every mode and round):")
    for name, by_mode in result["step_cost_cells"].items():
        by_batch: dict[int, list[float]] = {}
        for cells in by_mode.values():
            for cell in cells.values():
                total = by_batch.setdefault(cell["batch_max"], [0.0, 0.0])
                total[0] += cell["measured_s"]
                total[1] += cell["priced_s"]
        lines.append(f"  {name}: " + ", ".join(
            f"b<={batch} {measured / priced:.2f}"
            for batch, (measured, priced) in sorted(by_batch.items())))
    return "\n".join(lines)
