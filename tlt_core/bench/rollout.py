"""`tlt bench rollout`: the adaptive loop against SD off and SD always on, on workloads with and
without a long tail, with the evidence to trust a ratio: per-step traces, a hindsight oracle and
a noise floor.

Workloads (`--workload`, 8 prompts x 8 samples at T = 1):
- natural: each response ends at the model's own end of turn or max_tokens (1024 with --model);
- trace: the same prompts, each row decoded to exactly a length drawn from a long-tailed
  distribution (tlt_core.bench.length_trace: lognormal, p99 10x the median; or --trace-file): a
  forced output length, as vLLM's benchmarks fix one, labelled as such. Its stop ids are masked
  up to that length (tlt_core.engine.records.exact_length), so the model keeps writing its
  response, as a long RL response does, instead of decoding on past its end of turn into text
  no response holds (what dropping the stop ids gives: SmolLM2 then writes new chat turns and,
  at T = 1, drifts into noise a drafter cannot predict);
- no_tail: the same prompts, every row the same length (the trace's median), stops masked alike.
Modes, each on its own engine over the same model and drafter:
- off: plain decoding, no drafter in the loop;
- always: SD on every step with one plan (--always; default: the plan calibration predicts
  fastest at one row);
- adaptive: `AdaptivePolicy` over plain decoding and the plans (the built-in ones, or with
  --plans-from the best per batch size of a `tlt bench speculative --json` file at T = 1), its
  table carried from round to round as from one RL step to the next;
- off_reseeded: SD off with another seed, the noise floor (on natural the samples and their
  lengths differ; on trace and no_tail only the tokens);
- oracle, computed from the traces: the hindsight-best arm per cell (batch bucket x context
  bucket) replayed over SD off's batch profile: each SD-off step's seconds divided by the best
  ratio any arm measured in that cell against SD off (at least 1: plain is an arm);
  the time outside decode steps (admission, prefill) stays.
One calibration (shared by the workloads; each measurement also with prompts stretched to the
engine's longest context, so the cost model prices the long rows of the tail by a context slope
measured that far), one unmeasured round of every mode, then `rounds` measured rounds with the
modes interleaved (each round starting with the next mode), so machine noise hits them alike.
A mode's `tok_s` is committed tokens / makespan, the median over rounds; `speedup_vs_off` is
tok_s over SD off's: per token, so modes that sampled different lengths compare fairly.

The JSON keeps, per workload, the calibration (the simulator's input, as `save_calibration`
writes it), the adaptive loop's plans (and the file they came from) and every measured run:
prompt and response lengths per sample and the step trace.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from tlt_core.adaptive.buckets import StepBuckets
from tlt_core.adaptive.calibration_cache import CalibrationCache
from tlt_core.adaptive.cost_model import CostModel, calibrate
from tlt_core.adaptive.measured_plans import MeasuredPlans
from tlt_core.adaptive.policy import AdaptivePolicy, builtin_plans
from tlt_core.bench.length_trace import DEFAULT_MEDIAN, TraceOptions, tail_shape
from tlt_core.bench.model_workload import EMBEDDED_LABEL, ModelOptions, ModelWorkload
from tlt_core.bench.rollout_file import RUN_MODES, TRACE_COLUMNS, run_record
from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.drafting.plan import DraftPlan
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, RolloutResult, SamplingParams, exact_length
from tlt_core.sim.simulator import calibration_dict

WORKLOADS = ("natural", "trace", "no_tail")
TEMPERATURE = 1.0  # every workload samples as RL rollouts do
MODES = RUN_MODES + ("oracle",)
MIN_ORACLE_STEPS = 3  # an arm's steps in a cell before the oracle trusts its ratio there


@dataclass(frozen=True)
class RolloutOptions(TraceOptions):
    """`tlt bench rollout`: workloads, rounds, the SD-always plan, the trace's lengths and the
    outputs."""
    json: Path | None = option("write rows, calibration and every run's trace here", None,
                               metavar="FILE")
    plot: Path | None = option("plot the running batch over time per mode here", None,
                               metavar="PNG")
    workload: str = option("comma-separated workloads: natural (each response ends at its "
                           "end of turn), trace (forced lengths from a long-tailed "
                           "distribution), no_tail (every row the same length)",
                           ",".join(WORKLOADS), metavar="NAMES")
    rounds: int = option("measured rounds per mode (medians), after one unmeasured round", 3)
    always: str | None = option("SD-always's plan, D,K,N, sampled(D) or sampled(D,K) (default: "
                                "the plan calibration predicts fastest at one row)", None,
                                metavar="PLAN")
    max_tokens: int | None = option("longest response (default: 1024 with --model, the "
                                    "embedded task's longest reference otherwise)", None,
                                    metavar="N")
    sampled_drafts: bool = option("the adaptive loop's plans are sampled chains (each draft "
                                  "token drawn from the drafter's distribution) instead of the "
                                  "deterministic chains and trees, which lose to them at T > 0",
                                  False)
    plans_from: Path | None = option("the adaptive plans from a `tlt bench speculative --json` "
                                     "file: of its rows at the workloads' temperature (T = 1), "
                                     "the plan with the highest speedup at each batch size it "
                                     "measured (none: the built-in plans)", None, metavar="FILE")
    calibration_cache: Path | None = option("read the calibration from this folder when an "
                                            "earlier run on this machine stored the same one, "
                                            "else store it there (tlt_core.adaptive."
                                            "calibration_cache; none: calibrate)", None,
                                            metavar="DIR")
    no_progress: bool = option("no progress bars", False)

    def __post_init__(self):
        super().__post_init__()
        if self.plans_from is not None and self.sampled_drafts:
            raise ValueError("sampled_drafts: with --plans-from the file's plans are the "
                             "adaptive loop's, sampled chains among them where they measured "
                             "best; leave --sampled-drafts off")


CLI_OPTIONS = (RolloutOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench rollout`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


def parse_workloads(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"workload: unknown {unknown or text!r}; choose from "
                         f"{', '.join(WORKLOADS)}")
    return names


@dataclass(frozen=True)
class Workloads:
    """The requests of each workload, calibration requests, and the engine's max_len."""
    requests: dict[str, list[Request]]
    calibration: list[Request]
    max_len: int
    trace_shape: dict  # the trace lengths' median, p99, max


