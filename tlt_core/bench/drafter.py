"""`tlt bench drafter`: the spot-trained drafter against a frozen one, on an evolving target.

The evolving target: the pre-trained embedded model fine-tuned, round by round, toward a
drifted task: the same prompts, but the countdown steps down by two (`37+04` ->
`37;+04=41;+02=43;#43`), so its responses (step sizes, sums, lengths) move away from what the
initial drafter learned. Checkpoint k is the model after k x `steps_per_round` AdamW steps on
that task: a controlled stand-in for RL's policy updates, whose drift does not depend on
rewards.

Each round's requests are GRPO groups: `requests / group_size` prompts, `group_size` samples
each (T = 1), a group's samples on one rank (`WorkerGroup.shard`), so the ranks' loads differ as
in RL, where a hard prompt's samples are all long. Each round, on `world` ranks (gloo, one
thread each) and the same requests and seeds:
1. frozen: SD with the initial drafter, no spot training (its acceptance is the baseline);
2. spot off: SD with the current spot-trained drafter, no training (makespan baseline);
3. spot on: the same, with harvest and idle-time spot training, then the step-weighted
   refresh of the replicas (the drafter the next round uses).
`extra_steps` > 0 adds that many training steps per rank after each round, off the clock: not
what a deployment does, but the ceiling study of what more idle time would buy.
Rows per round; a summary with `spot_vs_frozen_acceptance` (mean acceptance, spot over frozen,
last half of the rounds), `spot_training_overhead` (makespan on / off - 1, summed over the
rounds: an A/B comparison, as noisy as the machine) and `spot_training_overhead_accounted` (the
same cost measured directly: the critical rank's harvest time plus the idle ranks' yield lag,
over the makespan).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_core.bench.speculative import embedded_requests
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.training import TOKEN_WEIGHT
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.pretrain_data import make_batches
from tlt_core.embedded.task import MODULUS, CharTokenizer, Problem, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.workers.idle import IdleDetector
from tlt_core.workers.refresh import refresh
from tlt_core.workers.round import rollout_round
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer


def drifted_solution(problem: Problem) -> Problem:
    """The drifted task: count the step down by two instead of one."""
    start, step = int(problem.prompt[:2]), int(problem.prompt[3:])
    sign = 1 if problem.prompt[2] == "+" else -1
    lines, value = [problem.prompt[:2]], start
    while step > 0:
        value = (value + sign * step) % MODULUS
        lines.append(f"{problem.prompt[2]}{step:02d}={value:02d}")
        step -= 2
    solution = ";".join(lines) + f";#{value:02d}"
    return Problem(problem.prompt, solution, f"{value:02d}", len(lines) - 1)


def evolving_checkpoints(target, rounds: int, steps_per_round: int, seed: int = 0) -> list[dict]:
    """state_dicts of the target after 0, 1, ... rounds - 1 fine-tuning rounds on the drift."""
    model = copy.deepcopy(target).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    problems = [drifted_solution(p) for p in
                generate_problems(TaskConfig(seed=seed + 31337, num_problems=4096))]
    batches = (batch for epoch in itertools.count()
               for batch in make_batches(problems, CharTokenizer(), 32, seed=seed + epoch))
    states = [{k: v.detach().clone() for k, v in target.state_dict().items()}]
    for _ in range(rounds - 1):
        for _ in range(steps_per_round):
            input_ids, loss_mask = next(batches)
            positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
            logits = model(input_ids[:, :-1], positions[:, :-1]).logits
            targets = loss_mask[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[targets], input_ids[:, 1:][targets])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def _worker(rank: int, world: int, rendezvous: str, setup: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    group = WorkerGroup()
    target = load_checkpoint(setup["target"]).eval()
    frozen = Drafter.load(setup["drafter"], target).eval()
    spot = Drafter.load(setup["drafter"], target).eval()
    harvest = HarvestBuffer(max_bytes=8 << 20)  # about two rounds: recent targets only
    trainer = SpotTrainer(spot, harvest, SpotConfig(lr=setup["lr"], batch_tokens=256,
                                                    seed=rank,
                                                    token_weight=setup["token_weight"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no NVML on a CPU machine: the engine signal decides
        detector = IdleDetector(idle_after_s=0.0)
    strategy = Strategy(*setup["strategy"])
    states = torch.load(setup["checkpoints"], weights_only=True)
    rows = []
    for index, state in enumerate(states):
        with torch.no_grad():
            target.load_state_dict(state)
        prompts, max_len = embedded_requests(setup["requests"] // setup["group_size"], 1.0,
                                             900 + index, None)
        requests = [r for r in prompts for _ in range(setup["group_size"])]  # GRPO groups
        config = EngineConfig(max_batch=setup["max_batch"], max_len=max_len, seed=index)
        arms = {}
        for arm, drafter, train in (("frozen", frozen, False), ("spot_off", spot, False),
                                    ("spot_on", spot, True)):
            engine = RolloutEngine(target, config, drafter, harvest if train else None)
            _, stats = rollout_round(group, engine, requests, round_id=3 * index + len(arms),
                                     strategy=strategy, trainer=trainer if train else None,
                                     detector=detector if train else None,
                                     group_size=setup["group_size"])
            arms[arm] = stats
        trained = arms["spot_on"].spot_steps
        if setup["extra_steps"]:  # the ceiling study: as if the tail had left this much idle
            trained += trainer.train_until(lambda: False, max_steps=setup["extra_steps"]).steps
        refreshed = refresh(group, spot, trained)
        rows.append({"round": index, "rank": rank, "refreshed": refreshed,
                     "extra_steps": trained - arms["spot_on"].spot_steps,
                     **{f"{arm}_{key}": getattr(s, key) for arm, s in arms.items()
                        for key in ("acceptance_length", "makespan_s", "rollout_s",
                                    "idle_s", "spot_steps", "tokens", "harvest_s",
                                    "yield_lag_s")}})
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(setup["out"]).write_text(json.dumps([r for part in gathered for r in part]))
    dist.barrier()  # leave together
    dist.destroy_process_group()
    # Under load, a rank has aborted in C++ static teardown at interpreter exit ("terminate
    # called without an active exception") after all its work was done and written; leave
    # without running those destructors (the cause is unknown; README, "Limitations").
    os._exit(0)


def run(target, drafter_folder: Path, target_folder: Path, *, rounds: int = 8, world: int = 2,
        requests: int = 192, group_size: int = 8, max_batch: int | None = None,
        steps_per_round: int = 25, extra_steps: int = 0,
        strategy=(6, 1, 7), lr: float = 1e-3, token_weight: float = TOKEN_WEIGHT) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if requests % (group_size * world):
            raise ValueError(f"requests: {requests} must be a multiple of group_size x world = "
                             f"{group_size * world}")
        torch.save(evolving_checkpoints(target, rounds, steps_per_round), folder / "ckpt.pt")
        setup = {"target": str(target_folder), "drafter": str(drafter_folder),
                 "checkpoints": str(folder / "ckpt.pt"), "requests": requests,
                 "group_size": group_size, "extra_steps": extra_steps,
                 # default: a rank admits its whole shard at once, as an RL rollout does, so
                 # the ranks' longest responses decide who idles in the tail
                 "max_batch": max_batch or -(-requests // world), "strategy": list(strategy), "lr": lr,
                 "token_weight": token_weight,
                 "out": str(folder / "rows.json")}
        mp.spawn(_worker, args=(world, str(folder / "rendezvous"), setup), nprocs=world,
                 join=True)
        rows = json.loads((folder / "rows.json").read_text())
    return {"rows": rows, "summary": summarize(rows, rounds)}


def summarize(rows: list[dict], rounds: int) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else math.nan

    late = [r for r in rows if r["round"] >= rounds // 2]
    spot, frozen = mean(r["spot_on_acceptance_length"] for r in late), \
        mean(r["frozen_acceptance_length"] for r in late)
    makespan = {arm: sum(max(r[f"{arm}_makespan_s"] for r in rows if r["round"] == k)
                         for k in range(rounds)) for arm in ("spot_on", "spot_off")}
    # The same overhead by accounting, free of run-to-run noise: per round, the harvest time
    # of the rank that finished last (the critical path) plus the slowest yield of an idle rank.
    accounted = 0.0
    for k in range(rounds):
        ranks = [r for r in rows if r["round"] == k]
        critical = max(ranks, key=lambda r: r["spot_on_rollout_s"])
        accounted += critical.get("spot_on_harvest_s", 0.0) + max(
            r.get("spot_on_yield_lag_s", 0.0) for r in ranks)
    return {"spot_vs_frozen_acceptance": spot / frozen,
            "spot_training_overhead": makespan["spot_on"] / makespan["spot_off"] - 1,
            "spot_training_overhead_accounted": accounted / makespan["spot_on"],
            "mean_acceptance_spot_last_half": spot, "mean_acceptance_frozen_last_half": frozen,
            "spot_steps_total": sum(r["spot_on_spot_steps"] for r in rows),
            "extra_steps_total": sum(r.get("extra_steps", 0) for r in rows),
            "makespan_spot_on_s": makespan["spot_on"], "makespan_spot_off_s": makespan["spot_off"]}


def format_table(result: dict) -> str:
    lines = [f"{'round':>5}{'frozen':>8}{'spot':>8}{'steps':>7}{'mk_off':>8}{'mk_on':>8}"]
    rounds = sorted({r["round"] for r in result["rows"]})
    for k in rounds:
        rs = [r for r in result["rows"] if r["round"] == k]
        acc = lambda key: sum(r[key] or 0 for r in rs) / len(rs)  # noqa: E731
        lines.append(f"{k:>5}{acc('frozen_acceptance_length'):>8.2f}"
                     f"{acc('spot_on_acceptance_length'):>8.2f}"
                     f"{sum(r['spot_on_spot_steps'] for r in rs):>7}"
                     f"{max(r['spot_off_makespan_s'] for r in rs):>8.2f}"
                     f"{max(r['spot_on_makespan_s'] for r in rs):>8.2f}")
    s = result["summary"]
    lines.append(f"spot_vs_frozen_acceptance {s['spot_vs_frozen_acceptance']:.2f}, "
                 f"spot_training_overhead {100 * s['spot_training_overhead']:+.1f}% (A/B), "
                 f"{100 * s['spot_training_overhead_accounted']:.2f}% (accounted)")
    return "\n".join(lines)
