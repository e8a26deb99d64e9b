"""`tlt bench rollout`: the adaptive rollout loop against SD off and SD always on, side by side.

Workloads (64 requests, T = 1, each response ending at <eos>, as GRPO rolls out):
- long_tail: 8 prompts x 8 samples, the prompts at the 1/16, 3/16, ..., 15/16 quantiles of the
  embedded task's step counts (1 to 19 countdown steps: 14 to 140 tokens), so the rollout ends
  in the tail of the hardest prompt's 8 samples;
- no_tail: 8 prompts x 8 samples, every prompt at the median step count: equal lengths.
With a checkpoint (`--model DIR --drafter DIR`, `model_workloads`): long_tail is 8 arithmetic
word problems x 8 samples in its chat template, each response ending at its end-of-turn token
or 1024 tokens; no_tail the same prompts with no stop ids, every response 128 tokens.
Modes, each on its own engine over the same model and drafter:
- off: plain decoding;
- always: SD on every step with the best fixed strategy, picked by one rollout of each
  candidate on the workload (the candidates are the adaptive loop's learned-drafter plans);
- adaptive: `AdaptivePolicy.from_calibration` over those plans (switch + bandit);
- adaptive_suffix: the same plus suffix-match plans (drafts copied from sibling responses and
  from the previous round's responses to the same prompts).
One unmeasured round first runs every mode (allocations, the bandit's first rewards, the suffix
index's history); then `rounds` measured rounds run the modes interleaved, the policies keeping their
state from round to round as they would from one RL step to the next. Numbers are medians over
the rounds. `tail_s` is the time with the running batch at or below the adaptive switch's
calibrated threshold; `ideal_makespan_s` is the generated tokens over plain decoding's
throughput at the full batch (from the calibration). The drafter-sync study times the adaptive
mode with the drafter following every SD-off step ("eager") and with the batched backlog
("lazy", the default); the graph-pool study (CUDA only) captures decode and verify graphs for
every (bucket, plan) in one shared pool and in private pools, one graph per strategy.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_core.adaptive.policy import DEFAULT_PLANS, SAMPLED_PLANS, AdaptivePolicy
from tlt_core.bench.model_workload import EMBEDDED_LABEL, ModelOptions, ModelWorkload
from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import (Request, SamplingParams, acceptance_by_position,
                                     seconds_at_or_below)

MODES = ("off", "always", "adaptive", "adaptive_suffix")
SUFFIX_PLANS = (SuffixMatch(8), SuffixMatch(16))


@dataclass(frozen=True)
class RolloutOptions:
    """`tlt bench rollout`: rounds, the SD-always strategy and the outputs."""
    json: Path | None = option("write rows and studies here", None, metavar="FILE")
    plot: Path | None = option("plot the running batch over time per mode here", None,
                               metavar="PNG")
    rounds: int = option("measured rounds per mode (medians), after one unmeasured round", 3)
    always: str | None = option("SD-always's strategy (default: the best of one rollout per "
                                "adaptive plan)", None, metavar="D,K,N")
    max_tokens: int = option("with --model: longest long-tail response", 1024, metavar="N")
    sampled_drafts: bool = option("add sampled chains (each draft token drawn from the "
                                  "drafter's distribution) to the adaptive modes' plans", False)
    no_progress: bool = option("no progress bars", False)


CLI_OPTIONS = (RolloutOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench rollout`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


def workloads(samples: int = 8, prompts: int = 8, seed: int = 5) -> dict[str, list[Request]]:
    tokenizer = CharTokenizer()
    problems = sorted(generate_problems(TaskConfig(seed=seed, num_problems=4096)),
                      key=lambda p: p.num_steps)
    quantiles = [problems[(2 * i + 1) * len(problems) // (2 * prompts)] for i in range(prompts)]
    median = problems[len(problems) // 2].num_steps
    equal = [p for p in problems if p.num_steps == median][:prompts]
    params = SamplingParams(temperature=1.0, max_tokens=7 * 63 + 16, stop_ids=(tokenizer.eos_id,))
    return {name: [Request(tokenizer.prompt_ids(p.prompt), params)
                   for p in chosen for _ in range(samples)]
            for name, chosen in (("long_tail", quantiles), ("no_tail", equal))}


def calibration_requests(count: int = 4, seed: int = 77) -> list[Request]:
    tokenizer = CharTokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=16, stop_ids=(tokenizer.eos_id,))
    return [Request(tokenizer.prompt_ids(p.prompt), params)
            for p in generate_problems(TaskConfig(seed=seed, num_problems=count))]


def model_workloads(model: ModelWorkload, samples: int = 8, prompts: int = 8,
                    max_tokens: int = 1024, no_tail_tokens: int = 128
                    ) -> tuple[dict[str, list[Request]], list[Request], int]:
    """A checkpoint's workloads, calibration requests and engine max_len: long_tail is
    `prompts` prompts x `samples` samples at T = 1, each ending at the model's stop ids or
    max_tokens; no_tail the same prompts with no stop ids, every response exactly
    no_tail_tokens long (the batch never shrinks: SD should stay off)."""
    tail = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_ids=model.stop_ids)
    flat = SamplingParams(temperature=1.0, max_tokens=no_tail_tokens)  # no stop ids
    long_tail = [r for r in model.requests(prompts, tail) for _ in range(samples)]
    no_tail = [Request(r.prompt_ids, flat) for r in long_tail]
    calibration = model.requests(4, SamplingParams(temperature=1.0, max_tokens=16),
                                 first=prompts)
    longest = max(max_tokens, no_tail_tokens)
    max_len = max(len(r.prompt_ids) for r in long_tail + calibration) + longest + 16
    return {"long_tail": long_tail, "no_tail": no_tail}, calibration, max_len


def run(target, drafter, *, rounds: int = 3, max_batch: int = 64, seed: int = 0,
        progress: bool = True, workload_set: dict[str, list[Request]] | None = None,
        calibration: list[Request] | None = None, max_len: int = 7 * 63 + 16 + 16,
        always: DraftPlan | None = None, studies: bool = True,
        label: str = EMBEDDED_LABEL, sampled_drafts: bool = False) -> dict:
    """workload_set / calibration / max_len: the embedded task's by default (model_workloads
    makes a checkpoint's). always: SD-always's plan (default: the best of a sweep over the
    adaptive plans, one rollout each). studies: also the drafter-sync and graph-pool studies.
    sampled_drafts: the adaptive modes' arms include SAMPLED_PLANS."""
    plans = DEFAULT_PLANS + (SAMPLED_PLANS if sampled_drafts else ())
    config = EngineConfig(max_batch=max_batch, max_len=max_len, seed=seed)
    calibration = calibration or calibration_requests()
    workload_set = workload_set or workloads()
    rows, studies_out = [], {}
    for workload, requests in workload_set.items():
        engines = {mode: RolloutEngine(target, config, drafter) for mode in MODES}
        policies = {"off": None}
        policies["adaptive"] = AdaptivePolicy.from_calibration(
            engines["adaptive"], plans, calibration)
        policies["adaptive_suffix"] = AdaptivePolicy.from_calibration(
            engines["adaptive_suffix"], plans + SUFFIX_PLANS, calibration)
        model = policies["adaptive"].cost_model
        threshold = policies["adaptive"].sd_batch_max()
        sweep = ({} if always is not None else
                 {plan: engines["always"].generate(requests, plan).total_s
                  for plan in plans})
        policies["always"] = always if always is not None else min(sweep, key=sweep.get)
        results = {mode: [] for mode in MODES}
        bar = tqdm(total=(rounds + 1) * len(MODES), disable=not progress, unit="rollout",
                   desc=f"rollout {workload}")
        for round_index in range(rounds + 1):
            for mode in MODES:
                result = engines[mode].generate(requests, policies[mode])
                if round_index > 0:  # round 0 is not measured
                    results[mode].append(result)
                bar.update()
        bar.close()
        makespan = {m: statistics.median(r.total_s for r in results[m]) for m in MODES}
        saturated = model.rate(max_batch, None)
        for mode in MODES:
            runs = results[mode]
            tokens = statistics.median(sum(len(x.tokens) for x in r.rollouts) for r in runs)
            acceptance = [r.acceptance_length for r in runs if r.acceptance_length is not None]
            rows.append({
                "model": label, "workload": workload, "mode": mode,
                "makespan_s": makespan[mode],
                "tok_s": tokens / makespan[mode],
                "tail_s": statistics.median(
                    seconds_at_or_below(r.trace_time_s.tolist(), r.trace_running.tolist(),
                                        threshold) for r in runs),
                "acceptance_length": statistics.mean(acceptance) if acceptance else None,
                "acceptance_by_position": acceptance_by_position(
                    [step for r in runs for step in r.spec_steps]),
                "speedup_vs_off": makespan["off"] / makespan[mode],
                "tokens": tokens, "ideal_makespan_s": tokens / saturated,
                "strategy": (policies[mode].key if mode == "always" else None),
                "sd_on_share": (policies[mode].stats.sd_on_share
                                if isinstance(policies[mode], AdaptivePolicy) else None)})
        studies_out[workload] = {
            "threshold": threshold, "calibration_s": model.calibration_s,
            "traces": {m: {"time_s": results[m][-1].trace_time_s.tolist(),
                           "running": results[m][-1].trace_running.tolist()} for m in MODES},
            "always_sweep_s": {p.key: s for p, s in sweep.items()},
            "cost_model_tok_s": {f"{b}/{k}": v for (b, k), v in model.rates.items()}}
        # A workload's four engines hold four KV caches (3.5 GB each for 64 rows of 1k tokens
        # of SmolLM2): free them before the next workload builds its own.
        del engines, policies, results
        gc.collect()
    if studies:
        studies_out["drafter_sync"] = drafter_sync_study(
            target, drafter, config, workload_set["long_tail"], calibration, rounds, seed)
        studies_out["graph_pool"] = graph_pool_study(target, drafter,
                                                     DEFAULT_PLANS + SUFFIX_PLANS, max_batch)
    return {"model": label, "rows": rows, "studies": studies_out}