def build_workloads(prompts: Sequence[tuple[int, ...]], stop_ids: tuple[int, ...],
                    calibration: list[Request], names: Sequence[str], *, samples: int = 8,
                    max_tokens: int, trace_lengths: Sequence[int]) -> Workloads:
    """`prompts` x `samples` rows per workload; trace_lengths: one per row (capped at
    max_tokens)."""
    rows = [prompt for prompt in prompts for _ in range(samples)]
    lengths = [min(length, max_tokens) for length in trace_lengths][:len(rows)]
    if len(lengths) < len(rows):
        raise ValueError(f"trace: {len(lengths)} lengths for {len(rows)} rows; give at least "
                         f"{len(rows)}")
    shape = tail_shape(lengths)
    natural = SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, stop_ids=stop_ids)
    build = {
        "natural": lambda: [Request(p, natural) for p in rows],
        "trace": lambda: [Request(p, exact_length(natural, n)) for p, n in zip(rows, lengths)],
        "no_tail": lambda: [Request(p, exact_length(natural, shape["median"])) for p in rows]}
    requests = {name: build[name]() for name in names}
    longest_prompt = max(len(r.prompt_ids) for r in rows_of(requests) + calibration)
    return Workloads(requests, calibration, longest_prompt + max_tokens + 16, shape)


def rows_of(requests: dict[str, list[Request]]) -> list[Request]:
    return [r for rs in requests.values() for r in rs]


