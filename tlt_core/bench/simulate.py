"""`tlt bench simulate`: the scale simulator checked against measured 2-rank rollouts here,
then a projection.

Validation: for several tail shapes (`tlt_core.sim.traces` families, 64 forced-length requests in
groups of 8, on prompts whose natural responses are longer than any forced length), 2 gloo
ranks (one thread each) each calibrate a cost model on their engine (in parallel, as they then
run; every measurement swept `reps` times, medians kept), then roll out each trace `reps`
times with SD off and with SD (6,1,7) on every step; the simulator predicts each median
makespan from rank 0's cost model (SD off from its SD_OFF steps, with no drafter in the loop)
and the run's mean acceptance. A row per (shape, mode): measured, predicted, error.
Projection: the simulator alone, for many workers and a long trace, with a cost model from a
calibration file (the GPU script writes one) or this machine's: a projection, not a
measurement.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_core.adaptive.cost_model import calibrate
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.sim.simulator import adaptive_plan, load_calibration, save_calibration, simulate
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


def _worker(rank: int, world: int, rendezvous: str, setup: dict) -> None:
    torch.set_num_threads(1)
    tokenizer = CharTokenizer()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    group = WorkerGroup()
    target = load_checkpoint(setup["target"]).eval()
    drafter = Drafter.load(setup["drafter"], target).eval()
    engine = RolloutEngine(target, EngineConfig(max_batch=32, max_len=600, seed=0), drafter)
    # Prompts whose natural responses outlast every forced length (57+ countdown steps: about
    # 400 tokens before <eos>), so a forced length cuts a response short and never runs past
    # its end into text no drafter was trained on. Calibrated on the same kind of prompts, to
    # 192 tokens, so the rates average over contexts like the replay's.
    long_prompts = [tuple(tokenizer.prompt_ids(p.prompt)) for p in generate_problems(
        TaskConfig(seed=31, num_problems=12, min_steps=57, max_steps=63))]
    calibration = replay_requests([192] * 4, long_prompts[8:], group_size=1)
    cost = calibrate(engine, [PLAN], CALIBRATION_BATCHES, calibration, max_tokens=192,
                     sd_off=True, reps=setup["reps"])
    if rank == 0:
        save_calibration(cost, setup["calibration"], "cpu")
    prompts = long_prompts[:8]
    rows, round_id = [], 0
    for shape, params in SHAPES.items():
        lengths = sample_lengths(count=64, seed=7, max_length=400, **params)
        requests = replay_requests(lengths, prompts)
        for mode, plan in (("off", None), ("sd", PLAN)):
            times, accepted = [], []
            for _ in range(setup["reps"]):
                _, stats = rollout_round(group, engine, requests, round_id, plan, group_size=8)
                round_id += 1
                times.append(stats.makespan_s)
                accepted.append(group.mean(stats.acceptance_length))
                steps = group.all_reduce_sum(torch.tensor([float(len(stats.trace_time_s))]))
            rows.append({"shape": shape, "mode": mode, "lengths": lengths,
                         "measured_s": sorted(times)[len(times) // 2], "rank": rank,
                         "measured_steps": float(steps[0]) / world,
                         "acceptance_length": (sum(accepted) / len(accepted)
                                               if plan is not None else None)})
    if rank == 0:
        Path(setup["out"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/test_workers.py: no C++ static teardown


def validate(target_folder: Path, drafter_folder: Path, reps: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        setup = {"target": str(target_folder), "drafter": str(drafter_folder), "reps": reps,
                 "out": str(folder / "rows.json"), "calibration": str(folder / "cost.json")}
        mp.spawn(_worker, args=(2, str(folder / "rendezvous"), setup), nprocs=2, join=True)
        rows = json.loads((folder / "rows.json").read_text())
        calibration = json.loads((folder / "cost.json").read_text())
        cost = load_calibration(folder / "cost.json")
    for row in rows:
        plan = None if row["mode"] == "off" else PLAN
        # the workload's acceptance is an input: forced lengths run past the natural end of a
        # response, where drafts are accepted less than on the calibration's text
        measured = {PLAN.key: row["acceptance_length"]} if plan is not None else None
        predicted = simulate(row["lengths"], cost, workers=2, max_batch=32, group_size=8,
                             plan=None if plan is None else lambda batch: PLAN,
                             acceptance=measured)
        row["predicted_s"] = predicted.makespan_s
        row["idle_worker_s"] = predicted.idle_worker_s
        row["predicted_steps"] = predicted.steps
        row["error"] = predicted.makespan_s / row["measured_s"] - 1
        row["max_over_median"] = max(row["lengths"]) / sorted(row["lengths"])[32]
        del row["lengths"], row["rank"]
    return {"rows": rows, "calibration": calibration, "cost_model": cost,
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
    plans = [Strategy(*map(int, key.strip("()").split(","))) for key in cost.acceptance
             if key.startswith("(")]
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
