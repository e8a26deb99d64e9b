"""`tlt export drafter --to {eagle,eagle3,speculators} OUT`: a drafter in a serving engine's
layout; `tlt export policy --run DIR OUT`: a `tlt train` run's policy as a Hugging Face folder.

drafter: writes OUT with provenance (the target's weights hash, the RL step, the acceptance
length at export, the tlt_core version and the date; tlt_core.drafting.export): a tlt_core
drafter trained with DrafterConfig(form="eagle") in the EAGLE-1 layout SGLang and vLLM serve
(`--to eagle`; a reduced draft vocabulary adds SGLang's token map), an EAGLE-3 drafter in the
SGLang/vLLM/SpecForge layout (`--to eagle3`) or speculators' (`--to speculators`). Any other
drafter or pairing is refused with the reason.

Inputs: --drafter DIR (any folder `--drafter` flags read: Drafter.save's, an export, a published
EAGLE-1/2 or EAGLE-3 checkpoint; default: the embedded drafter) and
--target DIR (a local Hugging Face checkpoint; default: the embedded model); or --run DIR, a
`tlt train` run folder: the drafter RL spot-trained, as of its newest checkpoint
(DIR/checkpoints/step-NNNNNN, or a checkpoint folder given directly), drafting for the policy of
that step (the checkpoint's policy weights in --target's architecture; the provenance hashes
those weights and records the checkpoint's step). The acceptance length is --acceptance, or,
for the embedded architecture, measured here in a few seconds: greedy rollouts of 16 held-out
embedded-task problems with a (6,1,7) chain strategy.

policy: the policy after step N (--step; default: the newest step saved) as a folder
transformers loads (tlt_core.outputs.policy_folder): a copy of the run's policy/step-NNNNNN when
`tlt train` wrote it, else rebuilt from checkpoints/step-NNNNNN (the checkpoint records the
policy's architecture; the tokenizer comes from the run's tokenizer/ folder). OUT is replaced
only if it is an earlier export (it holds tlt_policy.json) or empty.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import EXPORT_FORMATS, export_drafter, exportable, load_drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.embedded.workload import load_embedded
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.tokenizer import CheckpointTokenizer
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.outputs.policy_folder import POLICY_RECORD, SpecialTokenIds, write_policy_folder
from tlt_core.outputs.run_folder import CHECKPOINTS_DIR, OLD_CHECKPOINT, POLICY_DIR, TOKENIZER_DIR
from tlt_core.persistence.checkpoint_io import (STATE_FILE, atomic_folder, latest_checkpoint,
                                                read_state, step_folders)

ACCEPTANCE_PROBLEMS, ACCEPTANCE_SEED = 16, 4242  # held out: training and benches use others

logger = logging.getLogger(__name__)


def add_parsers(commands) -> None:
    export = commands.add_parser(
        "export",
        help="a trained drafter (EAGLE, EAGLE-3, speculators) or policy (Hugging Face) to serve",
        description="Exports artifacts for serving engines: `tlt export drafter --to "
                    "{eagle,eagle3,speculators} OUT` writes a drafter in the EAGLE-1 or EAGLE-3 "
                    "layout SGLang and vLLM load or in speculators', with provenance; `tlt "
                    "export policy --run DIR OUT` "
                    "writes a `tlt train` run's policy as a Hugging Face folder.")
    add_arguments(export)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `export` command's arguments: its subcommands, `drafter` and `policy`."""
    kinds = parser.add_subparsers(dest="export", required=True, metavar="WHAT")
    drafter = kinds.add_parser(
        "drafter", help="a drafter in the EAGLE-1, EAGLE-3 or speculators layout",
        description="Writes a drafter trained with DrafterConfig(form='eagle') as an EAGLE-1 "
                    "checkpoint SGLang and vLLM serve (--to eagle: LlamaForCausalLMEagle / "
                    "EagleLlamaForCausalLM; a reduced draft vocabulary adds "
                    "speculative_token_map.pt for SGLang's --speculative-token-map), or an "
                    "EAGLE-3 drafter as LlamaForCausalLMEagle3 (--to eagle3) or in speculators "
                    "0.9.0's eagle3 format (--to speculators), with provenance (target weights "
                    "hash, RL step, acceptance length, tlt_core version, date). See "
                    "docs/export.md for the layouts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    drafter.add_argument("out", type=Path, metavar="OUT", help="folder to write")
    drafter.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="the layout")
    drafter.add_argument("--drafter", type=Path, metavar="DIR",
                         help="a drafter folder: Drafter.save's, an export, or a published "
                              "EAGLE-1/2 or EAGLE-3 checkpoint (default: the embedded drafter)")
    drafter.add_argument("--target", type=Path, metavar="DIR",
                         help="the drafter's target, a local Hugging Face checkpoint folder "
                              "(default: the embedded model)")
    drafter.add_argument("--run", type=Path, metavar="DIR",
                         help="a `tlt train` run folder: export the drafter of its newest "
                              "checkpoint (or of a checkpoint folder given directly), for the "
                              "policy of that step (instead of --drafter; --target gives the "
                              "architecture)")
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
    policy = kinds.add_parser(
        "policy", help="a `tlt train` run's policy as a Hugging Face folder transformers loads",
        description="Writes the policy of a `tlt train` run after a step as a Hugging Face "
                    "folder (config.json, model.safetensors, generation_config.json, the "
                    "tokenizer, tlt_policy.json) that transformers loads: the run's "
                    "policy/step-NNNNNN copied, or rebuilt from its checkpoints/step-NNNNNN.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    policy.add_argument("out", type=Path, metavar="OUT", help="folder to write")
    policy.add_argument("--run", type=Path, required=True, metavar="DIR",
                        help="the `tlt train` run folder (its --out)")
    policy.add_argument("--step", type=int, metavar="N",
                        help="the policy after N steps (default: the newest step the run saved, "
                             "as a policy folder or a checkpoint)")
    policy.set_defaults(runner=run_export_policy)


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
    problem = exportable(drafter, args.to)
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
        logger.warning("tlt export: no --acceptance given and no workload known for --target: "
                       "acceptance_length is recorded as unknown")
    folder = export_drafter(drafter, args.out, args.to, provenance,
                            speculative_tokens=args.speculative_tokens)
    acceptance = provenance["acceptance_length"]
    logger.info("wrote %s (%s layout): drafter %s, target %s, RL step %s, acceptance %s", folder,
                args.to, drafter_name, target_name, "unknown" if args.step is None else args.step,
                "unknown" if acceptance is None else f"{acceptance:.2f}")
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
        return load_drafter(path, target).eval(), str(path)
    except FileNotFoundError as error:
        raise SystemExit(f"tlt export: {flag}: {error}") from None
    except ValueError as error:  # trained for a target of another shape
        raise SystemExit(f"tlt export: {flag}: {error}; is --target its target?") from None


def _read_run(folder: Path) -> tuple[Path, dict]:
    """(checkpoint folder, its state): a `tlt train` run folder's newest checkpoint, or a
    checkpoint folder given directly; checked for a drafter."""
    if folder.is_file() or (folder / STATE_FILE).is_file():
        path = folder  # read_state refuses an older version's single file, saying so
    else:
        path = latest_checkpoint(folder / CHECKPOINTS_DIR)
        if path is None and (folder / OLD_CHECKPOINT).is_file():
            raise _older_run("--run", folder / OLD_CHECKPOINT)
        if path is None:
            raise SystemExit(f"tlt export: --run: no checkpoint in {folder} (none in "
                             f"{CHECKPOINTS_DIR}/); is it a `tlt train` --out folder?")
    try:
        state = read_state(path)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"tlt export: --run: {error}") from None
    if "drafter" not in state:
        raise SystemExit(f"tlt export: --run: {path} has no drafter (a run with --no-tlt, or "
                         "with a checkpoint and no --drafter, trains none)")
    return path, state


