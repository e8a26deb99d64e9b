"""`tlt bench drafter`: the spot-trained drafter against a frozen one, on an evolving target.

The evolving target, on the embedded model (the default): the pre-trained embedded model
fine-tuned, round by round, toward a drifted task: the same prompts, but the countdown steps
down by two (`37+04` -> `37;+04=41;+02=43;#43`), so its responses (step sizes, sums, lengths)
move away from what the initial drafter learned. Checkpoint k is the model after k x
`steps_per_round` AdamW steps (lr 1e-3, 32 sequences a step) on that task: a controlled
stand-in for RL's policy updates, whose drift does not depend on rewards.

On a checkpoint (`--model DIR --drafter DIR`, run_model), the drift is a change of answer
format: supervised fine-tuning on the project's arithmetic word problems (a seed of their own,
DRIFT_PROBLEMS_SEED, not the rollouts' prompts), each the question in the checkpoint's prompt
format (its chat template) followed by GSM8K's worked solution (`66-22 = <<66-22=44>>44`, then
`#### 44`) and the first end-of-turn id, the loss on the answer only. An instruct model answers
these questions in its own words, which is what its offline drafter learned (`tlt drafter
train`: the model's own responses); the fine-tuning moves its responses toward GSM8K's
notation. AdamW (lr MODEL_DRIFT_LR, gradients clipped to norm 1, MODEL_DRIFT_BATCH sequences a
step) on float32 master weights when the checkpoint is bf16 or fp16
(tlt_core.optim.master_weights: AdamW's small updates would round away in bf16). The rounds roll out
the workload's prompts (`--data`, or the arithmetic problems of seed 1), a fresh slice each
round, ending at the model's end-of-turn ids or `max_tokens`.

Checkpoint 0 is the given folder; checkpoint k >= 1 is written by save_checkpoint (safetensors)
into a temporary folder, and each rank loads it into its target in place, so the drafters
attached to the target see it.

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
over the makespan). Every row and the summary name the model (`model`).

Runtime on a checkpoint: MODEL_CONFIG (4 rounds, 10 fine-tuning steps between rounds, 32
requests of at most 128 tokens a round) is sized for SmolLM2-135M in bf16 on 2 CPU cores. An
estimate, not a measurement, from its costs there (~700 tokens/s decoding at batch 32 on both
cores, ~1,000 tokens/s training): ~1 minute of fine-tuning (30 steps of ~1,000 tokens plus
AdamW on 135M float32 masters), ~40 s a round for the three SD rollouts of 16 rows per
one-thread rank, and ~30 s of loading: about 4-5 minutes in all.

Shapes: B sequences, T positions.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import random
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_core.bench.model_workload import (EMBEDDED_LABEL, ModelOptions, ModelWorkload,
                                           PerWorkload)
from tlt_core.bench.speculative import embedded_requests
from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.drafting.export import load_drafter
from tlt_core.drafting.training import TOKEN_WEIGHT
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.pretrain_data import PretrainBatch, make_batches
from tlt_core.embedded.task import MODULUS, CharTokenizer, Problem, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.model.prompt_format import load_prompt_format
from tlt_core.model.transformer import Transformer
from tlt_core.optim.master_weights import MasterWeightAdamW
from tlt_core.tasks import arithmetic_problems
from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.workers.idle import IdleDetector
from tlt_core.workers.refresh import refresh
from tlt_core.workers.round import rollout_round
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer

EMBEDDED_DRIFT_LR = 1e-3
MODEL_DRIFT_LR = 1e-4
MODEL_DRIFT_BATCH = 8  # sequences a fine-tuning step
DRIFT_PROBLEMS, DRIFT_PROBLEMS_SEED = 512, 31337


@dataclass(frozen=True)
class DrafterBenchConfig:
    """How much the benchmark runs; the defaults are the embedded run's, MODEL_CONFIG a
    checkpoint's."""
    rounds: int = 8  # evolving-target rounds
    world: int = 2  # rollout ranks (processes)
    requests: int = 192  # a round's, GRPO groups of group_size
    group_size: int = 8
    steps_per_round: int = 25  # target fine-tuning steps between rounds
    extra_steps: int = 0  # the ceiling study's off-the-clock spot steps per rank and round
    max_tokens: int | None = None  # longest response; None: the embedded task's reference's
    max_batch: int | None = None  # a rank's running rows; None: its whole shard at once
    strategy: tuple[int, int, int] = (6, 1, 7)
    lr: float = 1e-3  # spot training's
    token_weight: float = TOKEN_WEIGHT

    def __post_init__(self):
        for name in ("rounds", "world", "requests", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        for name in ("steps_per_round", "extra_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        for name in ("max_tokens", "max_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if self.requests % (self.group_size * self.world):
            raise ValueError(f"requests: {self.requests} must be a multiple of group_size x "
                             f"world = {self.group_size * self.world}")


MODEL_CONFIG = DrafterBenchConfig(rounds=4, requests=32, group_size=4, steps_per_round=10,
                                  max_tokens=128)


# `tlt bench drafter`'s sizes: DEFAULTS.config(model, flags)
DEFAULTS = PerWorkload(DrafterBenchConfig(), MODEL_CONFIG)


@dataclass(frozen=True)
class DrafterOptions:
    """`tlt bench drafter`: DrafterBenchConfig's sizes (None: the workload's) and the output."""
    json: Path | None = option("write {rows: per round and rank, summary} as JSON", None,
                               metavar="FILE")
    rounds: int | None = option(DEFAULTS.help("evolving-target rounds", "rounds"), None)
    world: int = option("rollout ranks (processes)", DEFAULTS.embedded.world)
    requests: int | None = option(DEFAULTS.help("requests per round", "requests"), None)
    group_size: int | None = option(DEFAULTS.help("samples per prompt (a GRPO group; a group "
                                                  "stays on one rank)", "group_size"), None)
    extra_steps: int = option("ceiling study: spot steps per rank added after each round, off "
                              "the clock, as if the tail had left that much idle time",
                              DEFAULTS.embedded.extra_steps)
    steps_per_round: int | None = option(DEFAULTS.help("target fine-tuning steps between "
                                                       "rounds (the drift)", "steps_per_round"),
                                         None)
    max_tokens: int | None = option("longest response (default: the embedded task's longest "
                                    f"reference; with --model {MODEL_CONFIG.max_tokens})", None,
                                    metavar="N")


CLI_OPTIONS = (DrafterOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench drafter`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


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


def embedded_drift_batches(seed: int = 0) -> Iterator[PretrainBatch]:
    """The embedded model's drift: the drifted task's solutions, 32 a batch, epoch after
    epoch."""
    problems = [drifted_solution(p) for p in
                generate_problems(TaskConfig(seed=seed + 31337, num_problems=4096))]
    return (batch for epoch in itertools.count()
            for batch in make_batches(problems, CharTokenizer(), 32, seed=seed + epoch))


def gsm8k_drift_batches(folder: str | Path, device: torch.device | str = "cpu",
                        batch_size: int = MODEL_DRIFT_BATCH) -> Iterator[PretrainBatch]:
    """A checkpoint's drift (module docstring): prompt + GSM8K worked solution + end-of-turn
    id, right-padded, the loss mask on the answer, epoch after epoch in a seeded order."""
    prompt_format = load_prompt_format(folder)  # as load_model_workload encodes the prompts
    tokenizer = prompt_format.tokenizer
    end = list(tokenizer.eos_ids[:1])
    sequences = [(prompt_format.encode(p["question"]),
                  tokenizer.encode(p["answer"], add_special_tokens=False) + end)
                 for p in arithmetic_problems.generate_problems(DRIFT_PROBLEMS,
                                                                seed=DRIFT_PROBLEMS_SEED)]
    for epoch in itertools.count():
        order = list(range(len(sequences)))
        random.Random(f"{DRIFT_PROBLEMS_SEED}/{epoch}").shuffle(order)
        for first in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [sequences[i] for i in order[first:first + batch_size]]
            width = max(len(prompt) + len(answer) for prompt, answer in chosen)
            input_ids = torch.zeros(len(chosen), width, dtype=torch.int64)  # (B, T)
            loss_mask = torch.zeros(len(chosen), width, dtype=torch.bool)  # (B, T)
            for b, (prompt, answer) in enumerate(chosen):
                input_ids[b, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                loss_mask[b, len(prompt):len(prompt) + len(answer)] = True
            yield PretrainBatch(input_ids.to(device), loss_mask.to(device))


def evolving_checkpoints(target: Transformer, batches: Iterator[PretrainBatch], folder: Path, *,
                         rounds: int, steps_per_round: int, lr: float,
                         max_grad_norm: float = math.inf) -> list[Path]:
    """Checkpoint folders (save_checkpoint, under `folder`) of the target after 1, ...,
    rounds - 1 fine-tuning rounds of `steps_per_round` AdamW steps on `batches` (float32
    masters for a bf16 or fp16 target: for a float32 one, plain AdamW)."""
    model = copy.deepcopy(target).train()
    optimizer = MasterWeightAdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    folders = []
    for index in range(1, rounds):
        for _ in range(steps_per_round):
            input_ids, loss_mask = next(batches)  # (B, T) each
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            positions = positions[None].expand_as(input_ids)  # (B, T)
            logits = model(input_ids[:, :-1], positions[:, :-1]).logits  # (B, T-1, V)
            targets = loss_mask[:, 1:]  # (B, T-1): position t predicts token t + 1
            loss = torch.nn.functional.cross_entropy(logits[targets], input_ids[:, 1:][targets])
            optimizer.zero_grad()
            loss.backward()
            optimizer.clip_and_step(max_grad_norm)  # inf: no clipping
        folders.append(folder / f"round-{index}")
        save_checkpoint(model, folders[-1])
    return folders


def _worker(rank: int, world: int, rendezvous: str, setup: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    config, device, dtype = setup["config"], setup["device"], setup["dtype"]
    group = WorkerGroup(device)
    target = load_checkpoint(setup["checkpoints"][0], dtype=dtype, device=device).eval()
    frozen = load_drafter(setup["drafter"], target).eval()
    spot = load_drafter(setup["drafter"], target).eval()
    harvest = HarvestBuffer(max_bytes=8 << 20)  # about two rounds: recent targets only
    trainer = SpotTrainer(spot, harvest, SpotConfig(lr=config.lr, batch_tokens=256, seed=rank,
                                                    token_weight=config.token_weight))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no NVML on a CPU machine: the engine signal decides
        detector = IdleDetector(idle_after_s=0.0)
    strategy = Strategy(*config.strategy)
    max_batch = config.max_batch or -(-config.requests // world)
    rows = []
    for index, (checkpoint, (requests, max_len)) in enumerate(zip(setup["checkpoints"],
                                                                  setup["rounds"])):
        if index:
            with torch.no_grad():
                target.load_state_dict(load_checkpoint(checkpoint, dtype=dtype,
                                                       device=device).state_dict())
        engine_config = EngineConfig(max_batch=max_batch, max_len=max_len, seed=index)
        arms = {}
        for arm, drafter, train in (("frozen", frozen, False), ("spot_off", spot, False),
                                    ("spot_on", spot, True)):
            engine = RolloutEngine(target, engine_config, drafter, harvest if train else None)
            _, stats = rollout_round(group, engine, requests, round_id=3 * index + len(arms),
                                     strategy=strategy, trainer=trainer if train else None,
                                     detector=detector if train else None,
                                     group_size=config.group_size)
            arms[arm] = stats
        trained = arms["spot_on"].spot_steps
        if config.extra_steps:  # the ceiling study: as if the tail had left this much idle
            trained += trainer.train_until(lambda: False, max_steps=config.extra_steps).steps
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


def run(target: Transformer, drafter_folder: Path, target_folder: Path,
        config: DrafterBenchConfig = DrafterBenchConfig()) -> dict:
    """The benchmark on the embedded model (`target`, loaded from `target_folder`, float32 on
    the CPU) and its drafter folder: each round fresh task problems (family 900 + round)."""
    prompts = config.requests // config.group_size
    rounds = [embedded_requests(prompts, 1.0, 900 + index, config.max_tokens)
              for index in range(config.rounds)]
    return _run(target, target_folder, drafter_folder, rounds, config, EMBEDDED_LABEL,
                embedded_drift_batches(), lr=EMBEDDED_DRIFT_LR, max_grad_norm=math.inf,
                dtype=torch.float32, device=torch.device("cpu"))


def run_model(model: ModelWorkload, config: DrafterBenchConfig = MODEL_CONFIG) -> dict:
    """The benchmark on a checkpoint's workload (its target, folder, drafter folder, prompts
    and placement): each round the next requests / group_size prompts, wrapping around."""
    if model.drafter_folder is None:
        raise ValueError("model: the workload needs a drafter folder (load_model_workload's "
                         "drafter)")
    if config.max_tokens is None:
        raise ValueError("max_tokens: a checkpoint's rounds need a response limit")
    prompts = config.requests // config.group_size
    params = SamplingParams(temperature=1.0, max_tokens=config.max_tokens)
    rounds = []
    for index in range(config.rounds):
        chosen = model.requests(prompts, params, first=index * prompts)
        rounds.append((chosen, max(len(r.prompt_ids) for r in chosen) + config.max_tokens))
    device = model.placement.device
    return _run(model.target, model.folder, model.drafter_folder, rounds, config, model.label,
                gsm8k_drift_batches(model.folder, device), lr=MODEL_DRIFT_LR,
                max_grad_norm=1.0, dtype=model.placement.dtype, device=device)


def _run(target: Transformer, target_folder: Path, drafter_folder: Path,
         rounds: Sequence[tuple[list[Request], int]], config: DrafterBenchConfig, label: str,
         drift: Iterator[PretrainBatch], *, lr: float, max_grad_norm: float,
         dtype: torch.dtype, device: torch.device) -> dict:
    """rounds: per round (one request per prompt, the engine max_len they need); each prompt
    is sampled group_size times."""
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        checkpoints = [Path(target_folder)] + evolving_checkpoints(
            target, drift, folder, rounds=config.rounds,
            steps_per_round=config.steps_per_round, lr=lr, max_grad_norm=max_grad_norm)
        setup = {"config": config, "drafter": str(drafter_folder), "dtype": dtype,
                 "device": device, "checkpoints": [str(c) for c in checkpoints],
                 "rounds": [([r for r in prompts for _ in range(config.group_size)], max_len)
                            for prompts, max_len in rounds],  # GRPO groups
                 "out": str(folder / "rows.json")}
        mp.spawn(_worker, args=(config.world, str(folder / "rendezvous"), setup),
                 nprocs=config.world, join=True)
        rows = json.loads((folder / "rows.json").read_text())
    rows = [{"model": label, **row} for row in rows]
    return {"rows": rows, "summary": {"model": label, **summarize(rows, config.rounds)}}


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
