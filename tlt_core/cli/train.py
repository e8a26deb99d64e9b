"""`tlt train`: GRPO or PPO with TLT on the embedded task (no arguments) or a local checkpoint.

Writes, under --out (OUT; `OUT/baseline/` holds the same for --compare's SD-off run):
- metrics.jsonl, one line per step, and, when the tensorboard package is installed, TensorBoard
  event files beside it (names and units: tlt_core.outputs.metrics, docs/metrics.md); with
  --wandb-project, the same metrics to a Weights & Biases run too, its local files in wandb/
  and its id in wandb_run_id (--resume continues that run; --compare's baseline is a second
  run, NAME-baseline, in the group NAME);
- checkpoints/step-NNNNNN/ after every step (the state after NNNNNN steps, for --resume;
  tlt_core.persistence.checkpoint_io: safetensors and JSON, atomic), the newest
  --keep-checkpoints kept;
- policy/step-NNNNNN/, the policy as a Hugging Face folder transformers loads
  (tlt_core.outputs.policy_folder), after the last step and every --save-every steps; each folder
  written is printed (there is no "latest" link);
- tokenizer/, the --model checkpoint's tokenizer, once (`tlt export policy` rebuilds a policy
  folder from a checkpoint with it);
- report.md with its plots at the end.
Ctrl-C (or a killed rank) loses at most the step in progress; the message says how to resume.
A write that fails (disk full, no permission) stops the run with the path it could not write,
leaving the newest complete checkpoint and metrics.jsonl as they were. Rank 0 writes.

What a run does to an existing OUT (tlt_core.outputs.run_folder): one that holds an earlier run is
refused unless --resume (continue from its newest checkpoint; refused where there is none) or
--overwrite (delete the earlier run's parts first); a folder another run is using is refused,
naming its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from tlt_core.cli.model_options import (add_placement_arguments, add_prompt_arguments,
                                        placement_from_args)
from tlt_core.cli.local_ranks import run_local_ranks, under_a_launcher
from tlt_core.adaptive.measured_plans import measured_plans
from tlt_core.cli.options import add_dataclass_arguments, dataclass_from_args
from tlt_core.embedded.workload import train_inputs
from tlt_core.outputs.metrics import MetricsWriter, tensorboard_available
from tlt_core.outputs.policy_folder import SpecialTokenIds, write_policy_folder
from tlt_core.outputs.report import summarize, write_report
from tlt_core.outputs.run_folder import (BASELINE_DIR, CHECKPOINTS_DIR, POLICY_DIR, TOKENIZER_DIR,
                                         RunFolderError, clear_run, hold_run_folder, resume_point)
from tlt_core.outputs.wandb_logger import WANDB_MODES, WandbError, WandbSettings, wandb_available
from tlt_core.persistence.checkpoint_io import atomic_folder, latest_checkpoint, step_folder_name
from tlt_core.rl.config import CHOICES, TrainConfig
from tlt_core.rl.driver import RLDriver
from tlt_core.tasks.inputs import TrainInputs, checkpoint_inputs, load_reward
from tlt_core.tasks.rewards import RewardMix, math_reward

logger = logging.getLogger(__name__)



def add_parsers(commands) -> None:
    train = commands.add_parser(
        "train", help="GRPO or PPO with TLT (the main job): the embedded task by default",
        description="GRPO (or --algorithm ppo) on the embedded task and model with TLT on "
                    "(adaptive speculative "
                    "rollout, spot-trained drafter) when run with no arguments: under a "
                    "minute on 2 CPU cores. --compare adds the SD-off baseline with the same "
                    "seeds and prints the end-to-end speedup. --model PATH --data FILE trains "
                    "a local Hugging Face checkpoint on a prompt file. Multi-process: torchrun "
                    "--nproc-per-node N -m tlt_core.cli train (gloo on CPU, NCCL on GPU).")
    add_arguments(train)
    train.set_defaults(runner=run_train)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, TrainConfig, choices=CHOICES)
    parser.add_argument("--compare", action="store_true",
                        help="also run the SD-off baseline with the same seeds and config, and "
                             "print the end-to-end speedup")
    parser.add_argument("--out", type=Path, default=Path("runs/tlt-train"), metavar="DIR",
                        help="run folder: metrics, checkpoints, policy folders, report")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its newest checkpoint "
                             "(OUT/checkpoints/step-NNNNNN); refused when there is none")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run in --out: delete its checkpoints, policy "
                             "folders, tokenizer, metrics, TensorBoard events and report first "
                             "(other files there stay). Without --overwrite or --resume, an "
                             "--out that holds a run is refused")
    parser.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                        help="resume checkpoints kept in OUT/checkpoints (one is written after "
                             "every step; older ones are deleted once the new one is complete)")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="also write the policy as a Hugging Face folder, "
                             "OUT/policy/step-NNNNNN, every N steps (0: only after the last "
                             "step, which is always written)")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="a local Hugging Face checkpoint folder (default: the embedded model)")
    parser.add_argument("--data", type=Path, metavar="FILE",
                        help="prompts with reference answers (needed with --model): JSONL, "
                             "Parquet, CSV or JSON, or a Hugging Face datasets folder")
    parser.add_argument("--eval-data", type=Path, metavar="FILE",
                        help="held-out prompts with reference answers for --eval-every (same "
                             "formats and fields as --data; the embedded task has its own)")
    parser.add_argument("--drafter", type=Path, metavar="DIR",
                        help="a drafter for --model: any folder --drafter flags read (a "
                             "Drafter.save folder, a `tlt export drafter` export, a published "
                             "EAGLE-1/2 or EAGLE-3 checkpoint; an EAGLE-3 drafter drafts as "
                             "loaded, ours are also spot-trained). Without one, TLT uses "
                             "suffix-match drafts only")
    parser.add_argument("--prompt-field", metavar="PATH",
                        help="the data's prompt field, dotted for a nested one "
                             "(extra_info.question; default: the first of prompt, question, "
                             "problem, messages it has); a list of chat messages is a chat")
    parser.add_argument("--answer-field", metavar="PATH",
                        help="the data's reference-answer field, dotted for a nested one "
                             "(default: the first of answer, solution, reference, "
                             "reward_model.ground_truth; GSM8K's '... #### 72' means 72)")
    parser.add_argument("--split", metavar="NAME",
                        help="the split of a Hugging Face datasets folder (default: train)")
    add_placement_arguments(parser)
    add_prompt_arguments(parser)
    parser.add_argument("--reward", default="math", metavar="math|math+format|MODULE:FUNCTION",
                        help="the reward: math (math-verify's answer check), math+format (plus "
                             "0.1 for a final answer in a recognised form), or a function: "
                             "f(prompt, response, reference), TRL's f(prompts, completions, "
                             "**kwargs) or veRL's compute_score(data_source, solution_str, "
                             "ground_truth, extra_info), told apart by its parameters")
    parser.add_argument("--strict-data", action="store_true",
                        help="stop on malformed data rows instead of skipping them")
    parser.add_argument("--tensorboard", choices=("auto", "on", "off"), default="auto",
                        help="TensorBoard event files next to metrics.jsonl in --out (the "
                             "scalars of docs/metrics.md): auto writes them when the "
                             "tensorboard package is installed, on requires it")
    parser.add_argument("--wandb-project", metavar="NAME",
                        help="also log the metrics to this Weights & Biases project (the wandb "
                             "package: pip install wandb; default: none, wandb off)")
    parser.add_argument("--wandb-mode", choices=WANDB_MODES,
                        help="online streams to the W&B server (after `wandb login`); offline "
                             "writes the run under OUT/wandb, for `wandb sync` to upload later "
                             "(default: online, or WANDB_MODE when set)")
    parser.add_argument("--wandb-run-name", metavar="NAME",
                        help="the wandb run's name (default: the --out folder's name); "
                             "--compare's baseline is NAME-baseline, both in the group NAME")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="local ranks (processes, gloo) to start: ranks that finish their "
                             "share of a rollout train the drafter while the others decode the "
                             "tail. Default: 2 for the embedded task on a machine with 2 or "
                             "more cores, else 1; ignored under torchrun, whose ranks count")


def run_train(args: argparse.Namespace) -> int:
    config = dataclass_from_args(TrainConfig, args, "tlt train")
    _check_arguments(args, config)
    nproc = args.nproc if args.nproc is not None else (
        min(2, len(os.sched_getaffinity(0))) if args.model is None else 1)
    if nproc > 1 and not under_a_launcher():
        return run_local_ranks(nproc, run_train, args)
    tensorboard = _tensorboard_wanted(args.tensorboard)
    if args.model is not None:
        reward = _reward(args.reward)
        placement = placement_from_args(args, "tlt train", embedded=False)

        def inputs() -> TrainInputs:
            try:
                return checkpoint_inputs(
                    args.model, args.data, drafter_path=args.drafter,
                    skip_bad_rows=not args.strict_data, reward_fn=reward, placement=placement,
                    chat_template=args.chat_template, system_prompt=args.system_prompt,
                    prompt_key=args.prompt_field, answer_key=args.answer_field,
                    split=args.split, eval_data_path=args.eval_data)
            except (FileNotFoundError, ImportError, ValueError) as error:  # they name the file
                raise SystemExit(f"tlt train: {error}") from None
    else:
        logger.info("tlt train: GRPO on the embedded task (countdown sums mod 100, worked step "
                    "by step, with heavy-tailed response lengths) and the embedded model (8 "
                    "layers, 1.6M parameters), TLT %s; %d steps. Set-up first: load the model "
                    "and drafter (shipped with the package), then calibrate the adaptive loop's "
                    "cost model (seconds).", "on" if config.tlt else "off", config.steps)
        inputs = lambda: train_inputs(progress=not args.no_progress)  # noqa: E731
    runs = {"tlt" if config.tlt else "baseline": (args.out, config)}
    if args.compare and config.tlt:
        runs["baseline"] = (args.out / BASELINE_DIR, replace(config, tlt=False))
    writing = _rank() == 0  # rank 0 writes metrics, checkpoints and policy folders
    histories = {}
    with contextlib.ExitStack() as held:
        try:
            if writing:  # every folder a run writes (clear_run below keeps the lock files)
                for folder, _ in runs.values():
                    held.enter_context(hold_run_folder(folder))
            starts = {name: resume_point(folder, resume=args.resume, overwrite=args.overwrite,
                                         nested=folder != args.out)
                      for name, (folder, _) in runs.items()}
            if writing and args.overwrite:
                clear_run(args.out)
        except RunFolderError as error:
            raise SystemExit(f"tlt train: {error}") from None
        except OSError as error:  # taking the lock or clearing OUT; it names the path
            raise SystemExit(f"tlt train: --out: {error}") from None
        for name, (folder, run_config) in runs.items():
            histories[name] = _train_one(name, folder, run_config, inputs(), args, tensorboard,
                                         starts[name], nested=folder != args.out)
            if histories[name] is None:
                return 130
        report = write_report(args.out, histories)
    print()
    for name, history in histories.items():
        s = summarize(history)
        print(f"{name}: {s['steps']} steps in {s['time_s']:.1f} s (rollout {s['rollout_s']:.1f} s, "
              f"update {s['update_s']:.1f} s), reward {s['reward_first']:.3f} -> "
              f"{s['reward_last']:.3f} (mean {s['reward_mean']:.3f}), max logprob gap "
              f"{s['max_logprob_gap']:.1e}")
    if "baseline" in histories and "tlt" in histories:
        speedup = summarize(histories["baseline"])["time_s"] / summarize(histories["tlt"])["time_s"]
        print(f"end-to-end speedup of TLT over SD off: {speedup:.2f}x")
    print(f"report: {report}")
    return 0


def _check_arguments(args: argparse.Namespace, config: TrainConfig) -> None:
    """The flags that go together, and the ranges argparse does not check."""
    if args.eval_data is not None and args.model is None:
        raise SystemExit("tlt train: --eval-data goes with --model; the embedded task evaluates "
                         "on its own held-out problems")
    if config.eval_every and args.model is not None and args.eval_data is None:
        raise SystemExit("tlt train: --eval-every: needs --eval-data FILE (held-out prompts)")
    if (args.model is None) != (args.data is None):
        raise SystemExit("tlt train: --model and --data go together (a checkpoint and its "
                         "prompts); with neither, the embedded task and model are used")
    if args.model is None and (args.device not in ("auto", "cpu")
                               or args.dtype not in ("auto", "float32")):
        raise SystemExit("tlt train: the embedded task runs in float32 on the CPU; "
                         "--device / --dtype apply to --model")
    if config.tlt and config.plans_from is not None:  # before a model loads
        try:
            measured_plans(config.plans_from, config.temperature)
        except (FileNotFoundError, ValueError) as error:  # it names the file and the row
            raise SystemExit(f"tlt train: --plans-from: {error}") from None
    for flag, value, least in (("--keep-checkpoints", args.keep_checkpoints, 1),
                               ("--save-every", args.save_every, 0),
                               ("--nproc", 1 if args.nproc is None else args.nproc, 1)):
        if value < least:
            raise SystemExit(f"tlt train: {flag}: must be >= {least}, got {value}")


def _reward(choice: str):
    if choice == "math":
        return math_reward
    if choice == "math+format":
        return RewardMix(math=1.0, format=0.1)
    try:
        return load_reward(choice)
    except ValueError as error:
        raise SystemExit(f"tlt train: --{error} (or math, math+format)") from None


def _tensorboard_wanted(choice: str) -> bool:
    if choice == "off":
        return False
    if tensorboard_available():
        return True
    if choice == "on":
        raise SystemExit("tlt train: --tensorboard on: the tensorboard package is not installed "
                         "(pip install tensorboard)")
    logger.info("metrics: metrics.jsonl only (pip install tensorboard for TensorBoard event "
                "files)")
    return False


def _rank() -> int:
    """This process's rank, before the driver joins the process group (torchrun sets RANK)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _train_one(name: str, folder: Path, config: TrainConfig, inputs: TrainInputs,
               args: argparse.Namespace, tensorboard: bool, start: Path | None, *,
               nested: bool) -> list[dict] | None:
    """Trains one run in `folder` from the checkpoint `start` (None: from scratch); the
    history, or None when interrupted. nested: the baseline run of --compare."""
    try:
        driver = RLDriver(inputs.policy, inputs.prompts, inputs.reward_fn, inputs.detokenize,
                          inputs.stop_ids, config, drafter=inputs.drafter,
                          calibration=inputs.calibration, evaluation=inputs.evaluation)
    except ValueError as error:  # a setting this policy or these inputs cannot take; it names it
        raise SystemExit(f"tlt train: {error}") from None
    folder.mkdir(parents=True, exist_ok=True)
    checkpoints = folder / CHECKPOINTS_DIR
    if inputs.bad_rows:
        logger.warning("data: skipped %d malformed rows (first: line %s: %s)",
                       len(inputs.bad_rows), *inputs.bad_rows[0])
    if start is not None:
        try:
            driver.resume(start)
        except (FileNotFoundError, ValueError) as error:  # it names what differs or is damaged
            raise SystemExit(f"tlt train: --resume: {error}") from None
        logger.info("%s: resumed at step %d from %s", name, driver.state.step, start)
    writing = driver.group.rank == 0  # rank 0 writes metrics, checkpoints and policy folders
    # Without a Hugging Face tokenizer (the embedded model) the folders still name the ids that
    # end a response, so that transformers' generate stops where the rollouts did.
    token_ids = None if inputs.tokenizer is not None else SpecialTokenIds(eos=inputs.stop_ids)
    bar = tqdm(total=config.steps, initial=driver.state.step,
               disable=args.no_progress or not writing,
               desc=name, unit="step", file=sys.stderr)
    try:
        if writing and inputs.tokenizer is not None:  # lets `tlt export policy` rebuild a step
            with atomic_folder(folder / TOKENIZER_DIR) as temporary:
                inputs.tokenizer.save(temporary)
        with _metrics_writer(folder, config, args, tensorboard, nested=nested,
                             history=driver.state.history if start is not None else None,
                             enabled=writing) as writer:
            logger.info("%s: %s, TLT %s; %d steps x %d prompts x %d samples -> %s%s", name,
                        inputs.description, "on" if config.tlt else "off", config.steps,
                        config.prompts_per_step, config.samples_per_prompt, folder,
                        " (metrics.jsonl + TensorBoard)" if writer.tensorboard else "")
            while driver.state.step < config.steps:
                metrics = driver.step()
                driver.save(checkpoints, keep=args.keep_checkpoints)
                writer.write(metrics)
                bar.update()
                bar.write(_line(metrics))
                step = driver.state.step
                if writing and (step == config.steps or
                                args.save_every and step % args.save_every == 0):
                    policy = write_policy_folder(
                        driver.policy, folder / POLICY_DIR / step_folder_name(step),
                        tokenizer=inputs.tokenizer, step=step, token_ids=token_ids)
                    bar.write(f"{name}: policy after step {step}: {policy}")
    except KeyboardInterrupt:
        bar.close()
        logger.warning("%s: interrupted in step %d; %s", name, driver.state.step,
                       _how_to_continue(checkpoints, nested))
        return None
    except OSError as error:  # disk full, no permission: it names the path
        bar.close()
        raise SystemExit(f"tlt train: {error}. Once that is fixed: "
                         + _how_to_continue(checkpoints, nested)) from None
    bar.close()
    return driver.state.history


