"""`tlt bench ...` and `tlt task lengths`: the benchmarks' command lines and runners.

Each runner loads what its benchmark needs (the embedded workload through its one loader, or a
checkpoint), calls the benchmark module in tlt_core.bench, prints its table and writes its JSON
(`--json FILE`) and plot (`--plot PNG`) where asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tlt_core.bench import drafter as bench_drafter
from tlt_core.bench import engine as bench_engine
from tlt_core.bench import kernels as bench_kernels
from tlt_core.bench import lengths as bench_lengths
from tlt_core.bench import peers as bench_peers
from tlt_core.bench import prefill as bench_prefill
from tlt_core.bench import rollout as bench_rollout
from tlt_core.bench import simulate as bench_simulate
from tlt_core.bench import speculative as bench_speculative
from tlt_core.bench import train as bench_train
from tlt_core.bench.model_workload import (DEFAULT_PROBLEMS_SEED, EMBEDDED_LABEL,
                                           ModelWorkload, load_model_workload, model_label)
from tlt_core.cli.model_options import placement_from_args
from tlt_core.embedded.task import length_stats
from tlt_core.embedded.workload import load_embedded, load_pretrained
from tlt_core.engine.records import SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.gguf_convert import cache_root
from tlt_core.rl.driver import TrainConfig
from tlt_core.sim.simulator import load_calibration
from tlt_core.tasks.arithmetic_problems import generate_problems, write_jsonl
from tlt_core.tasks.inputs import TrainInputs, checkpoint_inputs


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model/--drafter/--data/--dtype/--device: a benchmark on a local checkpoint instead of
    the embedded model (tlt_core.bench.model_workload)."""
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="a local Hugging Face checkpoint folder (default: the embedded "
                             "model)")
    parser.add_argument("--drafter", type=Path, metavar="DIR",
                        help="the drafter for --model (tlt drafter train's folder, a tlt export, "
                             "or a published EAGLE / EAGLE-3 checkpoint)")
    parser.add_argument("--data", type=Path, metavar="FILE",
                        help="prompts for --model (default: the project's arithmetic word "
                             "problems, seed 1) in its chat template")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto", help="--model's dtype (auto: as tlt generate chooses)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where --model runs")


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


