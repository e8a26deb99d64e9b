"""The `tlt` command. Subcommands:

  tlt train           GRPO with TLT on the embedded task (the main job); --compare, --model
  tlt generate        text generation with speculative decoding: batch (--prompt, --prompts) or
                      interactive, from the embedded model or a local checkpoint
  tlt export drafter  a trained drafter in SGLang's EAGLE or vLLM's speculators layout
  tlt bench kernels   fused kernels vs their PyTorch reference, side by side (see
                      tlt_core.bench.kernels); --json FILE writes the rows
  tlt bench engine    the rollout engine's decoding vs Hugging Face generate
  tlt bench speculative
                      speculative rollout vs plain decoding, per batch size and strategy
  tlt bench drafter   spot-trained vs frozen drafter on an evolving target, 2 ranks
  tlt bench rollout   the adaptive rollout loop vs SD off / always on, long tail and no tail
  tlt bench train     GRPO end to end: TLT vs SD off, with the reward-noise floor
  tlt bench simulate  the scale simulator, validated against 2-rank runs, and a projection
  tlt bench peers     our batch-1 SD vs Hugging Face assisted decoding, same target weights
  tlt demo            one speculative verification step on a toy tree, explained
  tlt task lengths    the embedded task's heavy-tailed response lengths (--plot PNG)

Every subcommand takes `--config FILE` (TOML or YAML; tlt_core.config_file): its option values,
below the flags given on the command line. Every option's help gives its default
(tlt_core.cli_options.HelpFormatter). docs/cli.md has the details.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tlt_core.cli_options import (HelpFormatter, RawDescriptionHelpFormatter, chosen_parser,
                                  subcommand_help, subparsers_action, walk_parsers)
from tlt_core.config_file import ConfigError, add_config_argument, parse_args


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree: every subcommand leaf gets --config FILE, every parser the
    formatter that shows defaults, and `tlt --help` lists every leaf."""
    parser = argparse.ArgumentParser(
        prog="tlt", description="tlt_core: fused tree speculative decoding for RL rollouts.",
        formatter_class=RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks, each a ratio against a baseline")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    kernels = bench_kinds.add_parser(
        "kernels", help="fused kernels vs the PyTorch reference, side by side",
        description="Times each fused kernel against its pure-PyTorch reference "
                    "(tlt_core.ops.reference) in one run, on EAGLE-shaped draft trees. "
                    "Cases whose logits exceed 1 GiB are skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    kernels.add_argument("--json", type=Path, metavar="FILE",
                         help="write the result rows (op, B, N, V, fused_us, reference_us, "
                              "speedup, mean_accepted, device, baseline) as a JSON list")
    kernels.add_argument("--batch", type=_int_list, default=[1, 4, 16, 64],
                         help="batch sizes B, comma-separated")
    kernels.add_argument("--nodes", type=_int_list, default=[8, 32, 64],
                         help="tree sizes N, comma-separated")
    kernels.add_argument("--vocab", type=_int_list, default=[32000, 151936],
                         help="vocabulary sizes V, comma-separated")
    kernels.add_argument("--ops", default="verify_tree_sampling,verify_tree_greedy,select_tree,"
                                          "tree_metadata,compact_kv_",
                         help="kernels to time, comma-separated")
    kernels.add_argument("--reference-reps", type=int, default=1,
                         help="timed runs of the (slow) reference per case; the median is kept")
    kernels.add_argument("--quick", action="store_true",
                         help="a 1-minute smoke run: B in {1,4}, N in {8}, V in {32000}")
    kernels.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                         help="where the fused kernels run (the reference always runs on cpu)")
    kernels.add_argument("--baseline", choices=["reference", "cpu_fused"], default="reference",
                         help="what the fused kernel is compared with: the PyTorch reference, "
                              "or (with --device cuda) our CPU kernel")
    kernels.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    engine = bench_kinds.add_parser(
        "engine", help="the engine's plain decoding vs Hugging Face generate, side by side",
        description="Greedy decoding throughput of tlt_core's rollout engine and of "
                    "transformers' generate() on the same model and weights (exported through "
                    "our checkpoint format), at each batch size, in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine.add_argument("--json", type=Path, metavar="FILE",
                        help="write rows (batch, ours_tok_s, hf_tok_s, ratio, ...) as JSON")
    engine.add_argument("--model", type=Path, metavar="PATH",
                        help="a local Hugging Face checkpoint folder; default: the warm "
                             "embedded model (trained and cached on first use)")
    engine.add_argument("--batch", type=_int_list, default=[1, 32], help="batch sizes")
    engine.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    engine.add_argument("--reps", type=int, default=3, help="timed runs per case (median)")

    speculative = bench_kinds.add_parser(
        "speculative", help="speculative rollout vs plain decoding, side by side",
        description="Tokens per second of the rollout engine with speculative decoding (the "
                    "warm embedded model and its warmed-up drafter, both trained and cached on "
                    "first use) and without, on the same embedded-task requests, interleaved "
                    "in one run, per batch size and draft strategy (depth,topk,N).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    speculative.add_argument("--json", type=Path, metavar="FILE",
                             help="write rows (batch, strategy, acceptance_length, sd_tok_s, "
                                  "plain_tok_s, speedup, ...) as JSON")
    speculative.add_argument("--plot", type=Path, metavar="PNG",
                             help="plot speedup against batch size per strategy")
    speculative.add_argument("--batch", type=_int_list, default=[1, 4, 16, 64],
                             help="batch sizes (the engine's max running rows)")
    speculative.add_argument("--strategy", action="append", metavar="D,K,N",
                             help="a draft strategy depth,topk,num_verify_tokens; repeatable "
                                  "(default: 6,1,7 8,1,9 12,1,13 5,4,16 6,8,32)")
    speculative.add_argument("--temperature", type=float, default=1.0,
                             help="sampling temperature (0: greedy, also checks SD == plain)")
    speculative.add_argument("--reps", type=int, default=3, help="timed runs per case (median)")
    speculative.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    drafter = bench_kinds.add_parser(
        "drafter", help="spot-trained vs frozen drafter on an evolving target (2 ranks)",
        description="Fine-tunes the warm embedded model round by round toward a drifted task "
                    "(the countdown steps down by two) and, on `--world` gloo ranks, rolls out "
                    "each round three ways: with the frozen initial drafter, with the "
                    "spot-trained drafter and no training, and with spot training in the "
                    "idle tail followed by the step-weighted refresh. Reports acceptance "
                    "per round and the makespan cost of spot training.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    drafter.add_argument("--json", type=Path, metavar="FILE",
                         help="write {rows: per round and rank, summary} as JSON")
    drafter.add_argument("--rounds", type=int, default=8, help="evolving-target rounds")
    drafter.add_argument("--world", type=int, default=2, help="rollout ranks (processes)")
    drafter.add_argument("--requests", type=int, default=192, help="requests per round")
    drafter.add_argument("--group-size", type=int, default=8,
                         help="samples per prompt (a GRPO group; a group stays on one rank)")
    drafter.add_argument("--extra-steps", type=int, default=0,
                         help="ceiling study: spot steps per rank added after each round, off "
                              "the clock, as if the tail had left that much idle time")
    drafter.add_argument("--steps-per-round", type=int, default=25,
                         help="target fine-tuning steps between rounds (the drift)")

    rollout = bench_kinds.add_parser(
        "rollout", help="adaptive loop vs SD off / always on, long-tail and no-tail rollouts",
        description="A 64-request rollout of the embedded task (T=1, 8 prompts x 8 samples), "
                    "long-tailed and with equal lengths, in four modes side by side: SD off; SD "
                    "always on with the best fixed strategy; the adaptive loop (SD switch + "
                    "per-bucket bandit, calibrated at start); and the adaptive loop with "
                    "model-free drafts from sibling and previous-round responses. Reports "
                    "makespan, tokens/s, tail time, acceptance and speedup vs SD off.")
    rollout.add_argument("--json", type=Path, metavar="FILE", help="write rows and studies here")
    rollout.add_argument("--plot", type=Path, metavar="PNG",
                         help="plot the running batch over time per mode here")
    rollout.add_argument("--rounds", type=int, default=3,
                         help="measured rounds per mode (medians), after one warm-up round")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bars")

    bench_train = bench_kinds.add_parser(
        "train", help="GRPO end to end: TLT vs SD off (and SD off with another seed)",
        description="Three GRPO runs on the embedded task, stepped in turn: TLT, SD off with "
                    "the same seed, SD off with another seed (the reward-noise floor). Reports "
                    "per-step time and reward, the end-to-end speedup, the reward gap and the "
                    "reward noise.")
    bench_train.add_argument("--json", type=Path, metavar="FILE", help="write rows + summary")
    bench_train.add_argument("--steps", type=int, default=12, help="GRPO steps per run")
    bench_train.add_argument("--no-progress", action="store_true", help="no progress bars")

    simulate = bench_kinds.add_parser(
        "simulate", help="the scale simulator: validated on 2-rank runs here, then a projection",
        description="Validates the rollout simulator (cost model + response lengths -> "
                    "makespan) against measured 2-rank rollouts of forced-length traces of "
                    "several tail shapes, SD off and on, then projects a many-worker run. The "
                    "projection is a model's prediction, not a measurement.")
    simulate.add_argument("--json", type=Path, metavar="FILE", help="write rows + projection")
    simulate.add_argument("--reps", type=int, default=3,
                          help="calibration sweeps and measured rollouts per row (medians)")
    simulate.add_argument("--calibration", type=Path, metavar="FILE",
                          help="a cost-model calibration (JSON; the GPU script writes one) for "
                               "the projection; default: the one measured here")
    simulate.add_argument("--workers", type=int, default=64, help="workers in the projection")
    simulate.add_argument("--train-s-per-token", type=float,
                          help="training seconds per generated token, for the projection's "
                               "end-to-end speedup")
    simulate.add_argument("--rollout-share", type=float,
                          help="the rollout's share of an SD-off step (e.g. 0.85, what TLT's "
                               "paper reports for production traces), for an end-to-end speedup")

    peers = bench_kinds.add_parser(
        "peers", help="our SD vs HF assisted decoding, our GRPO vs TRL GRPO, on the same work",
        description="Our batch-1 speculative decoding against transformers' assisted decoding "
                    "(a 2-layer assistant of the same vocabulary, warmed up on the task) with "
                    "the same target weights, at T=0 (outputs checked identical) and T=1; and "
                    "our GRPO driver (TLT and SD off) against TRL's GRPOTrainer on the same "
                    "model, prompts and settings (needs TRL: bash bench/setup_peers.sh). Rows: "
                    "peer, setting, ours, theirs (tokens/s), ratio (ours faster above 1).")
    peers.add_argument("--json", type=Path, metavar="FILE", help="write the rows here")
    peers.add_argument("--no-progress", action="store_true", help="no progress bars")

    from tlt_core.train_cli import add_arguments as add_train_arguments

    train = commands.add_parser(
        "train", help="GRPO with TLT (the main job): the embedded task by default",
        description="GRPO on the embedded task and model with TLT on (adaptive speculative "
                    "rollout, spot-trained drafter) when run with no arguments: a few minutes "
                    "on 2 cores. --compare adds the SD-off baseline with the same seeds and "
                    "prints the end-to-end speedup. --model PATH --data FILE trains a local "
                    "Hugging Face checkpoint on a prompt file. Multi-process: torchrun "
                    "--nproc-per-node N -m tlt_core.cli train (gloo on CPU, NCCL on GPU).")
    add_train_arguments(train)

    from tlt_core.generate_cli import add_arguments as add_generate_arguments

    generate = commands.add_parser(
        "generate", help="text generation with speculative decoding, batch or interactive",
        description="Generates text with speculative decoding (lossless: greedy output equals "
                    "plain decoding's; --no-sd to compare) from the warm embedded model and "
                    "its drafter, or a local checkpoint (--model DIR, --drafter DIR). Batch "
                    "mode: --prompt TEXT (repeatable) and --prompts FILE. Interactive mode "
                    "(stdin a terminal and no prompts, or --interactive): one prompt per line "
                    "of stdin. stderr shows a live line (tokens, tokens/s, acceptance length) "
                    "and a measured summary per engine call.")
    add_generate_arguments(generate)

    _add_export(commands)

    commands.add_parser("demo", help="one verification step on a toy tree, explained",
                        description="One speculative verification step on a toy draft tree, "
                                    "explained step by step.")

    task = commands.add_parser("task", help="the embedded task")
    task_kinds = task.add_subparsers(dest="task", required=True, metavar="WHAT")
    lengths = task_kinds.add_parser(
        "lengths", help="response-length distribution (reference and warm model)",
        description="Prints length statistics of the embedded task's reference solutions and "
                    "of the warm embedded model's samples at temperature 1 (trained and cached "
                    "on first use), and optionally plots their histograms.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lengths.add_argument("--problems", type=int, default=5000,
                         help="reference problems to measure")
    lengths.add_argument("--model-problems", type=int, default=512,
                         help="problems the warm model answers (0: skip the model)")
    lengths.add_argument("--plot", type=Path, metavar="PNG", help="write a histogram image")

    leaves, helps = [], {}
    for path, each in walk_parsers(parser):
        each.formatter_class = RawDescriptionHelpFormatter if not path else HelpFormatter
        helps.update({path + (name,): text for name, text in subcommand_help(each).items()})
        if path and subparsers_action(each) is None:
            leaves.append(path)
            if "--config" not in each._option_string_actions:
                add_config_argument(each)
    width = max(len(" ".join(path)) for path in leaves) + 6
    parser.epilog = "commands (tlt COMMAND --help for each one's options):\n" + "\n".join(
        f"  {'tlt ' + ' '.join(path):<{width}}{helps.get(path, '')}" for path in leaves)
    return parser


