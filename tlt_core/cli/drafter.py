"""`tlt drafter train --model DIR --data FILE --out DIR`: an EAGLE drafter for any local
checkpoint, trained offline on the model's own responses (tlt_core.warmup.offline), ready for
every `--drafter` flag.

The prompts go through the same prompt format `tlt train` uses (chat template, system prompt),
the responses are sampled with the RL settings (temperature, max tokens, stop at the model's
end-of-turn ids unless --ignore-eos), and the last `--held-out` prompts measure the drafter's
acceptance length at the end, greedy and at temperature 1. Interrupted runs resume from
OUT/work/ when run again with the same flags.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tlt_core.cli.model_options import (add_placement_arguments, add_prompt_arguments,
                                        placement_from_args)
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.prompt_format import load_prompt_format
from tlt_core.tasks.data import load_prompts
from tlt_core.warmup.config import MATMUL_DTYPES, OfflineConfig
from tlt_core.warmup.offline import train_offline

logger = logging.getLogger(__name__)

DEFAULTS = OfflineConfig()


def add_parsers(commands) -> None:
    drafter = commands.add_parser(
        "drafter", help="drafters for any checkpoint: train one offline",
        description="EAGLE drafters for local Hugging Face checkpoints.")
    kinds = drafter.add_subparsers(dest="drafter_command", required=True, metavar="WHAT")
    train = kinds.add_parser(
        "train", help="train a drafter on the model's own responses (EAGLE warm-up)",
        description="The model answers the prompts of --data (chat template, sampling as in "
                    "RL), the hidden states of those very passes are kept, and a one-layer "
                    "EAGLE drafter sharing the model's embedding and LM head learns to predict "
                    "them, over every response position, unrolled over --unroll drafting "
                    "steps. OUT then holds the drafter (--drafter OUT everywhere) with its "
                    "held-out acceptance length (T = 0 and T = 1) in drafter_config.json, and "
                    "OUT/work/ the responses and checkpoints a resumed run reuses. The "
                    "defaults train a useful drafter for SmolLM2-135M-Instruct on 512 prompts "
                    "in about 20 minutes on 2 CPU cores.")
    train.add_argument("--model", type=Path, metavar="DIR", required=True,
                       help="a local Hugging Face checkpoint folder")
    train.add_argument("--data", type=Path, metavar="FILE", required=True,
                       help="prompts: JSONL, Parquet, CSV or JSON, or a datasets folder (e.g. "
                            "`tlt data arithmetic FILE`); answers are not needed")
    train.add_argument("--out", type=Path, metavar="DIR", required=True,
                       help="the drafter folder to write")
    train.add_argument("--prompts", type=int, metavar="N",
                       help="use the first N prompts of --data (default: all)")
    train.add_argument("--prompt-field", metavar="PATH",
                       help="the data's prompt field, dotted for a nested one (default: the "
                            "first of prompt, question, problem, messages it has)")
    train.add_argument("--split", metavar="NAME", help="the split of a datasets folder")
    train.add_argument("--draft-vocab", type=int, default=DEFAULTS.draft_vocab, metavar="V",
                       help="the drafter's head covers the V token ids the responses use most "
                            "(EAGLE-3's reduced vocabulary: each drafting level's LM head "
                            "costs V/vocab); 0: the whole vocabulary")
    train.add_argument("--held-out", type=int, default=DEFAULTS.held_out, metavar="N",
                       help="the last N prompts are not trained on; the acceptance length is "
                            "measured on them")
    train.add_argument("--temperature", type=float, default=DEFAULTS.temperature,
                       help="sampling temperature of the responses (RL's)")
    train.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens,
                       help="longest response")
    train.add_argument("--samples", type=int, default=DEFAULTS.samples_per_prompt, metavar="N",
                       help="responses per prompt")
    train.add_argument("--ignore-eos", action="store_true",
                       help="responses run to --max-tokens past the model's end of turn, as a "
                            "benchmark with vLLM's --ignore-eos decodes them: a drafter for that "
                            "text; the held-out acceptance is measured on such responses too")
    train.add_argument("--rollout-batch", type=int, default=DEFAULTS.rollout_batch,
                       metavar="N", help="rows the engine decodes at once")
    train.add_argument("--steps", type=int, default=DEFAULTS.steps,
                       help="optimizer steps (a resumed run may ask for more)")
    train.add_argument("--batch-tokens", type=int, default=DEFAULTS.batch_tokens, metavar="N",
                       help="padded positions per training batch")
    train.add_argument("--lr", type=float, default=DEFAULTS.lr,
                       help="peak learning rate (linear warm-up, cosine to a tenth)")
    train.add_argument("--unroll", type=int, default=DEFAULTS.unroll, metavar="N",
                       help="drafting steps each position trains on (EAGLE-3's training-time "
                            "test): step k drafts from the drafter's own output of step k - 1, "
                            "as drafting levels >= 2 do; 1 is teacher-forced EAGLE alone. A "
                            "training step costs about N teacher-forced ones")
    train.add_argument("--rejection-weight", type=float, default=DEFAULTS.rejection_weight,
                       metavar="W",
                       help="weight of the loss term that is the probability a token sampled "
                            "from the drafter is rejected at T = 1 (RL's sampled drafting), "
                            "beside EAGLE's feature regression and cross-entropy; 0: EAGLE's "
                            "loss alone")
    train.add_argument("--regression-weight", type=float, default=DEFAULTS.regression_weight,
                       metavar="W",
                       help="weight of EAGLE's feature-regression term (the drafter's output "
                            "against the target's last layer); 0 trains on tokens alone, as "
                            "EAGLE-3 trains a drafter on several --feature-layers")
    train.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=DEFAULTS.matmul_dtype,
                       help="dtype of the training's matmuls; the weights and the optimizer "
                            "stay float32. auto: bfloat16 for a bf16 target (a step 1.5x "
                            "faster on CPUs with bf16 instructions), else float32")
    train.add_argument("--feature-layers", default="-1", metavar="I,J,K",
                       help="target layers the drafter reads: -1 is EAGLE-1/2's last layer; "
                            "several (e.g. 2,15,27) fuse them, EAGLE-3 style")
    train.add_argument("--seed", type=int, default=DEFAULTS.seed, help="sampling and data order")
    train.add_argument("--show-prompt", action="store_true",
                       help="print the first prompt as the model sees it (the chat template "
                            "applied) and stop")
    add_placement_arguments(train)
    add_prompt_arguments(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(runner=run_train)


def run_train(args: argparse.Namespace) -> int:
    command = "tlt drafter train"
    try:
        layers = tuple(int(part) for part in args.feature_layers.split(",") if part.strip())
        config = OfflineConfig(
            temperature=args.temperature, max_tokens=args.max_tokens,
            samples_per_prompt=args.samples, ignore_eos=args.ignore_eos,
            rollout_batch=args.rollout_batch,
            held_out=args.held_out, feature_layers=layers,
            form="eagle" if layers == (-1,) else "tlt",
            draft_vocab=args.draft_vocab or None, steps=args.steps,
            batch_tokens=args.batch_tokens, lr=args.lr, unroll=args.unroll,
            rejection_weight=args.rejection_weight, regression_weight=args.regression_weight,
            matmul_dtype=args.matmul_dtype, seed=args.seed)
    except ValueError as error:
        raise SystemExit(f"{command}: --{str(error).replace('_', '-', 1)}") from None
    if args.prompts is not None and args.prompts < 1:
        raise SystemExit(f"{command}: --prompts must be >= 1, got {args.prompts}")
    placement = placement_from_args(args, command, embedded=False)
    try:
        prompt_format = load_prompt_format(args.model, args.chat_template, args.system_prompt)
        data = load_prompts(args.data, prompt_key=args.prompt_field, split=args.split,
                            require_answers=False)
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise SystemExit(f"{command}: {error}") from None
    examples = data.examples[:args.prompts]
    prompts = [prompt_format.encode(list(e.messages) if e.messages else e.prompt)
               for e in examples]
    tokenizer = prompt_format.tokenizer
    if args.show_prompt:
        print(tokenizer.decode(prompts[0]))
        return 0
    logger.info("%s: %d prompts from %s (%s), %d to train on, %d held out", command,
                len(prompts), args.data, prompt_format.describe(),
                len(prompts) - config.held_out, config.held_out)
    try:
        target = load_checkpoint(args.model, dtype=placement.dtype, device=placement.device)
        report = train_offline(
            target, prompts, args.out, config, stop_ids=tuple(tokenizer.eos_ids),
            metadata={"target": str(args.model), "data": str(args.data),
                      "prompt_format": prompt_format.describe(),
                      "dtype": str(placement.dtype).removeprefix("torch.")},
            progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"{command}: {error}") from None
    acceptance = "; ".join(
        f"T = {setting.removeprefix('t')}: " + ", ".join(
            f"{plan} {value:.2f}" for plan, value in plans.items() if value is not None)
        for setting, plans in report.held_out_acceptance.items())
    deeper = "".join(f", step {key.removeprefix('top1_step')} {value:.3f}"
                     for key, value in report.final_top1_by_step.items())
    sampled = "".join(f", step {key.removeprefix('accept_step')} {value:.3f}"
                      for key, value in report.final_accept_by_step.items())
    print(f"drafter: {report.folder} ({report.sequences} responses, {report.response_tokens} "
          f"tokens; {report.steps} steps, loss {report.final_loss:.3f}, top-1 "
          f"{report.final_top1:.3f}{deeper}, sampled acceptance {report.final_accept:.3f}"
          f"{sampled}); held-out acceptance length {acceptance}; "
          + ", ".join(f"{phase} {s:.0f} s" for phase, s in report.seconds.items()))
    return 0
