"""`tlt bench simulate`: the scale simulator checked against measured 2-rank rollouts here,
then a projection.

Validation: for several tail shapes (`tlt_core.sim.traces` families; by default 64
forced-length requests in groups of 8, at most 400 tokens), 2 gloo ranks (one thread each) each
calibrate a cost model on their engine (in parallel, as they then run; every measurement swept
`reps` times, medians kept), then roll out each trace `reps` times with SD off and with SD
(6,1,7) on every step; the simulator predicts each median makespan from rank 0's cost model (SD
off from its SD_OFF steps, with no drafter in the loop) and the run's acceptance per row context
(AcceptanceByContext, from every rank's SD steps). A row per (shape, mode): measured,
predicted, error.

The model: the embedded one by default, on prompts whose natural responses are longer than any
forced length (embedded_replay); or a checkpoint (`--model DIR --drafter DIR`, model_replay) on
its workload's prompts (ModelWorkload.prompts: `--data`, or the arithmetic problems), in its
dtype and on its device. A forced length is a request with no stop ids and max_tokens = the
trace's length, so a response longer than the model's natural one runs on past its end-of-turn
token, where drafts are accepted less: the acceptance measured on the run is the simulator's
input, as for the embedded model. Rows and result name the model (`model`).

Runtime on a checkpoint: MODEL_SIZES (32 requests in groups of 4, at most 128 tokens,
calibrated on 32-token responses at batches 1-16) is sized for SmolLM2-135M in bf16 on 2 CPU
cores with the default 3 reps. An estimate, not a measurement, from its costs there (~75
tokens/s decoding at batch 1 and ~700 at batch 32 on both cores, so about half on a one-thread
rank): ~30 s a calibration sweep, ~6 s a rollout of 16 rows a rank (30 rollouts), ~30 s of
loading: about 5-6 minutes in all.

Projection: the simulator alone, for many workers and a long trace, with a cost model from a
calibration file (the GPU script writes one) or the one measured here: a projection, not a
measurement.

`--rollout FILE` checks the simulator against every measured run of a `tlt bench rollout`
file instead (tlt_core.bench.simulate_rollout: one rank, each run's own plans and acceptance,
the error split into admission, step cost and schedule). The 2-rank validation stays the
default: it checks what a one-rank file cannot, groups sharded over workers and the idle time
between them, on which the projection rests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_core.adaptive.cost_model import calibrate
from tlt_core.bench.model_workload import (EMBEDDED_LABEL, ModelOptions, ModelWorkload,
                                           PerWorkload)
from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.drafting.export import load_drafter
from tlt_core.drafting.plan_keys import plan_from_key
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.embedded.workload import EmbeddedWorkload
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.sim.simulator import (AcceptanceByContext, adaptive_plan, load_calibration,
                                   save_calibration, simulate)
from tlt_core.sim.traces import replay_requests, sample_lengths
from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.round import rollout_round

SHAPES = {
    "lognormal_s0.5": dict(family="lognormal", median=48, sigma=0.5),
    "lognormal_s1.0": dict(family="lognormal", median=40, sigma=1.0),
    "lognormal_s1.5": dict(family="lognormal", median=32, sigma=1.5),
    "pareto_a1.5": dict(family="pareto", minimum=20, alpha=1.5),
    "uniform": dict(family="uniform", low=32, high=64),
}
PLAN = Strategy(6, 1, 7)
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32)
CALIBRATION_PROMPTS = 4
WORLD = 2


@dataclass(frozen=True)
class TraceSizes:
    """The validation's traces; the defaults are the embedded run's, MODEL_SIZES a
    checkpoint's."""
    requests: int = 64  # per trace, both ranks together (a rank runs its half at once)
    group_size: int = 8  # a trace's requests share a prompt (and a length scale) in groups
    max_length: int = 400  # longest forced response
    calibration_tokens: int = 192  # each calibration request's forced length

    def __post_init__(self):
        for name in ("requests", "group_size", "max_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if not isinstance(self.calibration_tokens, int) or self.calibration_tokens < 2:
            raise ValueError(f"calibration_tokens: must be an int >= 2, got "
                             f"{self.calibration_tokens!r}")
        if self.requests % (self.group_size * WORLD):
            raise ValueError(f"requests: {self.requests} must be a multiple of group_size x "
                             f"{WORLD} ranks = {self.group_size * WORLD}")


MODEL_SIZES = TraceSizes(requests=32, group_size=4, max_length=128, calibration_tokens=32)


# `tlt bench simulate`'s trace sizes: DEFAULTS.config(model, flags)
DEFAULTS = PerWorkload(TraceSizes(), MODEL_SIZES)


@dataclass(frozen=True)
class SimulateOptions:
    """`tlt bench simulate`: the traces (None: the workload's TraceSizes), the measurement and
    the projection."""
    json: Path | None = option("write rows + projection", None, metavar="FILE")
    rollout: Path | None = option("validate on every measured run of this `tlt bench rollout "
                                  "--json` file instead (its calibration, lengths, plans and "
                                  "acceptance; no model runs, no projection)", None,
                                  metavar="FILE")
    simulations: int = option("simulations averaged per measured run, with --rollout", 8)
    reps: int = option("calibration sweeps and measured rollouts per row (medians)", 3)
    requests: int | None = option(DEFAULTS.help("requests per trace, both ranks together",
                                                "requests"), None, metavar="N")
    group_size: int | None = option(DEFAULTS.help("requests per group (one prompt, one length "
                                                  "scale)", "group_size"), None, metavar="N")
    max_length: int | None = option(DEFAULTS.help("longest forced response length", "max_length"),
                                    None, metavar="N")
    calibration_tokens: int | None = option(
        DEFAULTS.help("forced length of the calibration's responses", "calibration_tokens"), None,
        metavar="N")
    calibration: Path | None = option("a cost-model calibration (JSON; the GPU script writes "
                                      "one) for the projection; default: the one measured here",
                                      None, metavar="FILE")
    workers: int = option("workers in the projection", 64)
    train_s_per_token: float | None = option("training seconds per generated token, for the "
                                             "projection's end-to-end speedup", None)
    rollout_share: float | None = option("the rollout's share of an SD-off step (e.g. 0.85, what "
                                         "TLT's paper reports for production traces), for an "
                                         "end-to-end speedup", None)


CLI_OPTIONS = (SimulateOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench simulate`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


@dataclass(frozen=True)
class Replay:
    """What the validation rolls out, on which model."""
    target_folder: Path
    drafter_folder: Path  # any layout load_drafter reads
    prompts: list[tuple[int, ...]]  # (requests / group_size,) token ids: one per group
    calibration_prompts: list[tuple[int, ...]]  # (CALIBRATION_PROMPTS,) token ids
    sizes: TraceSizes
    max_len: int  # the engines'
    label: str  # the model, for the rows
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")


def embedded_replay(workload: EmbeddedWorkload, sizes: TraceSizes = TraceSizes()) -> Replay:
    """The embedded model on prompts whose natural responses outlast every forced length (57+
    countdown steps: about 400 tokens before <eos>), so a forced length cuts a response short
    and never runs past its end into text no drafter was trained on; calibrated on the same
    kind of prompts, so the rates average over contexts like the replay's."""
    tokenizer = CharTokenizer()
    groups = sizes.requests // sizes.group_size
    prompts = [tuple(tokenizer.prompt_ids(p.prompt)) for p in generate_problems(
        TaskConfig(seed=31, num_problems=groups + CALIBRATION_PROMPTS, min_steps=57,
                   max_steps=63))]
    return Replay(workload.target_folder, workload.drafter_folder, prompts[:groups],
                  prompts[groups:], sizes, max_len=600, label=EMBEDDED_LABEL)


def model_replay(model: ModelWorkload, sizes: TraceSizes = MODEL_SIZES) -> Replay:
    """A checkpoint on its workload's prompts: the first one per group, the next ones for the
    calibration (wrapping around)."""
    if model.drafter_folder is None:
        raise ValueError("model: the workload needs a drafter folder (load_model_workload's "
                         "drafter)")
    groups = sizes.requests // sizes.group_size
    chosen = [model.prompts[i % len(model.prompts)] for i in range(groups + CALIBRATION_PROMPTS)]
    longest = max(sizes.max_length, sizes.calibration_tokens)
    return Replay(model.folder, model.drafter_folder, chosen[:groups], chosen[groups:], sizes,
                  max_len=max(map(len, chosen)) + longest + 16, label=model.label,
                  dtype=model.placement.dtype, device=model.placement.device)


def _worker(rank: int, world: int, rendezvous: str, setup: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    replay, reps = setup["replay"], setup["reps"]
    sizes = replay.sizes
    group = WorkerGroup(replay.device)
    target = load_checkpoint(replay.target_folder, dtype=replay.dtype,
                             device=replay.device).eval()
    drafter = load_drafter(replay.drafter_folder, target).eval()
    engine = RolloutEngine(target, EngineConfig(max_batch=sizes.requests // world,
                                                max_len=replay.max_len, seed=0), drafter)
    calibration = replay_requests([sizes.calibration_tokens] * len(replay.calibration_prompts),
                                  replay.calibration_prompts, group_size=1)
    cost = calibrate(engine, [PLAN], CALIBRATION_BATCHES, calibration,
                     max_tokens=sizes.calibration_tokens, sd_off=True, reps=reps)
    if rank == 0:
        save_calibration(cost, setup["calibration"], replay.device.type)
    rows, round_id = [], 0
    for shape, params in SHAPES.items():
        lengths = sample_lengths(count=sizes.requests, seed=7, group_size=sizes.group_size,
                                 max_length=sizes.max_length, **params)
        requests = replay_requests(lengths, replay.prompts, group_size=sizes.group_size)
        for mode, plan in (("off", None), ("sd", PLAN)):
            times, accepted, sd_steps = [], [], []
            for _ in range(reps):
                _, stats = rollout_round(group, engine, requests, round_id, plan,
                                         group_size=sizes.group_size)
                round_id += 1
                times.append(stats.makespan_s)
                accepted.append(group.mean(stats.acceptance_length))
                steps = group.all_reduce_sum(torch.tensor([float(len(stats.trace_time_s))]))
                sd_steps += [(o.context, o.batch, o.emitted) for o in stats.step_trace
                             if o.plan is not None]
            every_rank: list[list] = [[] for _ in range(world)]
            dist.all_gather_object(every_rank, sd_steps)
            rows.append({"shape": shape, "mode": mode, "lengths": lengths,
                         "measured_s": sorted(times)[len(times) // 2], "rank": rank,
                         "measured_steps": float(steps[0]) / world,
                         "acceptance_length": (sum(accepted) / len(accepted)
                                               if plan is not None else None),
                         "sd_steps": [step for part in every_rank for step in part]})
    if rank == 0:
        Path(setup["out"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/test_workers.py: no C++ static teardown


def validate(replay: Replay, reps: int = 3) -> dict:
    sizes = replay.sizes
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        setup = {"replay": replay, "reps": reps, "out": str(folder / "rows.json"),
                 "calibration": str(folder / "cost.json")}
        mp.spawn(_worker, args=(WORLD, str(folder / "rendezvous"), setup), nprocs=WORLD,
                 join=True)
        rows = json.loads((folder / "rows.json").read_text())
        calibration = json.loads((folder / "cost.json").read_text())
        cost = load_calibration(folder / "cost.json")
    rows = [{"model": replay.label, **row} for row in rows]
    # request i's prompt, as replay_requests gives it
    prompt_lengths = [len(replay.prompts[(i // sizes.group_size) % len(replay.prompts)])
                      for i in range(sizes.requests)]
    for row in rows:
        plan = None if row["mode"] == "off" else PLAN
        # the workload's acceptance is an input, per row context as the run measured it: a
        # forced length runs past the natural end of its response, where drafts are accepted
        # less than on the calibration's text, and the longest rows, which set the makespan,
        # spend the most steps there
        measured = AcceptanceByContext.measured(
            (PLAN.key, context, batch, emitted) for context, batch, emitted in row["sd_steps"])
        predicted = simulate(row["lengths"], cost, workers=WORLD,
                             max_batch=sizes.requests // WORLD, group_size=sizes.group_size,
                             plan=None if plan is None else lambda batch: PLAN,
                             acceptance=measured, prompt_lengths=prompt_lengths)
        row["predicted_s"] = predicted.makespan_s
        row["idle_worker_s"] = predicted.idle_worker_s
        row["predicted_steps"] = predicted.steps
        row["error"] = predicted.makespan_s / row["measured_s"] - 1
        ordered = sorted(row["lengths"])
        row["max_over_median"] = ordered[-1] / ordered[len(ordered) // 2]
        row["acceptance_by_context"] = {  # context bucket (2^(bucket/4) tokens) -> tokens a row
            str(bucket): mean for bucket, mean in measured.table.get(PLAN.key, {}).items()}
        del row["lengths"], row["rank"], row["sd_steps"]
    return {"model": replay.label, "rows": rows, "calibration": calibration, "cost_model": cost,
            "max_abs_error": max(abs(r["error"]) for r in rows)}


def project(cost, *, workers: int = 64, prompts: int = 256, group_size: int = 8,
            max_batch: int = 32, median: float = 1024, sigma: float = 0.8,
            max_length: int = 8192, train_s_per_token: float | None = None,
            rollout_share: float | None = None) -> dict:
    """The simulator on a large run: SD off vs the adaptive choice. The trace is an assumed
    reasoning-RL shape scaled down to keep the simulation quick (lognormal, median 1024 tokens,
    p99 / median = exp(2.326 x 0.8) = 6.4, capped at 8192), not a published one."""
    lengths = sample_lengths("lognormal", prompts * group_size, seed=1, group_size=group_size,
                             median=median, sigma=sigma, max_length=max_length)
    plans = [plan_from_key(key) for key in cost.acceptance]
    threshold = cost.threshold(plans) if plans else 0
    off = simulate(lengths, cost, workers=workers, max_batch=max_batch, group_size=group_size)
    tlt = simulate(lengths, cost, workers=workers, max_batch=max_batch, group_size=group_size,
                   plan=adaptive_plan(cost, plans, threshold))
    out = {"workers": workers, "requests": len(lengths), "median_length": median,
           "max_length": max(lengths), "sd_threshold": threshold,
           "makespan_off_s": off.makespan_s, "makespan_tlt_s": tlt.makespan_s,
           "rollout_speedup": off.makespan_s / tlt.makespan_s,
           "idle_worker_share_off": off.idle_worker_s / (workers * off.makespan_s),
           "idle_worker_s_tlt": tlt.idle_worker_s}
    if train_s_per_token is not None:
        train = train_s_per_token * sum(lengths) / workers
        out["end_to_end_speedup"] = (off.makespan_s + train) / (tlt.makespan_s + train)
    if rollout_share is not None:  # the rollout's share of an SD-off step sets the training time
        if not 0 < rollout_share <= 1:
            raise ValueError(f"rollout_share: must be in (0, 1], got {rollout_share}")
        train = off.makespan_s * (1 - rollout_share) / rollout_share
        out["rollout_share"] = rollout_share
        out["end_to_end_speedup_at_share"] = (off.makespan_s + train) / (tlt.makespan_s + train)
    return out


def format_table(result: dict) -> str:
    lines = [f"{'shape':<16}{'max/med':>8}{'mode':>6}{'measured':>10}{'predicted':>10}{'error':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['shape']:<16}{r['max_over_median']:>8.1f}{r['mode']:>6}"
                     f"{r['measured_s']:>10.3f}{r['predicted_s']:>10.3f}{100 * r['error']:>+7.1f}%")
    lines.append(f"max |error| {100 * result['max_abs_error']:.1f}%")
    return "\n".join(lines)