def drafter_sync_study(target, drafter, config, requests, calibration, rounds, seed) -> dict:
    """The adaptive mode's makespan with the drafter following SD-off steps eagerly or lazily."""
    out = {}
    engines = {sync: RolloutEngine(target, replace(config, drafter_sync=sync), drafter)
               for sync in ("eager", "lazy")}
    policies = {sync: AdaptivePolicy.from_calibration(engines[sync], DEFAULT_PLANS, calibration)
                for sync in engines}
    times = {sync: [] for sync in engines}
    for _ in range(rounds + 1):
        for sync in engines:
            times[sync].append(engines[sync].generate(requests, policies[sync]).total_s)
    for sync in engines:
        out[f"{sync}_makespan_s"] = statistics.median(times[sync][1:])
    out["lazy_speedup"] = out["eager_makespan_s"] / out["lazy_makespan_s"]
    return out


def graph_pool_study(target, drafter, plans, max_batch: int) -> dict:
    """CUDA only: the engine's decode graphs (every batch bucket, context bucket and plan a call
    of max_batch rows may run) captured in one shared pool, against one pool per graph."""
    if not torch.cuda.is_available() or next(target.parameters()).device.type != "cuda":
        return {"available": False, "why": "needs the target on a CUDA device"}
    memory = {}
    for pool in ("shared", "per_graph"):
        engine = RolloutEngine(target, EngineConfig(max_batch=max_batch, max_len=512,
                                                    graphs=True, graph_pool=pool), drafter)
        engine.graphs.capture(plans, drafter.config.feature_layers, max_batch, 512)
        memory[pool] = engine.graph_memory()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return {"available": True, "shared_pool_bytes": memory["shared"]["reserved_bytes"],
            "naive_bytes": memory["per_graph"]["reserved_bytes"],
            "graphs_shared": memory["shared"]["graphs"],
            "graphs_naive": memory["per_graph"]["graphs"]}


