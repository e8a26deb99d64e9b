"""`tlt bench ...` and `tlt task lengths`: the subcommands' registration and runners.

Each benchmark declares its own flags beside it: tlt_core.bench.NAME has an options dataclass,
the help beside each field, and `add_cli_args(parser)`, which derives one flag per field
(tlt_core.config_flags). Here each is registered (BENCHMARKS, TASKS) with its runner. Each
runner loads what its benchmark needs (the embedded workload through its one loader, or a
checkpoint), calls the benchmark module in tlt_core.bench, prints its table and writes its JSON
(`--json FILE`) and plot (`--plot PNG`) where asked.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tlt_core.adaptive.calibration_cache import CalibrationCache
from tlt_core.adaptive.measured_plans import MeasuredPlans, measured_plans
from tlt_core.bench import drafter as bench_drafter
from tlt_core.bench import engine as bench_engine
from tlt_core.bench import kernels as bench_kernels
from tlt_core.bench import lengths as bench_lengths
from tlt_core.bench import peers as bench_peers
from tlt_core.bench import prefill as bench_prefill
from tlt_core.bench import rollout as bench_rollout
from tlt_core.bench import simulate as bench_simulate
from tlt_core.bench import simulate_rollout as bench_simulate_rollout
from tlt_core.bench import speculative as bench_speculative
from tlt_core.bench import train as bench_train
from tlt_core.bench.model_workload import (DEFAULT_PROBLEMS_SEED, EMBEDDED_LABEL,
                                            ModelWorkload, PerWorkload, load_model_workload,
                                            model_label)
from tlt_core.bench.rollout_file import load_rollout
from tlt_core.cli.model_options import placement_from_args
from tlt_core.config_flags import dataclass_from_args
from tlt_core.embedded.task import length_stats
from tlt_core.embedded.workload import load_embedded, load_pretrained
from tlt_core.engine.records import SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.gguf_convert import cache_root
from tlt_core.sim.simulator import load_calibration
from tlt_core.tasks.arithmetic_problems import generate_problems, write_jsonl
from tlt_core.tasks.inputs import TrainInputs, checkpoint_inputs

logger = logging.getLogger(__name__)


def model_workload(args: argparse.Namespace, command: str, *,
                   needs_drafter: bool) -> ModelWorkload:
    """The --model workload the flags ask for; errors name the flag."""
    if needs_drafter and args.drafter is None:
        raise SystemExit(f"{command}: --model needs --drafter DIR (train one with `tlt drafter "
                         "train --model DIR --data FILE --out DIR`)")
    placement = placement_from_args(args, command, embedded=False)
    try:
        return load_model_workload(args.model, placement, drafter=args.drafter, data=args.data)
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise SystemExit(f"{command}: {error}") from None


def _plans_from(path: Path, temperature: float, command: str) -> MeasuredPlans:
    """--plans-from's file read at the run's temperature; its errors name the flag."""
    try:
        return measured_plans(path, temperature)
    except (FileNotFoundError, ValueError) as error:  # it names the file and the row
        raise SystemExit(f"{command}: --plans-from: {error}") from None


def _workload_config(defaults: PerWorkload, args: argparse.Namespace, command: str):
    """The embedded run's or (--model) the checkpoint's config, with the flags given over it;
    its errors name the flag."""
    try:
        return defaults.config(args.model is not None, vars(args))
    except ValueError as error:  # "group_size: ..." -> "--group-size: ..."
        raise SystemExit(f"{command}: --{str(error).replace('_', '-')}") from None


def _arithmetic_file() -> Path:
    """The default --data of a --model benchmark: the arithmetic problems (seed 1) that
    tlt_core.bench.model_workload uses, written once into the tlt_core cache."""
    path = cache_root() / "bench" / f"arithmetic-seed{DEFAULT_PROBLEMS_SEED}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, generate_problems(256, seed=DEFAULT_PROBLEMS_SEED))
    return path


@dataclass(frozen=True)
class Leaf:
    """A `tlt bench NAME` (or `tlt task NAME`) subcommand: `add_cli_args` adds its flags (the
    benchmark module's, their help beside its options dataclass's fields), `runner` runs it."""
    name: str
    add_cli_args: Callable[[argparse.ArgumentParser], None]
    summary: str  # its line in `tlt --help`
    description: str  # the top of its own --help
    runner: Callable[[argparse.Namespace], int]


def add_parsers(commands) -> None:
    """`tlt bench BENCHMARK` for each of BENCHMARKS, and `tlt task lengths`."""
    bench = commands.add_parser("bench", help="benchmarks, each a ratio against a baseline")
    _add_leaves(bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK"),
                BENCHMARKS)
    task = commands.add_parser("task", help="the embedded task")
    _add_leaves(task.add_subparsers(dest="task", required=True, metavar="WHAT"), TASKS)


def _add_leaves(subcommands, leaves: tuple[Leaf, ...]) -> None:
    for leaf in leaves:
        parser = subcommands.add_parser(leaf.name, help=leaf.summary,
                                        description=leaf.description)
        leaf.add_cli_args(parser)
        parser.set_defaults(runner=leaf.runner)


def _write_json(path: Path | None, result: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    logger.info("wrote %s", path)


def _write_rows(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    logger.info("wrote %d rows to %s", len(rows), path)


def run_kernels(args: argparse.Namespace) -> int:
    batches, nodes, vocabs = args.batch, args.nodes, args.vocab
    if args.quick:
        batches, nodes, vocabs = [1, 4], [8], [32000]
    results = bench_kernels.run(ops_to_time=[op for op in args.ops.split(",") if op],
                                batches=batches, nodes=nodes, vocabs=vocabs,
                                reference_reps=args.reference_reps,
                                progress=not args.no_progress, device=args.device,
                                baseline=args.baseline)
    print(bench_kernels.format_table(results))
    _write_rows(args.json, bench_kernels.as_rows(results))
    return 0


def run_engine(args: argparse.Namespace) -> int:
    embedded = args.model is None
    placement = placement_from_args(args, "tlt bench engine", embedded=embedded)
    if embedded:
        model = load_embedded(with_drafter=False).target.to(placement.device, placement.dtype)
    else:
        model = load_checkpoint(args.model, dtype=placement.dtype, device=placement.device)
    results = bench_engine.run(model.eval(), folder=args.model, batches=args.batch,
                               new_tokens=args.new_tokens, reps=args.reps)
    _write_rows(args.json, bench_engine.as_rows(results))
    return 0


def run_prefill(args: argparse.Namespace) -> int:
    results = bench_prefill.run(args.model, prompts=args.prompts, prompt_len=args.prompt_len,
                                dtype=args.dtype, device=args.device)
    _write_rows(args.json, bench_prefill.as_rows(results))
    return 0


def run_speculative(args: argparse.Namespace) -> int:
    strategies = (bench_speculative.DEFAULT_STRATEGIES if not args.strategy else
                  [bench_speculative.parse_strategy(text) for text in args.strategy])
    if args.requests < 1:
        raise SystemExit(f"tlt bench speculative: --requests must be >= 1, got {args.requests}")

    def count(batch: int) -> int:
        return max(2 * batch, args.requests)
    if args.model is None:
        workload = load_embedded(progress=not args.no_progress)
        report = workload.drafter_report
        logger.info("drafter: %d training steps, teacher-forced top-1 agreement %.3f",
                    report.steps, report.final_top1)
        target, drafter, label = workload.target, workload.drafter, EMBEDDED_LABEL

        def requests_for(batch, temperature, seed):
            return bench_speculative.embedded_requests(count(batch), temperature, seed,
                                                       args.max_tokens)
    else:
        model = model_workload(args, "tlt bench speculative", needs_drafter=True)
        target, drafter, label = model.target, model.drafter, model.label
        max_tokens = args.max_tokens or 256

        def requests_for(batch, temperature, seed):
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            requests = model.requests(count(batch), params, first=seed)
            return requests, max(len(r.prompt_ids) for r in requests) + max_tokens
    results = bench_speculative.run(target, drafter, batches=args.batch,
                                    strategies=strategies, temperature=args.temperature,
                                    reps=args.reps, progress=not args.no_progress,
                                    requests_for=requests_for, label=label)
    print(bench_speculative.format_table(results))
    _write_rows(args.json, bench_speculative.as_rows(results))
    if args.plot:
        bench_speculative.plot(results, args.plot)
        logger.info("wrote %s", args.plot)
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    command = "tlt bench rollout"
    options = dataclass_from_args(bench_rollout.RolloutOptions, args, command)
    try:
        names = bench_rollout.parse_workloads(options.workload)
        always = None if options.always is None else bench_speculative.parse_strategy(
            options.always)
    except ValueError as error:  # "workload: ..." / "strategy: ..."
        flag = "--workload" if str(error).startswith("workload") else "--always"
        raise SystemExit(f"{command}: {flag}: {str(error).partition(': ')[2]}") from None
    measured = (None if options.plans_from is None else
                _plans_from(options.plans_from, bench_rollout.TEMPERATURE, command))
    model = (load_embedded(progress=not args.no_progress) if args.model is None
             else model_workload(args, command, needs_drafter=True))
    try:
        workloads = (bench_rollout.embedded_workloads(names, options) if args.model is None
                     else bench_rollout.model_workloads(model, names, options))
    except (FileNotFoundError, ValueError) as error:  # the trace's lengths
        raise SystemExit(f"{command}: --trace-file: {error}") from None
    label = EMBEDDED_LABEL if args.model is None else model.label
    try:
        cache = (CalibrationCache(options.calibration_cache)
                 if options.calibration_cache is not None else None)
    except ValueError as error:  # "calibration_cache: ... is a file"
        raise SystemExit(f"{command}: --{str(error).replace('_', '-', 1)}") from None
    result = bench_rollout.run(model.target, model.drafter, workloads, rounds=options.rounds,
                               always=always, sampled_drafts=options.sampled_drafts,
                               measured=measured, progress=not options.no_progress, label=label,
                               calibration_cache=cache)
    print(bench_rollout.format_table(result))
    if options.plot is not None:
        bench_rollout.plot(result, options.plot)
        logger.info("wrote %s", options.plot)
    _write_json(options.json, result)
    return 0


def run_train(args: argparse.Namespace) -> int:
    command = "tlt bench train"
    options = dataclass_from_args(bench_train.TrainOptions, args, command)
    try:
        config = options.train_config()
    except ValueError as error:  # "steps: ..." -> "--steps: ..."
        name, _, why = str(error).partition(": ")
        raise SystemExit(f"{command}: --{name.replace('_', '-')}: {why}") from None
    if config.plans_from is not None:  # before a model loads
        _plans_from(config.plans_from, config.temperature, command)
    trace = None
    if options.workload == "trace":
        try:
            trace = bench_train.trace_lengths(options, config)
        except (FileNotFoundError, ValueError) as error:  # the file's
            raise SystemExit(f"{command}: --trace-file: {error}") from None
    if args.model is None:
        result = bench_train.run(config, progress=not options.no_progress, trace=trace)
    else:
        if args.drafter is None:
            raise SystemExit(f"{command}: --model needs --drafter DIR (tlt drafter train)")
        placement = placement_from_args(args, command, embedded=False)
        data = args.data or _arithmetic_file()

        def inputs() -> TrainInputs:
            try:
                return checkpoint_inputs(args.model, data, drafter_path=args.drafter,
                                         placement=placement)
            except (FileNotFoundError, ImportError, ValueError) as error:
                raise SystemExit(f"{command}: {error}") from None
        result = bench_train.run(config, progress=not options.no_progress, inputs=inputs,
                                 label=model_label(args.model, placement.dtype), trace=trace)
    print(bench_train.format_table(result))
    _write_json(options.json, result)
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    command = "tlt bench simulate"
    if args.rollout is not None:
        return _simulate_rollout(args, command)
    sizes = _workload_config(bench_simulate.DEFAULTS, args, command)
    if args.model is None:
        replay = bench_simulate.embedded_replay(load_embedded(), sizes)
    else:
        replay = bench_simulate.model_replay(
            model_workload(args, command, needs_drafter=True), sizes)
    result = bench_simulate.validate(replay, reps=args.reps)
    print(bench_simulate.format_table(result))
    measured = result.pop("cost_model")  # not JSON; the calibration is in result already
    if args.calibration is not None:
        cost, source = load_calibration(args.calibration), str(args.calibration)
    else:
        cost, source = measured, "this machine (2 ranks, 1 thread each)"
    projection = bench_simulate.project(cost, workers=args.workers,
                                        train_s_per_token=args.train_s_per_token,
                                        rollout_share=args.rollout_share)
    projection["cost_model"] = source
    result["projection"] = projection
    print(f"PROJECTION (simulated, not measured; cost model: {source}): "
          + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in projection.items() if k != "cost_model"))
    _write_json(args.json, result)
    return 0


def _simulate_rollout(args: argparse.Namespace, command: str) -> int:
    """`tlt bench simulate --rollout FILE`: the simulator against a rollout file's runs."""
    if args.model is not None:
        raise SystemExit(f"{command}: --rollout reads the runs, calibration and model from its "
                         "file; drop --model")
    try:
        result = bench_simulate_rollout.validate_rollout(load_rollout(args.rollout),
                                                         args.simulations)
    except ValueError as error:
        raise SystemExit(f"{command}: {error}") from None
    print(bench_simulate_rollout.format_rollout_table(result))
    _write_json(args.json, {"rollout": str(args.rollout), **result})
    return 0


