"""A `tlt bench rollout` JSON's measured runs: what `run_record` writes for one rollout and
`load_rollout` reads back as typed records, checked, for `tlt bench simulate --rollout`.

A file holds, per workload, the cost model the runs shared (`calibration`, as
`tlt_core.sim.simulator.calibration_dict` writes it), the engine's `max_batch`, SD-always's
plan key (`always`) and, per mode, one record per measured round: `total_s` (the generate
call's wall time), `tokens`, each sample's `prompt_lengths` and `response_lengths` (the same
order) and its `step_trace` ({"columns": TRACE_COLUMNS, "rows": [...]}, one row per decode
step: the running batch, the rows' mean context before the step, the arm ("plain" or the plan's
key), the tokens it committed summed over rows, its seconds and the drafter's catch-up seconds
among them).

What the checks hold a run to, since a simulator given lengths and a trace that disagree would
report an error that is neither's: every sample has a prompt and a response of at least one
token; `tokens` is their sum; no step runs more rows than `max_batch`; the steps emit every
token after each sample's first (the prefill samples that one): sum(length - 1) exactly, as the
engine counts a step's tokens now (those the samples kept), or, in a file whose engine counted
whole accepted drafts, at most a plan's depth more per sample (a row's last step may overshoot
its end); SD-always's runs run its plan only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tlt_core.adaptive.cost_model import CostModel
from tlt_core.drafting.plan_keys import plan_from_key
from tlt_core.engine.records import RolloutResult, step_trace_rows
from tlt_core.sim.simulator import cost_model_from_dict

RUN_MODES = ("off", "always", "adaptive", "off_reseeded")
TRACE_COLUMNS = ("step", "batch", "context", "arm", "emitted", "seconds", "catch_up_s")
PLAIN_ARM = "plain"


def run_record(result: RolloutResult) -> dict:
    """One measured rollout as the JSON keeps it."""
    return {"total_s": result.total_s, "tokens": sum(len(r.tokens) for r in result.rollouts),
            "prompt_lengths": [len(r.prompt_ids) for r in result.rollouts],
            "response_lengths": [len(r.tokens) for r in result.rollouts],
            "step_trace": {"columns": list(TRACE_COLUMNS),
                           "rows": [[row[c] for c in TRACE_COLUMNS]
                                    for row in step_trace_rows(result.step_trace)]}}


@dataclass(frozen=True)
class TraceStep:
    """One decode step of a measured run."""
    batch: int  # running rows
    context: float  # the rows' mean tokens in the cache before the step
    arm: str  # "plain" or the plan's key
    emitted: int  # tokens the step added to the samples, summed over rows
    seconds: float  # the whole step
    catch_up_s: float  # of which the drafter's catch-up on pairs it had not run over


@dataclass(frozen=True)
class MeasuredRun:
    """One measured rollout of one mode."""
    workload: str
    mode: str
    round: int  # its index among the mode's measured rounds
    total_s: float  # the generate call, wall time
    prompt_lengths: tuple[int, ...]  # (samples,)
    response_lengths: tuple[int, ...]  # (samples,) the same order
    steps: tuple[TraceStep, ...]

    @property
    def label(self) -> str:
        return f"{self.workload} / {self.mode} / round {self.round}"

    @property
    def steps_s(self) -> float:
        """Seconds in decode steps."""
        return sum(s.seconds for s in self.steps)

    @property
    def outside_steps_s(self) -> float:
        """Seconds outside decode steps: admission (prefill), scheduling, collecting results."""
        return self.total_s - self.steps_s

    @property
    def catch_up_s(self) -> float:
        return sum(s.catch_up_s for s in self.steps)


@dataclass(frozen=True)
class WorkloadRuns:
    """A workload's cost model and measured runs."""
    name: str
    max_batch: int
    always: str  # SD-always's plan key
    cost: CostModel
    runs: dict[str, tuple[MeasuredRun, ...]]  # mode -> its rounds, in RUN_MODES order


