"""`tlt export drafter --to {eagle,speculators} OUT`: a drafter in a serving engine's format.

Writes OUT in SGLang's EAGLE-1 layout (`--to eagle`) or vLLM's speculators layout
(`--to speculators`) with provenance: the target's weights hash, the RL step, the acceptance
length at export, the tlt_core version and the date (tlt_core.drafting.export). Only a drafter
trained with DrafterConfig(form="eagle") exports; any other is refused with the reason.

Inputs: --drafter DIR (a folder written by Drafter.save; default: the embedded drafter) and
--target DIR (a local Hugging Face checkpoint; default: the embedded model); or --run DIR, a
`tlt train` run folder: the drafter RL spot-trained, as of its checkpoint.pt, drafting for the
policy of that step (the checkpoint's policy weights in --target's architecture; the provenance
hashes those weights and records the checkpoint's step). The acceptance length is
--acceptance, or, for the embedded architecture, measured here in a few seconds: greedy
rollouts of 16 held-out embedded-task problems with a (6,1,7) chain strategy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import EXPORT_FORMATS, export_drafter, exportable
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.embedded.workload import load_embedded
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.rl.driver import read_checkpoint

ACCEPTANCE_PROBLEMS, ACCEPTANCE_SEED = 16, 4242  # held out: training and benches use others


def add_parsers(commands) -> None:
    export = commands.add_parser(
        "export", help="a trained drafter in a serving engine's format (EAGLE, speculators)",
        description="Exports artifacts for serving engines: `tlt export drafter --to "
                    "{eagle,speculators} OUT` writes a drafter in SGLang's EAGLE or vLLM's "
                    "speculators layout, with provenance.")
    add_arguments(export)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `export` command's arguments: its one subcommand, `drafter`."""
    kinds = parser.add_subparsers(dest="export", required=True, metavar="WHAT")
    drafter = kinds.add_parser(
        "drafter", help="a drafter in SGLang's EAGLE-1 or vLLM's speculators layout",
        description="Writes a drafter trained with DrafterConfig(form='eagle') as an EAGLE-1 "
                    "checkpoint SGLang serves (--to eagle: LlamaForCausalLMEagle) or in the "
                    "speculators format (--to speculators: speculators_model_type 'eagle'), "
                    "with provenance (target weights hash, RL step, acceptance length, "
                    "tlt_core version, date). See docs/export.md for the field mapping.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    drafter.add_argument("out", type=Path, metavar="OUT", help="folder to write")
    drafter.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="the layout")
    drafter.add_argument("--drafter", type=Path, metavar="DIR",
                         help="a drafter folder written by Drafter.save (default: the "
                              "embedded drafter)")
    drafter.add_argument("--target", type=Path, metavar="DIR",
                         help="the drafter's target, a local Hugging Face checkpoint folder "
                              "(default: the embedded model)")
    drafter.add_argument("--run", type=Path, metavar="DIR",
                         help="a `tlt train` run folder: export the drafter of its "
                              "checkpoint.pt, for the policy of that step (instead of --drafter; "
                              "--target gives the architecture)")
    drafter.add_argument("--step", type=int, metavar="N",
                         help="the RL step the drafter was exported at (default: unknown; "
                              "with --run, the checkpoint's)")
    drafter.add_argument("--acceptance", type=float, metavar="X",
                         help="acceptance length (tokens per speculative step) at export "
                              "(default: measured on the embedded task when the target is the "
                              "embedded model, else unknown)")
    drafter.add_argument("--speculative-tokens", type=int, default=5, metavar="N",
                         help="--to speculators: tokens per greedy proposal (vLLM's "
                              "num_speculative_tokens)")
    drafter.set_defaults(runner=run_export)


def run_export(args: argparse.Namespace) -> int:
    if args.export != "drafter":
        raise AssertionError(f"unhandled export {args.export}")
    if args.step is not None and args.step < 0:
        raise SystemExit(f"tlt export: --step: must be >= 0, got {args.step}")
    if args.acceptance is not None and not args.acceptance >= 1.0:
        raise SystemExit(f"tlt export: --acceptance: an acceptance length is >= 1 (tokens a row "
                         f"emits per speculative step), got {args.acceptance}")
    if args.speculative_tokens < 1:
        raise SystemExit(f"tlt export: --speculative-tokens: must be >= 1, got "
                         f"{args.speculative_tokens}")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"tlt export: OUT: {args.out} exists and is not a folder")

    if args.run is not None and args.drafter is not None:
        raise SystemExit("tlt export: --run: give a run folder or --drafter, not both")
    run = _read_run(args.run) if args.run is not None else None  # before loading any model
    target, target_name = _target(args.target)
    if run is not None:
        drafter, drafter_name, step = _from_run(*run, target)
        target_name = f"{target_name} with the policy weights of {drafter_name}"
        args.step = step if args.step is None else args.step
    else:
        drafter, drafter_name = _drafter(args.drafter, target)
    problem = exportable(drafter)
    if problem is not None:
        flag = ("--run" if args.run is not None else "--drafter" if args.drafter is not None
                else "--drafter (default: the embedded drafter)")
        raise SystemExit(f"tlt export: {flag}: {drafter_name}: "
                         f"{problem.removeprefix('drafter: ')}")

    provenance = {"rl_step": args.step, "acceptance_length": args.acceptance,
                  "target_name_or_path": target_name, "drafter_source": drafter_name}
    if args.acceptance is not None:
        provenance["acceptance_source"] = "--acceptance"
    elif args.target is None:
        provenance["acceptance_length"], provenance["acceptance_source"] = \
            measure_acceptance(target, drafter)
    else:
        print("tlt export: no --acceptance given and no workload known for --target: "
              "acceptance_length is recorded as unknown", file=sys.stderr)
    folder = export_drafter(drafter, args.out, args.to, provenance,
                            speculative_tokens=args.speculative_tokens)
    acceptance = provenance["acceptance_length"]
    print(f"wrote {folder} ({args.to} layout): drafter {drafter_name}, target {target_name}, "
          f"RL step {'unknown' if args.step is None else args.step}, acceptance "
          f"{'unknown' if acceptance is None else f'{acceptance:.2f}'}")
    return 0


