"""`tlt train`: GRPO with TLT on the embedded task (no arguments) or a local checkpoint.

Writes, under --out: metrics.jsonl (one line per step; `baseline/` for --compare's SD-off run)
and, when the tensorboard package is installed, TensorBoard event files beside it (names and
units: tlt_core.rl.metrics, docs/metrics.md), checkpoint.pt after every step, and report.md with
its plots at the end. Ctrl-C (or a killed rank) loses at most the step in progress; the message
says how to resume. Rank 0 writes metrics and checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from tlt_core.cli.options import add_dataclass_arguments, dataclass_from_args
from tlt_core.embedded.workload import train_inputs
from tlt_core.rl.driver import GRPODriver, TrainConfig
from tlt_core.rl.inputs import TrainInputs, checkpoint_inputs, load_reward
from tlt_core.rl.metrics import MetricsWriter, tensorboard_available
from tlt_core.rl.report import summarize, write_report
from tlt_core.rl.rewards import math_reward

_HELP = {
    "steps": "GRPO steps",
    "prompts_per_step": "prompts per step (each sampled samples_per_prompt times)",
    "samples_per_prompt": "samples per prompt (the GRPO group)",
    "max_new_tokens": "most tokens per response",
    "temperature": "sampling temperature of the rollout (and of the log-probs trained on)",
    "lr": "AdamW learning rate",
    "clip_eps": "PPO clip range: ratios outside [1 - eps, 1 + eps] stop the gradient",
    "kl_coef": "KL penalty to the frozen initial policy (k3 estimator); 0 turns it off",
    "minibatch_size": "sequences per optimizer step",
    "micro_batch_tokens": "padded tokens per forward/backward (a mini-batch runs as length-"
                          "sorted micro-batches under this budget; same update, less padding)",
    "ppo_epochs": "passes over the step's rollouts",
    "max_grad_norm": "gradient clipping norm",
    "seed": "seed of prompts, sampling and mini-batches",
    "max_batch": "engine rows per rank (the most samples decoding at once)",
    "tlt": "TLT: adaptive speculative rollout and the spot-trained drafter (off: plain "
           "decoding only, the SD-off baseline)",
    "suffix_drafts": "suffix-match drafts (copied from sibling and earlier responses) among "
                     "the adaptive loop's plans",
}


def add_parsers(commands) -> None:
    train = commands.add_parser(
        "train", help="GRPO with TLT (the main job): the embedded task by default",
        description="GRPO on the embedded task and model with TLT on (adaptive speculative "
                    "rollout, spot-trained drafter) when run with no arguments: under a "
                    "minute on 2 CPU cores. --compare adds the SD-off baseline with the same "
                    "seeds and prints the end-to-end speedup. --model PATH --data FILE trains "
                    "a local Hugging Face checkpoint on a prompt file. Multi-process: torchrun "
                    "--nproc-per-node N -m tlt_core.cli train (gloo on CPU, NCCL on GPU).")
    add_arguments(train)
    train.set_defaults(runner=run_train)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, TrainConfig, _HELP)
    parser.add_argument("--compare", action="store_true",
                        help="also run the SD-off baseline with the same seeds and config, and "
                             "print the end-to-end speedup")
    parser.add_argument("--out", type=Path, default=Path("runs/tlt-train"), metavar="DIR",
                        help="run folder: metrics, checkpoint, report")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its checkpoint")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="a local Hugging Face checkpoint folder (default: the embedded model)")
    parser.add_argument("--data", type=Path, metavar="FILE",
                        help="JSONL or Parquet prompts with 'prompt' and 'answer' fields (needed "
                             "with --model)")
    parser.add_argument("--drafter", type=Path, metavar="DIR",
                        help="a drafter folder for --model (without one, TLT uses suffix-match "
                             "drafts only)")
    parser.add_argument("--reward", metavar="MODULE:FUNCTION",
                        help="a reward function taking (prompt, response, reference) (default: "
                             "the math-answer verifier)")
    parser.add_argument("--strict-data", action="store_true",
                        help="stop on malformed data rows instead of skipping them")
    parser.add_argument("--tensorboard", choices=("auto", "on", "off"), default="auto",
                        help="TensorBoard event files next to metrics.jsonl in --out (the "
                             "scalars of docs/metrics.md): auto writes them when the "
                             "tensorboard package is installed, on requires it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
    config = dataclass_from_args(TrainConfig, args, _HELP, "tlt train")
    tensorboard = _tensorboard_wanted(args.tensorboard)
    if (args.model is None) != (args.data is None):
        raise SystemExit("tlt train: --model and --data go together (a checkpoint and its "
                         "prompts); with neither, the embedded task and model are used")
    if args.model is not None:
        reward = load_reward(args.reward) if args.reward else math_reward
        inputs = lambda: checkpoint_inputs(args.model, args.data, drafter_path=args.drafter,  # noqa: E731
                                           skip_bad_rows=not args.strict_data, reward_fn=reward)
    else:
        print("tlt train: GRPO on the embedded task (countdown sums mod 100, worked step by "
              "step, with heavy-tailed response lengths) and the embedded model (8 layers, "
              "1.6M parameters), TLT " + ("on" if config.tlt else "off") + f"; {config.steps} "
              "steps. Set-up first: load the model and drafter (shipped with the package), "
              "then calibrate the adaptive loop's cost model (seconds).", file=sys.stderr,
              flush=True)
        inputs = lambda: train_inputs(progress=not args.no_progress)  # noqa: E731
    runs = {"tlt" if config.tlt else "baseline": (args.out, config)}
    if args.compare and config.tlt:
        runs["baseline"] = (args.out / "baseline", replace(config, tlt=False))
    histories = {}
    for name, (folder, run_config) in runs.items():
        histories[name] = _train_one(name, folder, run_config, inputs(), args, tensorboard)
        if histories[name] is None:
            return 130
    report = write_report(args.out, histories)
    print()
    for name, history in histories.items():
        s = summarize(history)
        print(f"{name}: {s['steps']} steps in {s['time_s']:.1f} s (rollout {s['rollout_s']:.1f} s, "
              f"train {s['train_s']:.1f} s), reward {s['reward_first']:.3f} -> "
              f"{s['reward_last']:.3f} (mean {s['reward_mean']:.3f}), max logprob gap "
              f"{s['max_logprob_gap']:.1e}")
    if "baseline" in histories and "tlt" in histories:
        speedup = summarize(histories["baseline"])["time_s"] / summarize(histories["tlt"])["time_s"]
        print(f"end-to-end speedup of TLT over SD off: {speedup:.2f}x")
    print(f"report: {report}")
    return 0


def _tensorboard_wanted(choice: str) -> bool:
    if choice == "off":
        return False
    if tensorboard_available():
        return True
    if choice == "on":
        raise SystemExit("tlt train: --tensorboard on: the tensorboard package is not installed "
                         "(pip install tensorboard)")
    print("metrics: metrics.jsonl only (pip install tensorboard for TensorBoard event files)",
          file=sys.stderr)
    return False


def _train_one(name: str, folder: Path, config: TrainConfig, inputs: TrainInputs,
               args: argparse.Namespace, tensorboard: bool) -> list[dict] | None:
    driver = GRPODriver(inputs.policy, inputs.prompts, inputs.reward_fn, inputs.detokenize,
                        inputs.stop_ids, config, drafter=inputs.drafter,
                        calibration=inputs.calibration)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = folder / "checkpoint.pt"
    if inputs.bad_rows:
        print(f"data: skipped {len(inputs.bad_rows)} malformed rows "
              f"(first: line {inputs.bad_rows[0][0]}: {inputs.bad_rows[0][1]})", file=sys.stderr)
    resumed = args.resume and checkpoint.is_file()
    if resumed:
        driver.resume(checkpoint)
        print(f"{name}: resumed at step {driver.state.step} from {checkpoint}")
    # rank 0 writes the metrics, as it writes the checkpoint
    writer = MetricsWriter(folder, tensorboard=tensorboard,
                           history=driver.state.history if resumed else None,
                           enabled=driver.group.rank == 0)
    print(f"{name}: {inputs.description}, TLT {'on' if config.tlt else 'off'}; "
          f"{config.steps} steps x {config.prompts_per_step} prompts x "
          f"{config.samples_per_prompt} samples -> {folder}"
          + (" (metrics.jsonl + TensorBoard)" if writer.tensorboard else ""))
    bar = tqdm(total=config.steps, initial=driver.state.step, disable=args.no_progress,
               desc=name, unit="step", file=sys.stderr)
    try:
        with writer:
            while driver.state.step < config.steps:
                metrics = driver.step()
                driver.save(checkpoint)
                writer.write(metrics)
                bar.update()
                bar.write(_line(metrics))
    except KeyboardInterrupt:
        bar.close()
        print(f"\n{name}: interrupted in step {driver.state.step}; steps before it are saved "
              f"in {checkpoint}. Resume with the same arguments plus --resume.", file=sys.stderr)
        return None
    bar.close()
    return driver.state.history


def _line(m: dict) -> str:
    acceptance = "-" if m["acceptance_length"] is None else f"{m['acceptance_length']:.2f}"
    version = "-" if m["drafter_version"] is None else str(m["drafter_version"])
    return (f"step {m['step']:>3}  reward {m['reward']:.3f}  step {m['step_s']:.2f}s  rollout "
            f"{100 * m['rollout_share']:.0f}%  tail {m['tail_s']:.2f}s  accept {acceptance}  "
            f"SD-on {100 * m['sd_on_share']:.0f}%  drafter v{version}  gap "
            f"{m['logprob_gap']:.1e}" + (f"  reward errors {m['reward_errors']}"
                                        if m["reward_errors"] else ""))