def _metrics_writer(folder: Path, config: TrainConfig, args: argparse.Namespace,
                    tensorboard: bool, *, nested: bool, history: list[dict] | None,
                    enabled: bool) -> MetricsWriter:
    """The run's MetricsWriter, with its wandb run when --wandb-project is given (named as
    --wandb-run-name says); wandb missing or failing to start stops `tlt train` with the fix."""
    wandb = None
    if args.wandb_project is not None:
        if not wandb_available():
            raise SystemExit("tlt train: --wandb-project: the wandb package is not installed "
                             "(pip install wandb)")
        name = args.wandb_run_name or args.out.resolve().name
        try:
            wandb = WandbSettings(args.wandb_project, mode=args.wandb_mode,
                                  run_name=f"{name}-baseline" if nested else name,
                                  group=name if args.compare else None,
                                  config=config.as_record())
        except ValueError as error:  # "project: must be ...": the flag is --wandb-project
            setting, _, why = str(error).partition(": ")
            raise SystemExit(f"tlt train: --wandb-{setting.replace('_', '-')}: {why}") from None
    try:
        writer = MetricsWriter(folder, tensorboard=tensorboard, history=history,
                               enabled=enabled, wandb=wandb)
    except WandbError as error:
        raise SystemExit(f"tlt train: --wandb-project: {error}") from None
    if writer.wandb is not None:
        logger.info("wandb: run %s of project %s, %s", writer.wandb.run_id, args.wandb_project,
                    f"offline in {folder / 'wandb'} (`wandb sync` uploads it)"
                    if writer.wandb.offline else writer.wandb.url or "online")
    return writer