def _older_run(flag: str, path: Path) -> SystemExit:
    return SystemExit(f"tlt export: {flag}: {path} was written by an older tlt_core, whose "
                      "checkpoints this version does not read; start a new run")


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
    if any(name.startswith("midlayer.") for name in weights):  # an imported EAGLE-3 drafter
        raise SystemExit("tlt export: --run: the run drafted with an EAGLE-3 drafter, which it "
                         "does not train: export the folder it was given (--drafter DIR)")
    # The checkpoint holds the drafter's tensors, not its config: the form shows in them
    # (form "tlt" has the layer's input norm, several feature layers a fuse linear).
    if "fuse.weight" in weights:
        raise SystemExit("tlt export: --run: the run's drafter fuses several target layers "
                         "(EAGLE-3 style), which no EAGLE-1 layout represents")
    form = "tlt" if "layer.input_layernorm.weight" in weights else "eagle"
    drafter = Drafter(target, DrafterConfig(form=form))
    drafter.load_state_dict(weights)
    return drafter.eval(), f"{path} (step {state['step']})", int(state["step"])


# ---- tlt export policy -------------------------------------------------------------------------

def run_export_policy(args: argparse.Namespace) -> int:
    if args.step is not None and args.step < 0:
        raise SystemExit(f"tlt export: --step: must be >= 0, got {args.step}")
    out = args.out
    if out.exists() and not (out.is_dir() and (not any(out.iterdir())
                                               or (out / POLICY_RECORD).is_file())):
        raise SystemExit(f"tlt export: OUT: {out} exists and is neither empty nor an exported "
                         f"policy folder (with {POLICY_RECORD}); give a new folder")
    run = args.run
    if not run.is_dir():
        raise SystemExit(f"tlt export: --run: {run} is not a folder; give a `tlt train` --out "
                         "folder")
    policies = step_folders(run / POLICY_DIR, marker=POLICY_RECORD)
    checkpoints = step_folders(run / CHECKPOINTS_DIR)
    if not policies and not checkpoints:
        if (run / OLD_CHECKPOINT).is_file():
            raise _older_run("--run", run / OLD_CHECKPOINT)
        raise SystemExit(f"tlt export: --run: {run} has no policy folders ({POLICY_DIR}/) and no "
                         f"checkpoints ({CHECKPOINTS_DIR}/); is it a `tlt train` --out folder?")
    step = max(policies.keys() | checkpoints.keys()) if args.step is None else args.step
    if step not in policies and step not in checkpoints:
        raise SystemExit(f"tlt export: --step: {run} holds no step {step}: policy folders of "
                         f"steps {sorted(policies) or 'none'}, checkpoints of steps "
                         f"{sorted(checkpoints) or 'none'}")
    try:  # OUT is replaced atomically: a failed write leaves it as it was
        if step in policies:
            source = policies[step]
            with atomic_folder(out) as temporary:
                shutil.copytree(source, temporary, dirs_exist_ok=True)
        else:
            source = checkpoints[step]
            _policy_from_checkpoint(source, run, out, step)
    except OSError as error:  # disk full, no permission: it names the path
        raise SystemExit(f"tlt export: OUT: {error}") from None
    logger.info("wrote %s: the policy of %s after step %s (from %s)", out, run, step, source)
    return 0


def _policy_from_checkpoint(checkpoint: Path, run: Path, out: Path, step: int) -> None:
    """Writes the policy folder of a resume checkpoint: its tensors in the architecture it
    records, with the run's tokenizer (or, without one, the ids that ended responses)."""
    try:
        state = read_state(checkpoint)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"tlt export: --run: {error}") from None
    if state.get("model_config") is None:
        raise SystemExit(f"tlt export: --run: {checkpoint} records no model architecture (its "
                         "policy is not a tlt_core Transformer)")
    policy = Transformer(ModelConfig.from_hf_config(state["model_config"]))
    policy.load_state_dict(state["policy"], assign=True)  # the tensors as saved, dtype included
    policy.tie_weights()
    tokenizer, token_ids = None, SpecialTokenIds(eos=tuple(state["stop_ids"]))
    if (run / TOKENIZER_DIR).is_dir():
        tokenizer, token_ids = CheckpointTokenizer(run / TOKENIZER_DIR), None
    write_policy_folder(policy, out, tokenizer=tokenizer, step=step, token_ids=token_ids)