def load_rollout(path: str | Path) -> dict[str, WorkloadRuns]:
    """The workloads of a `tlt bench rollout --json` file, each run checked against its lengths
    (module docstring); ValueError naming the file and the run for anything else."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"rollout: cannot read {path} as JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("workloads"), dict) \
            or not data["workloads"]:
        older = isinstance(data, dict) and "rows" in data
        raise ValueError(f"rollout: {path} is not a `tlt bench rollout --json` file (no "
                         "'workloads' object" + ("; a file from before the step traces has "
                                                 "rows only: measure again)" if older else ")"))
    return {name: _workload(path, name, detail) for name, detail in data["workloads"].items()}


def _workload(path: Path, name: str, detail) -> WorkloadRuns:
    where = f"rollout: {path}, workload {name!r}"
    if not isinstance(detail, dict):
        raise ValueError(f"{where}: not an object")
    missing = [key for key in ("max_batch", "always", "calibration", "runs") if key not in detail]
    if missing:
        raise ValueError(f"{where}: lacks {', '.join(missing)} (a file from an older `tlt bench "
                         "rollout` keeps no traces: measure again)")
    max_batch, always, runs = detail["max_batch"], detail["always"], detail["runs"]
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"{where}: max_batch must be an int >= 1, got {max_batch!r}")
    try:
        plan_from_key(always)
        cost = cost_model_from_dict(detail["calibration"])
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None
    if not isinstance(runs, dict) or not runs:
        raise ValueError(f"{where}: 'runs' must map modes to lists of runs")
    unknown = [mode for mode in runs if mode not in RUN_MODES]
    if unknown:
        raise ValueError(f"{where}: unknown modes {unknown}; a rollout file's are {RUN_MODES}")
    measured = {}
    for mode in (m for m in RUN_MODES if m in runs):
        if not isinstance(runs[mode], list) or not runs[mode]:
            raise ValueError(f"{where}, mode {mode!r}: needs a non-empty list of runs")
        measured[mode] = tuple(_run(path, name, mode, index, record, max_batch)
                               for index, record in enumerate(runs[mode]))
    for run in measured.get("always", ()):
        others = sorted({s.arm for s in run.steps} - {always})
        if others:
            raise ValueError(f"rollout: {path}, run {run.label} ran arms {others} besides the "
                             f"workload's SD-always plan {always}")
    return WorkloadRuns(name, max_batch, always, cost, measured)


def _run(path: Path, workload: str, mode: str, index: int, record, max_batch: int
         ) -> MeasuredRun:
    where = f"rollout: {path}, run {workload} / {mode} / round {index}"
    try:
        trace = record["step_trace"]
        if list(trace["columns"]) != list(TRACE_COLUMNS):
            raise ValueError(f"step_trace columns {trace['columns']}, expected "
                             f"{list(TRACE_COLUMNS)}")
        steps = tuple(TraceStep(int(row[1]), float(row[2]), str(row[3]), int(row[4]),
                                float(row[5]), float(row[6])) for row in trace["rows"])
        run = MeasuredRun(workload, mode, index, float(record["total_s"]),
                          tuple(int(n) for n in record["prompt_lengths"]),
                          tuple(int(n) for n in record["response_lengths"]), steps)
        tokens = int(record.get("tokens", sum(run.response_lengths)))
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: not a run record ({type(error).__name__}: {error})") from None
    _check(run, tokens, max_batch, where)
    return run


def _check(run: MeasuredRun, tokens: int, max_batch: int, where: str) -> None:
    samples = len(run.response_lengths)
    if samples == 0 or len(run.prompt_lengths) != samples:
        raise ValueError(f"{where}: {len(run.prompt_lengths)} prompt lengths for {samples} "
                         "response lengths; a run has one of each per sample")
    if min(run.prompt_lengths) < 1 or min(run.response_lengths) < 1:
        raise ValueError(f"{where}: prompt and response lengths must be >= 1")
    if tokens != sum(run.response_lengths):
        raise ValueError(f"{where}: tokens {tokens} but the response lengths sum to "
                         f"{sum(run.response_lengths)}")
    if not run.total_s > 0 or any(s.seconds < 0 or s.catch_up_s < 0 for s in run.steps):
        raise ValueError(f"{where}: total_s must be > 0 and step seconds >= 0")
    if run.steps_s > run.total_s * (1 + 1e-6):
        raise ValueError(f"{where}: its steps take {run.steps_s:.4g} s, more than the whole "
                         f"run's total_s {run.total_s:.4g} s")
    if any(not 1 <= s.batch <= max_batch for s in run.steps):
        raise ValueError(f"{where}: a step runs a batch outside [1, max_batch={max_batch}]")
    depth = 0
    for arm in {s.arm for s in run.steps} - {PLAIN_ARM}:
        try:
            depth = max(depth, plan_from_key(arm).depth)
        except ValueError as error:
            raise ValueError(f"{where}: arm {error}") from None
    needed = sum(length - 1 for length in run.response_lengths)
    emitted = sum(s.emitted for s in run.steps)
    if not needed <= emitted <= needed + depth * samples:
        bound = (f"exactly {needed}" if depth == 0 else
                 f"between {needed} and {needed + depth * samples} (drafts of depth {depth} "
                 "may overshoot a row's end)")
        raise ValueError(f"{where}: its lengths and its step trace disagree: the steps commit "
                         f"{emitted} tokens, and the response lengths need {bound} (each "
                         "sample's tokens after the first, which the prefill samples)")