def run_peers(args: argparse.Namespace) -> int:
    workload = load_embedded(progress=not args.no_progress)
    rows = bench_peers.hf_assisted(workload.target, workload.drafter,
                                   progress=not args.no_progress)
    try:
        rows += bench_peers.trl_grpo(progress=not args.no_progress)
    except ImportError as error:
        logger.warning("trl_grpo: skipped, TRL is not installed (%s); bash "
                       "bench/setup_peers.sh installs it", error)
    print(bench_peers.format_table(rows))
    _write_rows(args.json, rows)
    return 0


def run_drafter(args: argparse.Namespace) -> int:
    command = "tlt bench drafter"
    config = _workload_config(bench_drafter.DEFAULTS, args, command)
    if args.model is None:
        workload = load_embedded()
        result = bench_drafter.run(workload.target, workload.drafter_folder,
                                   workload.target_folder, config)
    else:
        result = bench_drafter.run_model(model_workload(args, command, needs_drafter=True),
                                         config)
    print(bench_drafter.format_table(result))
    _write_json(args.json, result)
    return 0


def run_task_lengths(args: argparse.Namespace) -> int:
    series = {"reference solutions": bench_lengths.reference_lengths(args.problems)}
    if args.model_problems > 0:
        model = load_pretrained()[0]
        series["pre-trained model, T=1"] = bench_lengths.model_lengths(model,
                                                                       args.model_problems)
    for label, values in series.items():
        stats = length_stats(values)
        print(f"{label:>22}: " + ", ".join(f"{k} {v:.1f}" for k, v in stats.items()))
    if args.plot:
        bench_lengths.plot_histogram(series, args.plot)
        logger.info("wrote %s", args.plot)
    return 0