def _add_export(commands) -> None:
    """`tlt export`, its arguments and runner from tlt_core.export_cli."""
    from tlt_core.export_cli import add_arguments

    export = commands.add_parser(
        "export", help="a trained drafter in a serving engine's format (EAGLE, speculators)",
        description="Exports artifacts for serving engines: `tlt export drafter --to "
                    "{eagle,speculators} OUT` writes a drafter in SGLang's EAGLE or vLLM's "
                    "speculators layout, with provenance.")
    add_arguments(export)


def _write_json(path: Path | None, result: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def _embedded_target_and_drafter(progress: bool = True):
    """The warm embedded model and its warmed-up drafter (each trained and cached on first use)."""
    from tlt_core.drafter_training import load_or_warm_up_drafter
    from tlt_core.embedded import EMBEDDED_MODEL_CONFIG
    from tlt_core.warmup import WarmupConfig, cache_dir, load_or_train

    target, _ = load_or_train(progress=progress)
    drafter, _ = load_or_warm_up_drafter(target.eval(), cache_dir(WarmupConfig(), EMBEDDED_MODEL_CONFIG),
                                         progress=progress)
    return target, drafter


def _embedded_folders():
    """(warm target, its cache folder, its drafter's folder): what multi-process benchmarks hand
    to their ranks, each trained and cached on first use."""
    from tlt_core.drafter_training import DrafterWarmupConfig, drafter_folder
    from tlt_core.embedded import EMBEDDED_MODEL_CONFIG
    from tlt_core.warmup import WarmupConfig, cache_dir

    target, _ = _embedded_target_and_drafter()
    folder = cache_dir(WarmupConfig(), EMBEDDED_MODEL_CONFIG)
    return target, folder, drafter_folder(folder, DrafterWarmupConfig())


def _write_rows(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


def run_bench_kernels(args: argparse.Namespace) -> int:
    from tlt_core.bench import kernels

    batches, nodes, vocabs = args.batch, args.nodes, args.vocab
    if args.quick:
        batches, nodes, vocabs = [1, 4], [8], [32000]
    results = kernels.run(ops_to_time=[op for op in args.ops.split(",") if op],
                          batches=batches, nodes=nodes, vocabs=vocabs,
                          reference_reps=args.reference_reps, progress=not args.no_progress,
                          device=args.device, baseline=args.baseline)
    print(kernels.format_table(results))
    _write_rows(args.json, kernels.as_rows(results))
    return 0


def run_bench_engine(args: argparse.Namespace) -> int:
    from tlt_core.bench import engine as bench_engine
    from tlt_core.checkpoint import load_checkpoint
    from tlt_core.warmup import load_or_train

    model = load_checkpoint(args.model) if args.model is not None else load_or_train()[0]
    results = bench_engine.run(model.eval(), batches=args.batch, new_tokens=args.new_tokens,
                               reps=args.reps)
    print(bench_engine.format_table(results))
    _write_rows(args.json, bench_engine.as_rows(results))
    return 0


def run_bench_speculative(args: argparse.Namespace) -> int:
    from tlt_core.bench import speculative as bench_speculative
    from tlt_core.drafter_training import load_or_warm_up_drafter
    from tlt_core.warmup import WarmupConfig, cache_dir, load_or_train
    from tlt_core.embedded import EMBEDDED_MODEL_CONFIG

    strategies = (bench_speculative.DEFAULT_STRATEGIES if not args.strategy else
                  [bench_speculative.parse_strategy(text) for text in args.strategy])
    target, _ = load_or_train()
    drafter, report = load_or_warm_up_drafter(
        target, cache_dir(WarmupConfig(), EMBEDDED_MODEL_CONFIG), progress=not args.no_progress)
    print(f"drafter: {report.steps} warm-up steps, teacher-forced top-1 agreement "
          f"{report.final_top1:.3f}")
    results = bench_speculative.run(target, drafter, batches=args.batch, strategies=strategies,
                                    temperature=args.temperature, reps=args.reps,
                                    progress=not args.no_progress)
    print(bench_speculative.format_table(results))
    _write_rows(args.json, bench_speculative.as_rows(results))
    if args.plot:
        bench_speculative.plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def run_bench_rollout(args: argparse.Namespace) -> int:
    from tlt_core.bench import rollout as bench_rollout

    target, drafter = _embedded_target_and_drafter(progress=not args.no_progress)
    result = bench_rollout.run(target, drafter, rounds=args.rounds, progress=not args.no_progress)
    print(bench_rollout.format_table(result))
    if args.plot is not None:
        bench_rollout.plot(result, args.plot)
        print(f"wrote {args.plot}")
    _write_json(args.json, result)
    return 0


def run_bench_train(args: argparse.Namespace) -> int:
    from tlt_core.bench import train as bench_train
    from tlt_core.train import TrainConfig

    result = bench_train.run(TrainConfig(steps=args.steps), progress=not args.no_progress)
    print(bench_train.format_table(result))
    _write_json(args.json, result)
    return 0


def run_bench_simulate(args: argparse.Namespace) -> int:
    from tlt_core.bench import simulate as bench_simulate
    from tlt_core.simulator import load_calibration

    target, target_folder, drafter_path = _embedded_folders()
    result = bench_simulate.validate(target_folder, drafter_path, reps=args.reps)
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


def run_bench_peers(args: argparse.Namespace) -> int:
    from tlt_core.bench import peers

    target, drafter = _embedded_target_and_drafter(progress=not args.no_progress)
    rows = peers.hf_assisted(target, drafter, progress=not args.no_progress)
    try:
        rows += peers.trl_grpo(progress=not args.no_progress)
    except ImportError as error:
        print(f"trl_grpo: skipped, TRL is not installed ({error}); bash bench/setup_peers.sh "
              "installs it", file=sys.stderr)
    print(peers.format_table(rows))
    _write_rows(args.json, rows)
    return 0


def run_bench_drafter(args: argparse.Namespace) -> int:
    from tlt_core.bench import drafter as bench_drafter

    target, target_folder, drafter_path = _embedded_folders()
    result = bench_drafter.run(target, drafter_path, target_folder, rounds=args.rounds,
                               world=args.world, requests=args.requests, group_size=args.group_size,
                               steps_per_round=args.steps_per_round,
                               extra_steps=args.extra_steps)
    print(bench_drafter.format_table(result))
    _write_json(args.json, result)
    return 0


def run_task_lengths(args: argparse.Namespace) -> int:
    from tlt_core.bench import lengths
    from tlt_core.task import length_stats

    series = {"reference solutions": lengths.reference_lengths(args.problems)}
    if args.model_problems > 0:
        series["warm model, T=1"] = lengths.model_lengths(args.model_problems)
    for label, values in series.items():
        stats = length_stats(values)
        print(f"{label:>20}: " + ", ".join(f"{k} {v:.1f}" for k, v in stats.items()))
    if args.plot:
        lengths.plot_histogram(series, args.plot)
        print(f"wrote {args.plot}")
    return 0


def run_demo(_: argparse.Namespace) -> int:
    from tlt_core.demo import main as demo_main

    return demo_main()


def main(argv: list[str] | None = None) -> int:
    """`tlt ARGV`: parses (defaults < --config file < flags) and runs the subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    leaf = chosen_parser(parser, argv)
    try:
        args = parse_args(parser, argv)
    except ConfigError as error:
        (leaf or parser).error(str(error))
    if args.command == "bench" and args.bench == "kernels":
        return run_bench_kernels(args)
    if args.command == "bench" and args.bench == "engine":
        return run_bench_engine(args)
    if args.command == "bench" and args.bench == "speculative":
        return run_bench_speculative(args)
    if args.command == "bench" and args.bench == "drafter":
        return run_bench_drafter(args)
    if args.command == "bench" and args.bench == "rollout":
        return run_bench_rollout(args)
    if args.command == "bench" and args.bench == "train":
        return run_bench_train(args)
    if args.command == "bench" and args.bench == "simulate":
        return run_bench_simulate(args)
    if args.command == "bench" and args.bench == "peers":
        return run_bench_peers(args)
    if args.command == "train":
        from tlt_core.train_cli import run_train

        return run_train(args)
    if args.command == "generate":
        from tlt_core.generate_cli import run_generate

        return run_generate(args)
    if args.command == "export":
        from tlt_core.export_cli import run_export

        return run_export(args)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "task" and args.task == "lengths":
        return run_task_lengths(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