def plot(result: dict, path) -> None:
    """Running batch over time, per mode, for each workload (the last measured round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_ = [w for w in ("long_tail", "no_tail") if w in result["studies"]]
    fig, axes = plt.subplots(1, len(workloads_), figsize=(6 * len(workloads_), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads_):
        study = result["studies"][workload]
        for mode, trace in study["traces"].items():
            ax.step(trace["time_s"], trace["running"], where="pre", label=mode)
        ax.axhline(study["threshold"], color="gray", linestyle="--", linewidth=1,
                   label="SD threshold")
        ax.set_xlabel("seconds")
        ax.set_ylabel("running batch")
        ax.set_title(f"{workload}: {result.get('model', EMBEDDED_LABEL)}, T=1", fontsize=9)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    lines = [f"{'workload':<10}{'mode':<21}{'makespan':>9}{'tok/s':>8}{'tail_s':>8}"
             f"{'accept':>8}{'vs off':>8}"]
    for r in result["rows"]:
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        lines.append(f"{r['workload']:<10}{r['mode']:<21}{r['makespan_s']:>9.3f}"
                     f"{r['tok_s']:>8.0f}{r['tail_s']:>8.3f}{acc:>8}"
                     f"{r['speedup_vs_off']:>7.2f}x")
    for workload in ("long_tail", "no_tail"):
        s = result["studies"][workload]
        lines.append(f"{workload}: SD threshold {s['threshold']} (calibrated in "
                     f"{s['calibration_s']:.1f} s), ideal makespan "
                     f"{next(r['ideal_makespan_s'] for r in result['rows'] if r['workload'] == workload):.3f} s")
    sync = result["studies"].get("drafter_sync")
    if sync is not None:
        lines.append(f"drafter sync (long_tail, adaptive): eager {sync['eager_makespan_s']:.3f} "
                     f"s, lazy {sync['lazy_makespan_s']:.3f} s ({sync['lazy_speedup']:.2f}x)")
    pool = result["studies"].get("graph_pool")
    if pool is not None:
        lines.append("graph pool: " + (f"{pool['shared_pool_bytes'] / 2**20:.1f} MiB shared vs "
                                       f"{pool['naive_bytes'] / 2**20:.1f} MiB naive"
                                       if pool["available"] else pool["why"]))
    return f"model: {result.get('model', EMBEDDED_LABEL)}\n" + "\n".join(lines)