def _how_to_continue(checkpoints: Path, nested: bool) -> str:
    """Where the run stands on disk, and the command that continues it."""
    saved = latest_checkpoint(checkpoints)
    if saved is not None:
        return (f"the newest complete checkpoint is {saved}; continue with the same arguments "
                "plus --resume.")
    if nested:  # --resume ends the TLT run where it is and starts the baseline afresh
        return "no step had finished; continue with the same arguments plus --resume."
    return "no step had finished; start again with the same arguments plus --overwrite."


def _line(m: dict) -> str:
    acceptance = m["spec/acceptance_length"]
    acceptance = "-" if acceptance is None else f"{acceptance:.2f}"
    version = "-" if m["drafter/version"] is None else str(m["drafter/version"])
    errors = m["train/reward_errors"]
    return (f"step {m['step']:>3}  reward {m['train/reward']:.3f}  step "
            f"{m['train/step_s']:.2f}s  rollout {100 * m['rollout/time_share']:.0f}%  tail "
            f"{m['rollout/tail_s']:.2f}s  accept {acceptance}  SD-on "
            f"{100 * m['spec/sd_step_share']:.0f}%{_sd_rows(m)}  drafter v{version}  gap "
            f"{m['train/logprob_gap']:.1e}" + (f"  reward errors {errors}" if errors else ""))


def _sd_rows(m: dict) -> str:
    """Where SD ran: at and below the largest speculative step's batch, of the peak batch."""
    if m["spec/batch_max"] is None:
        return ""
    return f" (at <= {m['spec/batch_max']} of {max(m['trace_running'])} rows)"