def _arithmetic_file() -> Path:
    """The default --data of a --model benchmark: the arithmetic problems (seed 1) that
    tlt_core.bench.model_workload uses, written once into the tlt_core cache."""
    path = cache_root() / "bench" / f"arithmetic-seed{DEFAULT_PROBLEMS_SEED}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, generate_problems(256, seed=DEFAULT_PROBLEMS_SEED))
    return path


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def add_parsers(commands) -> None:
    """`tlt bench BENCHMARK` and `tlt task lengths`."""
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
                        help="a local Hugging Face checkpoint folder; default: the "
                             "pre-trained embedded model")
    engine.add_argument("--batch", type=_int_list, default=[1, 8, 32, 64], help="batch sizes")
    engine.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    engine.add_argument("--reps", type=int, default=3,
                        help="timed runs per case, alternating ours and theirs (best kept)")
    engine.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto", help="weights' dtype of both sides (auto: as tlt "
                                             "generate chooses; the embedded model float32)")
    engine.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                        help="where both sides run")

    prefill = bench_kinds.add_parser(
        "prefill", help="peak memory of prefilling long prompts, before and after the bounds",
        description="Peak memory above the loaded model of prefilling --prompts prompts of "
                    "--prompt-len tokens: logits at every position in one pass (no bounds), "
                    "and the engine's token-budget admission with last-position logits. Each "
                    "in a fresh process; the CPU by default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    prefill.add_argument("--model", type=Path, metavar="DIR", required=True,
                         help="a local Hugging Face checkpoint folder")
    prefill.add_argument("--prompts", type=int, default=64, help="prompts prefilled together")
    prefill.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    prefill.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                         default="bfloat16", help="weights' dtype")
    prefill.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                         help="where it runs")
    prefill.add_argument("--json", type=Path, metavar="FILE", help="write the rows as JSON")
    prefill.set_defaults(runner=run_prefill)

    speculative = bench_kinds.add_parser(
        "speculative", help="speculative rollout vs plain decoding, side by side",
        description="Tokens per second of the rollout engine with speculative decoding (the "
                    "pre-trained embedded model and its drafter) and without, on the same embedded-task requests, interleaved "
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
    speculative.add_argument("--requests", type=int, default=16, metavar="N",
                             help="requests per batch size: max(2 x batch, N), so the batch "
                                  "stays near its size until the queue drains")
    speculative.add_argument("--max-tokens", type=int, metavar="N",
                             help="longest response (default: the embedded task's longest "
                                  "reference, or 256 with --model)")
    add_model_arguments(speculative)
    speculative.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    drafter = bench_kinds.add_parser(
        "drafter", help="spot-trained vs frozen drafter on an evolving target (2 ranks)",
        description="Fine-tunes the pre-trained embedded model round by round toward a drifted "
                    "task (the countdown steps down by two), or with --model the checkpoint "
                    "toward GSM8K-style worked solutions of arithmetic problems, and, on "
                    "`--world` gloo ranks, rolls out each round three ways: with the frozen "
                    "initial drafter, with the spot-trained drafter and no training, and with "
                    "spot training in the idle tail followed by the step-weighted refresh. "
                    "Reports acceptance per round and the makespan cost of spot training.")
    embedded_run, model_run = bench_drafter.DrafterBenchConfig(), bench_drafter.MODEL_CONFIG

    def sized(what: str, name: str) -> str:
        return (f"{what} (default: {getattr(embedded_run, name)}; with --model "
                f"{getattr(model_run, name)})")
    drafter.add_argument("--json", type=Path, metavar="FILE",
                         help="write {rows: per round and rank, summary} as JSON")
    drafter.add_argument("--rounds", type=int, help=sized("evolving-target rounds", "rounds"))
    drafter.add_argument("--world", type=int, default=embedded_run.world,
                         help=f"rollout ranks (processes) (default: {embedded_run.world})")
    drafter.add_argument("--requests", type=int, help=sized("requests per round", "requests"))
    drafter.add_argument("--group-size", type=int,
                         help=sized("samples per prompt (a GRPO group; a group stays on one "
                                    "rank)", "group_size"))
    drafter.add_argument("--extra-steps", type=int, default=embedded_run.extra_steps,
                         help="ceiling study: spot steps per rank added after each round, off "
                              "the clock, as if the tail had left that much idle time "
                              f"(default: {embedded_run.extra_steps})")
    drafter.add_argument("--steps-per-round", type=int,
                         help=sized("target fine-tuning steps between rounds (the drift)",
                                    "steps_per_round"))
    drafter.add_argument("--max-tokens", type=int, metavar="N",
                         help="longest response (default: the embedded task's longest "
                              f"reference; with --model {model_run.max_tokens})")
    add_model_arguments(drafter)

    rollout = bench_kinds.add_parser(
        "rollout", help="adaptive loop vs SD off / always on, long-tail and no-tail rollouts",
        description="A 64-request rollout of the embedded task (T=1, 8 prompts x 8 samples), "
                    "long-tailed and with equal lengths, in four modes side by side: SD off; SD "
                    "always on with the best fixed strategy; the adaptive loop (SD switch + "
                    "per-bucket bandit, calibrated at start); and the adaptive loop with "
                    "suffix-match drafts from sibling and previous-round responses. Reports "
                    "makespan, tokens/s, tail time, acceptance and speedup vs SD off.")
    rollout.add_argument("--json", type=Path, metavar="FILE", help="write rows and studies here")
    rollout.add_argument("--plot", type=Path, metavar="PNG",
                         help="plot the running batch over time per mode here")
    rollout.add_argument("--rounds", type=int, default=3,
                         help="measured rounds per mode (medians), after one unmeasured round")
    rollout.add_argument("--always", metavar="D,K,N",
                         help="SD-always's strategy (default: the best of one rollout per "
                              "adaptive plan)")
    rollout.add_argument("--max-tokens", type=int, default=1024, metavar="N",
                         help="with --model: longest long-tail response")
    rollout.add_argument("--sampled-drafts", action="store_true",
                         help="add sampled chains (each draft token drawn from the drafter's "
                              "distribution) to the adaptive modes' plans")
    add_model_arguments(rollout)
    rollout.add_argument("--no-progress", action="store_true", help="no progress bars")

    bench_train = bench_kinds.add_parser(
        "train", help="GRPO end to end: TLT vs SD off (and SD off with another seed)",
        description="Three GRPO runs on the embedded task, stepped in turn: TLT, SD off with "
                    "the same seed, SD off with another seed (the reward-noise floor). Reports "
                    "per-step time and reward, the end-to-end speedup, the reward gap and the "
                    "reward noise.")
    bench_train.add_argument("--json", type=Path, metavar="FILE", help="write rows + summary")
    bench_train.add_argument("--steps", type=int, default=12, help="GRPO steps per run")
    bench_train.add_argument("--prompts-per-step", type=int, metavar="N",
                             help="prompts per GRPO step (default: TrainConfig's)")
    bench_train.add_argument("--samples-per-prompt", type=int, metavar="N",
                             help="samples per prompt (default: TrainConfig's)")
    bench_train.add_argument("--max-new-tokens", type=int, metavar="N",
                             help="longest response (default: TrainConfig's)")
    bench_train.add_argument("--sampled-drafts", action="store_true",
                             help="TLT's adaptive plans include sampled chains")
    add_model_arguments(bench_train)
    bench_train.add_argument("--no-progress", action="store_true", help="no progress bars")

    simulate = bench_kinds.add_parser(
        "simulate", help="the scale simulator: validated on 2-rank runs here, then a projection",
        description="Validates the rollout simulator (cost model + response lengths -> "
                    "makespan) against measured 2-rank rollouts of forced-length traces of "
                    "several tail shapes, SD off and on, on the embedded model or with --model "
                    "a checkpoint, then projects a many-worker run. The projection is a "
                    "model's prediction, not a measurement.")
    embedded_traces, model_traces = bench_simulate.TraceSizes(), bench_simulate.MODEL_SIZES

    def traced(what: str, name: str) -> str:
        return (f"{what} (default: {getattr(embedded_traces, name)}; with --model "
                f"{getattr(model_traces, name)})")
    simulate.add_argument("--json", type=Path, metavar="FILE", help="write rows + projection")
    simulate.add_argument("--reps", type=int, default=3,
                          help="calibration sweeps and measured rollouts per row (medians) "
                               "(default: 3)")
    simulate.add_argument("--requests", type=int, metavar="N",
                          help=traced("requests per trace, both ranks together", "requests"))
    simulate.add_argument("--group-size", type=int, metavar="N",
                          help=traced("requests per group (one prompt, one length scale)",
                                      "group_size"))
    simulate.add_argument("--max-length", type=int, metavar="N",
                          help=traced("longest forced response length", "max_length"))
    simulate.add_argument("--calibration-tokens", type=int, metavar="N",
                          help=traced("forced length of the calibration's responses",
                                      "calibration_tokens"))
    simulate.add_argument("--calibration", type=Path, metavar="FILE",
                          help="a cost-model calibration (JSON; the GPU script writes one) for "
                               "the projection; default: the one measured here")
    simulate.add_argument("--workers", type=int, default=64,
                          help="workers in the projection (default: 64)")
    simulate.add_argument("--train-s-per-token", type=float,
                          help="training seconds per generated token, for the projection's "
                               "end-to-end speedup")
    simulate.add_argument("--rollout-share", type=float,
                          help="the rollout's share of an SD-off step (e.g. 0.85, what TLT's "
                               "paper reports for production traces), for an end-to-end speedup")
    add_model_arguments(simulate)

    peers = bench_kinds.add_parser(
        "peers", help="our SD vs HF assisted decoding, our GRPO vs TRL GRPO, on the same work",
        description="Our batch-1 speculative decoding against transformers' assisted decoding "
                    "(a 2-layer assistant of the same vocabulary, pre-trained on the task) with "
                    "the same target weights, at T=0 (outputs checked identical) and T=1; and "
                    "our GRPO driver (TLT and SD off) against TRL's GRPOTrainer on the same "
                    "model, prompts and settings (needs TRL: bash bench/setup_peers.sh). Rows: "
                    "peer, setting, ours, theirs (tokens/s), ratio (ours faster above 1).")
    peers.add_argument("--json", type=Path, metavar="FILE", help="write the rows here")
    peers.add_argument("--no-progress", action="store_true", help="no progress bars")
    kernels.set_defaults(runner=run_kernels)
    engine.set_defaults(runner=run_engine)
    speculative.set_defaults(runner=run_speculative)
    drafter.set_defaults(runner=run_drafter)
    rollout.set_defaults(runner=run_rollout)
    bench_train.set_defaults(runner=run_train)
    simulate.set_defaults(runner=run_simulate)
    peers.set_defaults(runner=run_peers)

    task = commands.add_parser("task", help="the embedded task")
    task_kinds = task.add_subparsers(dest="task", required=True, metavar="WHAT")
    lengths = task_kinds.add_parser(
        "lengths", help="response-length distribution (reference and pre-trained model)",
        description="Prints length statistics of the embedded task's reference solutions and "
                    "of the pre-trained embedded model's samples at temperature 1, and optionally "
                    "plots their histograms.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lengths.add_argument("--problems", type=int, default=5000,
                         help="reference problems to measure")
    lengths.add_argument("--model-problems", type=int, default=512,
                         help="problems the pre-trained model answers (0: skip the model)")
    lengths.add_argument("--plot", type=Path, metavar="PNG", help="write a histogram image")
    lengths.set_defaults(runner=run_task_lengths)


def _write_json(path: Path | None, result: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def _write_rows(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


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
        print(f"drafter: {report.steps} training steps, teacher-forced top-1 agreement "
              f"{report.final_top1:.3f}")
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
        print(f"wrote {args.plot}")
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    always = None if args.always is None else bench_speculative.parse_strategy(args.always)
    if args.model is None:
        workload = load_embedded(progress=not args.no_progress)
        result = bench_rollout.run(workload.target, workload.drafter, rounds=args.rounds,
                                   always=always, progress=not args.no_progress,
                                   sampled_drafts=args.sampled_drafts)
    else:
        model = model_workload(args, "tlt bench rollout", needs_drafter=True)
        requests, calibration, max_len = bench_rollout.model_workloads(
            model, max_tokens=args.max_tokens)
        result = bench_rollout.run(model.target, model.drafter, rounds=args.rounds,
                                   workload_set=requests, calibration=calibration,
                                   max_len=max_len, always=always, studies=False,
                                   label=model.label, progress=not args.no_progress,
                                   sampled_drafts=args.sampled_drafts)
    print(bench_rollout.format_table(result))
    if args.plot is not None:
        bench_rollout.plot(result, args.plot)
        print(f"wrote {args.plot}")
    _write_json(args.json, result)
    return 0


def run_train(args: argparse.Namespace) -> int:
    sizes = {name: getattr(args, name) for name in ("prompts_per_step", "samples_per_prompt",
                                                     "max_new_tokens")
             if getattr(args, name) is not None}
    try:
        config = TrainConfig(steps=args.steps, sampled_drafts=args.sampled_drafts, **sizes)
    except ValueError as error:
        raise SystemExit(f"tlt bench train: --{str(error).replace('_', '-')}") from None
    if args.model is None:
        result = bench_train.run(config, progress=not args.no_progress)
    else:
        command = "tlt bench train"
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
        result = bench_train.run(config, progress=not args.no_progress, inputs=inputs,
                                 label=model_label(args.model, placement.dtype))
    print(bench_train.format_table(result))
    _write_json(args.json, result)
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    command = "tlt bench simulate"
    try:
        sizes = bench_simulate.trace_sizes(
            args.model is not None, requests=args.requests, group_size=args.group_size,
            max_length=args.max_length, calibration_tokens=args.calibration_tokens)
    except ValueError as error:
        raise SystemExit(f"{command}: --{str(error).replace('_', '-')}") from None
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


def run_peers(args: argparse.Namespace) -> int:
    workload = load_embedded(progress=not args.no_progress)
    rows = bench_peers.hf_assisted(workload.target, workload.drafter,
                                   progress=not args.no_progress)
    try:
        rows += bench_peers.trl_grpo(progress=not args.no_progress)
    except ImportError as error:
        print(f"trl_grpo: skipped, TRL is not installed ({error}); bash bench/setup_peers.sh "
              "installs it", file=sys.stderr)
    print(bench_peers.format_table(rows))
    _write_rows(args.json, rows)
    return 0


def run_drafter(args: argparse.Namespace) -> int:
    command = "tlt bench drafter"
    try:
        config = bench_drafter.bench_config(
            args.model is not None, rounds=args.rounds, world=args.world,
            requests=args.requests, group_size=args.group_size,
            steps_per_round=args.steps_per_round, extra_steps=args.extra_steps,
            max_tokens=args.max_tokens)
    except ValueError as error:
        raise SystemExit(f"{command}: --{str(error).replace('_', '-')}") from None
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
        print(f"wrote {args.plot}")
    return 0