def embedded_workloads(names: Sequence[str], options: RolloutOptions, seed: int = 5
                       ) -> Workloads:
    """The embedded task's: 8 prompts at the 1/16, 3/16, ..., 15/16 quantiles of its step
    counts (14 to 140 tokens), each response ending at <eos>."""
    tokenizer = CharTokenizer()
    problems = sorted(generate_problems(TaskConfig(seed=seed, num_problems=4096)),
                      key=lambda p: p.num_steps)
    prompts = [tuple(tokenizer.prompt_ids(problems[(2 * i + 1) * len(problems) // 16].prompt))
               for i in range(8)]
    max_tokens = options.max_tokens or 7 * 63 + 16
    calibration = [Request(tokenizer.prompt_ids(p.prompt),
                           SamplingParams(temperature=TEMPERATURE, max_tokens=16))
                   for p in generate_problems(TaskConfig(seed=77, num_problems=4))]
    return build_workloads(prompts, (tokenizer.eos_id,), calibration, names,
                           max_tokens=max_tokens,
                           trace_lengths=_trace_lengths(options, 32, max_tokens))


def model_workloads(model: ModelWorkload, names: Sequence[str], options: RolloutOptions
                    ) -> Workloads:
    """A checkpoint's: 8 of its workload prompts (arithmetic word problems in its chat
    template unless --data), calibrated on 4 others."""
    max_tokens = options.max_tokens or 1024
    prompts = [r.prompt_ids for r in model.requests(8, SamplingParams())]
    calibration = model.requests(4, SamplingParams(temperature=TEMPERATURE, max_tokens=16),
                                 first=8)
    return build_workloads(prompts, model.stop_ids, calibration, names, max_tokens=max_tokens,
                           trace_lengths=_trace_lengths(options, DEFAULT_MEDIAN, max_tokens))


def _trace_lengths(options: RolloutOptions, median: int, cap: int) -> list[int]:
    """One length per row of the 64-row workloads."""
    return options.trace_lengths(64, cap=cap, seed=0, default_median=median)[0]


def run(target, drafter, workloads: Workloads, *, rounds: int = 3, max_batch: int = 64,
        seed: int = 0, always: DraftPlan | None = None, sampled_drafts: bool = False,
        measured: MeasuredPlans | None = None, progress: bool = True,
        label: str = EMBEDDED_LABEL, calibration_cache: CalibrationCache | None = None
        ) -> dict:
    """measured: the adaptive loop's plans and fallback prediction from a `tlt bench
    speculative` file (tlt_core.adaptive.measured_plans); None: the built-in plans at the
    workloads' temperature (builtin_plans: the sampled chains alone under sampled_drafts).
    calibration_cache: where to read the calibration from (or store it); None: calibrate."""
    if rounds < 1:
        raise ValueError(f"rounds: need at least one measured round, got {rounds}")
    if measured is not None and sampled_drafts:
        raise ValueError("sampled_drafts: the measured plans are the adaptive loop's; leave "
                         "sampled_drafts off")
    plans = (measured.plans if measured is not None
             else builtin_plans(TEMPERATURE, sampled_drafts))
    config = EngineConfig(max_batch=max_batch, max_len=workloads.max_len, seed=seed)
    engine = RolloutEngine(target, config, drafter)
    batches = sorted({b for b in (1, 4, 16, max_batch) if b <= max_batch})
    cost = (calibration_cache.calibrate if calibration_cache is not None else calibrate)(
        engine, plans, batches, workloads.calibration, sd_off=True,
        long_context=workloads.max_len)
    del engine
    always = always or max(plans, key=lambda plan: cost.rate(1, plan))
    rows, details = [], {}
    for workload, requests in workloads.requests.items():
        runs = _run_modes(target, drafter, config, requests, cost, plans, always, rounds,
                          progress, f"rollout {workload}",
                          measured.cost_model(plans) if measured is not None else None)
        buckets = StepBuckets.covering(max_batch)
        oracle = hindsight_oracle(runs, buckets)
        rows += _rows(label, workload, runs, oracle, always)
        details[workload] = {
            "max_batch": max_batch, "always": always.key,
            "plans": [plan.key for plan in plans],
            "plans_from": None if measured is None else measured.source,
            "calibration": calibration_dict(cost, str(next(target.parameters()).device)),
            "calibration_cached": cost.cached_from is not None,
            "calibration_s": cost.calibration_s,
            "trace_shape": workloads.trace_shape if workload == "trace" else None,
            "oracle": {"cells": oracle["cells"]},
            "runs": {mode: [run_record(result) for result in results]
                     for mode, results in runs.items()}}
        gc.collect()  # a workload's engines hold four KV caches: free them before the next
    return {"model": label, "rows": rows, "workloads": details}


def _run_modes(target, drafter, config: EngineConfig, requests: list[Request], cost: CostModel,
               plans: tuple[DraftPlan, ...], always: DraftPlan, rounds: int, progress: bool,
               desc: str, fallback_model: CostModel | None = None
               ) -> dict[str, list[RolloutResult]]:
    """Every mode's measured results, modes interleaved round by round (the order rotating)
    after one unmeasured round; fallback_model: the adaptive loop's prediction where
    calibration timed nothing."""
    engines = {mode: RolloutEngine(target, replace(config, seed=config.seed + 1)
                                   if mode == "off_reseeded" else config,
                                   None if mode.startswith("off") else drafter)
               for mode in RUN_MODES}
    strategies = {"off": None, "off_reseeded": None, "always": always,
                  "adaptive": AdaptivePolicy.from_cost_model(cost, plans, config.max_batch,
                                                             fallback_model=fallback_model)}
    results = {mode: [] for mode in RUN_MODES}
    bar = tqdm(total=(rounds + 1) * len(RUN_MODES), disable=not progress, unit="rollout",
               desc=desc)
    for round_index in range(rounds + 1):
        # each round starts with another mode: what running first or after SD costs (a warm
        # cache, the allocator's state) falls on every mode in turn
        shift = round_index % len(RUN_MODES)
        for mode in RUN_MODES[shift:] + RUN_MODES[:shift]:
            result = engines[mode].generate(requests, strategies[mode])
            if round_index > 0:  # round 0 is not measured
                results[mode].append(result)
            bar.update()
    bar.close()
    return results


def _tokens(result: RolloutResult) -> int:
    return sum(len(r.tokens) for r in result.rollouts)


def hindsight_oracle(runs: dict[str, list[RolloutResult]], buckets: StepBuckets) -> dict:
    """The best measured arm per cell, replayed over every SD-off run (module docstring):
    {"tok_s": per round, "cells": {cell label: {"arm", "ratio", "steps", "accept",
    "step_cost"}}}. An arm's ratio in a cell is its committed tokens per second there over SD
    off's, over every mode's steps; SD off's own steps are the arm "off". What limits a ratio
    is in the other two: `accept`, the tokens a row commits per step of the arm, and
    `step_cost`, its mean step's seconds over SD off's in the cell (ratio ~ accept /
    step_cost)."""
    # (cell, arm) -> [tokens, seconds, steps, row-steps]
    sums: dict[tuple[int, str], list[float]] = {}
    for mode, results in runs.items():
        if mode == "off_reseeded":
            continue
        for result in results:
            for o in result.step_trace:
                arm = "off" if mode == "off" else o.arm
                total = sums.setdefault((buckets.cell(o.batch, o.context), arm), [0, 0.0, 0, 0])
                total[0] += o.emitted
                total[1] += o.seconds
                total[2] += 1
                total[3] += o.batch
    best: dict[int, dict] = {}
    for (cell, arm), (tokens, seconds, steps, row_steps) in sums.items():
        off = sums.get((cell, "off"))
        # the adaptive loop's plain steps are SD off's computation plus the drafter's queue:
        # never faster but by noise, so plain's option is SD off itself
        if off is None or steps < MIN_ORACLE_STEPS or arm in ("off", "plain"):
            continue
        ratio = (tokens / seconds) / (off[0] / off[1])
        if ratio > best.get(cell, {"ratio": 1.0})["ratio"]:
            best[cell] = {"arm": arm, "ratio": ratio, "steps": steps,
                          "accept": tokens / row_steps,
                          "step_cost": (seconds / steps) / (off[1] / off[2])}
    rates = []
    for result in runs["off"]:
        steps_s = sum(o.seconds for o in result.step_trace)
        replayed = sum(o.seconds / best.get(buckets.cell(o.batch, o.context),
                                            {"ratio": 1.0})["ratio"]
                       for o in result.step_trace)
        rates.append(_tokens(result) / (result.total_s - steps_s + replayed))
    return {"tok_s": rates,
            "cells": {buckets.label(cell): best[cell] for cell in sorted(best)}}


def _rows(label: str, workload: str, runs: dict[str, list[RolloutResult]], oracle: dict,
          always: DraftPlan) -> list[dict]:
    tok_s = {mode: statistics.median(_tokens(r) / r.total_s for r in results)
             for mode, results in runs.items()}
    tok_s["oracle"] = statistics.median(oracle["tok_s"])
    rows = []
    for mode in MODES:
        results = runs.get(mode, runs["off"])
        spec = [s for r in results for s in r.spec_steps] if mode in runs else []
        accepted = sum(s.emitted for s in spec)
        rows.append({
            "model": label, "workload": workload, "mode": mode, "tok_s": tok_s[mode],
            "speedup_vs_off": tok_s[mode] / tok_s["off"],
            "makespan_s": (statistics.median(r.total_s for r in results) if mode in runs
                           else statistics.median(_tokens(r) / t for r, t in
                                                  zip(results, oracle["tok_s"]))),
            "tokens": statistics.median(_tokens(r) for r in results),
            "acceptance_length": accepted / sum(s.batch for s in spec) if spec else None,
            "sd_step_share": (statistics.median(_sd_share(r) for r in results)
                              if mode in runs else None),
            "plan": always.key if mode == "always" else None})
    return rows


def _sd_share(result: RolloutResult) -> float:
    steps = result.step_trace
    return sum(o.plan is not None for o in steps) / len(steps) if steps else 0.0


def plot(result: dict, path) -> None:
    """Running batch over time per mode, for each workload (the last measured round); dots
    mark speculative steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, workload in zip(axes[0], names):
        for mode, runs in result["workloads"][workload]["runs"].items():
            rows = runs[-1]["step_trace"]["rows"]
            clock, times = 0.0, []
            for row in rows:
                clock += row[TRACE_COLUMNS.index("seconds")]
                times.append(clock)
            batch = [row[TRACE_COLUMNS.index("batch")] for row in rows]
            line, = ax.step(times, batch, where="pre", label=mode)
            sd = [(t, b) for t, b, row in zip(times, batch, rows)
                  if row[TRACE_COLUMNS.index("arm")] not in ("plain",)]
            if sd and not mode.startswith("off"):
                ax.plot(*zip(*sd), ".", markersize=2, color=line.get_color())
        speed = {r["mode"]: r["speedup_vs_off"] for r in result["rows"]
                 if r["workload"] == workload}
        ax.set_xlabel("seconds in decode steps")
        ax.set_ylabel("running batch")
        ax.set_title(f"{workload}: adaptive {speed['adaptive']:.2f}x, oracle "
                     f"{speed['oracle']:.2f}x SD off per token\n"
                     f"{result.get('model', EMBEDDED_LABEL)}, T=1", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    lines = [f"model: {result.get('model', EMBEDDED_LABEL)}",
             f"{'workload':<10}{'mode':<14}{'tok/s':>8}{'vs off':>8}{'makespan':>10}"
             f"{'tokens':>8}{'accept':>8}{'SD steps':>9}"]
    for r in result["rows"]:
        accept = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        share = "-" if r["sd_step_share"] is None else f"{100 * r['sd_step_share']:.0f}%"
        lines.append(f"{r['workload']:<10}{r['mode']:<14}{r['tok_s']:>8.1f}"
                     f"{r['speedup_vs_off']:>7.3f}x{r['makespan_s']:>10.2f}{r['tokens']:>8.0f}"
                     f"{accept:>8}{share:>9}")
    for workload, detail in result["workloads"].items():
        shape = detail["trace_shape"]
        note = (f"; trace lengths: median {shape['median']}, p99 {shape['p99']} "
                f"({shape['p99_over_median']:.1f}x), max {shape['max']}" if shape else "")
        lines.append(f"{workload}: SD always = {detail['always']}; calibration "
                     f"{detail['calibration_s']:.0f} s (shared){note}")
        for label, cell in detail["oracle"]["cells"].items():
            lines.append(f"  oracle {label}: {cell['arm']} {cell['ratio']:.2f}x SD off "
                         f"({cell['accept']:.2f} tokens a row-step at {cell['step_cost']:.2f} "
                         f"SD-off steps; {cell['steps']} steps)")
    lines.append("off_reseeded: SD off with another seed (the noise floor); oracle: the best "
                 "measured arm per cell, replayed over SD off's steps")
    return "\n".join(lines)


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