def measure_acceptance(target, drafter) -> tuple[float, str]:
    """(acceptance length, how it was measured): greedy rollouts of held-out embedded-task
    problems with a (6,1,7) chain strategy — a few seconds for the embedded model."""
    tokenizer = CharTokenizer()
    task = TaskConfig(seed=ACCEPTANCE_SEED, num_problems=ACCEPTANCE_PROBLEMS)
    max_tokens = 7 * task.max_steps + 16  # the longest reference response, and some room
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_ids=(tokenizer.eos_id,))
    requests = [Request(tokenizer.prompt_ids(p.prompt), params) for p in generate_problems(task)]
    max_len = max(len(r.prompt_ids) for r in requests) + max_tokens
    engine = RolloutEngine(target, EngineConfig(max_batch=len(requests), max_len=max_len), drafter)
    strategy = Strategy(6, 1, 7)
    result = engine.generate(requests, strategy=strategy)
    return result.acceptance_length, (f"measured at export: embedded task, {len(requests)} "
                                      f"problems (seed {ACCEPTANCE_SEED}), greedy, strategy "
                                      f"{strategy.key}")


def _target(path: Path | None):
    """(target, its name for the provenance)."""
    if path is None:
        workload = load_embedded(with_drafter=False)
        return workload.target, str(workload.target_folder)
    try:
        return load_checkpoint(path), str(path)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"tlt export: --target: {error}") from None


def _drafter(path: Path | None, target):
    """(drafter attached to target, its name for the provenance)."""
    flag = "--drafter"
    if path is None:  # the embedded drafter
        path = load_embedded().drafter_folder
        flag = "--drafter (default: the embedded drafter)"
    try:
        return Drafter.load(path, target).eval(), str(path)
    except FileNotFoundError as error:
        raise SystemExit(f"tlt export: {flag}: {error}") from None
    except ValueError as error:  # trained for a target of another shape
        raise SystemExit(f"tlt export: {flag}: {error}; is --target its target?") from None


def _read_run(folder: Path) -> tuple[Path, dict]:
    """(checkpoint path, its state) of a `tlt train` run folder, checked for a drafter."""
    path = folder / "checkpoint.pt" if folder.is_dir() else folder
    if not path.is_file():
        raise SystemExit(f"tlt export: --run: no checkpoint.pt in {folder}; is it a `tlt train` "
                         "--out folder?")
    try:
        state = read_checkpoint(path)
    except ValueError as error:
        raise SystemExit(f"tlt export: --run: {error}") from None
    if "drafter" not in state:
        raise SystemExit(f"tlt export: --run: {path} has no drafter (a run with --no-tlt, or "
                         "with a checkpoint and no --drafter, trains none)")
    return path, state


def _from_run(path: Path, state: dict, target):
    """(drafter, its name for the provenance, RL step) from a `tlt train` checkpoint; loads its
    policy weights into target (the policy the drafter was trained to draft for)."""
    try:
        target.load_state_dict(state["policy"])
    except RuntimeError as error:
        raise SystemExit(f"tlt export: --run: the run's policy does not fit --target's "
                         f"architecture ({str(error).splitlines()[0]}); give the checkpoint it "
                         "was trained from as --target") from None
    weights = state["drafter"]
    # The checkpoint holds the drafter's tensors, not its config: the form shows in them
    # (form "tlt" has the layer's input norm, several feature layers a fuse linear).
    if "fuse.weight" in weights:
        raise SystemExit("tlt export: --run: the run's drafter fuses several target layers "
                         "(EAGLE-3 style), which no EAGLE-1 layout represents")
    form = "tlt" if "layer.input_layernorm.weight" in weights else "eagle"
    drafter = Drafter(target, DrafterConfig(form=form))
    drafter.load_state_dict(weights)
    return drafter.eval(), f"{path} (step {state['step']})", int(state["step"])