# in the order `tlt --help` lists them
BENCHMARKS = (
    Leaf("kernels", bench_kernels.add_cli_args,
         "fused kernels vs the PyTorch reference, side by side",
         "Times each fused kernel against its pure-PyTorch reference (tlt_core.ops.reference) "
         "in one run, on EAGLE-shaped draft trees. Cases whose logits exceed 1 GiB are skipped.",
         run_kernels),
    Leaf("engine", bench_engine.add_cli_args,
         "the engine's plain decoding vs Hugging Face generate, side by side",
         "Greedy decoding throughput of tlt_core's rollout engine and of transformers' "
         "generate() on the same model and weights (exported through our checkpoint format), at "
         "each batch size, in one run.", run_engine),
    Leaf("prefill", bench_prefill.add_cli_args,
         "peak memory of prefilling long prompts, before and after the bounds",
         "Peak memory above the loaded model of prefilling --prompts prompts of --prompt-len "
         "tokens: logits at every position in one pass (no bounds), and the engine's "
         "token-budget admission with last-position logits. Each in a fresh process; the CPU by "
         "default.", run_prefill),
    Leaf("speculative", bench_speculative.add_cli_args,
         "speculative rollout vs plain decoding, side by side",
         "Tokens per second of the rollout engine with speculative decoding (the pre-trained "
         "embedded model and its drafter) and without, on the same embedded-task requests, "
         "interleaved in one run, per batch size and draft strategy (depth,topk,N).",
         run_speculative),
    Leaf("drafter", bench_drafter.add_cli_args,
         "spot-trained vs frozen drafter on an evolving target (2 ranks)",
         "Fine-tunes the pre-trained embedded model round by round toward a drifted task (the "
         "countdown steps down by two), or with --model the checkpoint toward GSM8K-style worked "
         "solutions of arithmetic problems, and, on `--world` gloo ranks, rolls out each round "
         "three ways: with the frozen initial drafter, with the spot-trained drafter and no "
         "training, and with spot training in the idle tail followed by the step-weighted "
         "refresh. Reports acceptance per round and the makespan cost of spot training.",
         run_drafter),
    Leaf("rollout", bench_rollout.add_cli_args,
         "adaptive loop vs SD off / always on, on natural, long-tailed and equal lengths",
         "64-row rollouts (8 prompts x 8 samples, T=1) of three workloads: natural (each "
         "response ends at its end of turn), trace (forced lengths from a long-tailed "
         "distribution) and no_tail (every row one length), in four modes side by side: SD off; "
         "SD always on with one plan; the adaptive loop; SD off reseeded (the noise floor). The "
         "hindsight oracle (the best measured arm per cell, replayed over SD off's steps) comes "
         "from the per-step traces, which the JSON keeps. Reports committed tokens/s and the "
         "speedup per token vs SD off.",
         run_rollout),
    Leaf("train", bench_train.add_cli_args,
         "GRPO end to end: TLT vs SD off (and SD off with another seed), per token",
         "Three GRPO runs on the embedded task (or --model with its --drafter), stepped in "
         "turn: TLT, SD off with the same seed, SD off with another seed (the noise floor). "
         "Workloads: natural (responses end at the model's stop ids) or trace (every sample "
         "decodes to exactly a length drawn from a long-tailed distribution, the same in every "
         "run). Reports per step the time, tokens/s and reward; in all, TLT's tokens/s over SD "
         "off's end to end and on the rollout (the adaptive loop's calibration counted in "
         "TLT's first step), SD off reseeded over SD off beside it, the per-step time ratios, "
         "the reward gap and the reward noise. The JSON keeps each step's response lengths and "
         "step trace.", run_train),
    Leaf("simulate", bench_simulate.add_cli_args,
         "the scale simulator: validated on 2-rank runs here or on a rollout file's runs",
         "Validates the rollout simulator (cost model + response lengths -> makespan) against "
         "measured 2-rank rollouts of forced-length traces of several tail shapes, SD off and "
         "on, on the embedded model or with --model a checkpoint, then projects a many-worker "
         "run. The projection is a model's prediction, not a measurement. With --rollout FILE "
         "(a `tlt bench rollout --json` file) it instead predicts every measured run in it "
         "(SD off, always, adaptive, reseeded) from the file's calibration, each run's lengths, "
         "plans and acceptance, and splits each error into admission, step cost and schedule.",
         run_simulate),
    Leaf("peers", bench_peers.add_cli_args,
         "our SD vs HF assisted decoding, our GRPO vs TRL GRPO, on the same work",
         "Our batch-1 speculative decoding against transformers' assisted decoding (a 2-layer "
         "assistant of the same vocabulary, pre-trained on the task) with the same target "
         "weights, at T=0 (outputs checked identical) and T=1; and our GRPO driver (TLT and SD "
         "off) against TRL's GRPOTrainer on the same model, prompts and settings (needs TRL: "
         "bash bench/setup_peers.sh). Rows: peer, setting, ours, theirs (tokens/s), ratio (ours "
         "faster above 1).", run_peers),
)
TASKS = (
    Leaf("lengths", bench_lengths.add_cli_args,
         "response-length distribution (reference and pre-trained model)",
         "Prints length statistics of the embedded task's reference solutions and of the "
         "pre-trained embedded model's samples at temperature 1, and optionally plots their "
         "histograms.", run_task_lengths),
)
