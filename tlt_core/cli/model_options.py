"""The options every `tlt` command that loads a model shares, and the one way they are read:
`--device`, `--dtype` (tlt_core.model.placement), `--chat-template`, `--system-prompt`
(tlt_core.model.prompt_format).
"""

from __future__ import annotations

import argparse
import logging

from tlt_core.model.placement import DEVICES, DTYPES, Placement, resolve_placement
from tlt_core.model.prompt_format import CHAT_TEMPLATE_HELP

logger = logging.getLogger(__name__)

EMBEDDED_DTYPE_WHY = "auto: the embedded model runs in float32 (its small matrices gain " \
                     "nothing from bf16)"


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs: auto is CUDA when torch sees a GPU (each "
                             "torchrun rank its LOCAL_RANK), else the CPU")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="weights' dtype: auto is bfloat16 on CUDA and on CPUs with native "
                             "bf16 (AMX/AVX512-BF16), else float32; the embedded model stays "
                             "float32")


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default="auto", metavar="auto|none|FILE",
                        help=CHAT_TEMPLATE_HELP + " (with --model)")
    parser.add_argument("--system-prompt", metavar="TEXT",
                        help="a system message before each prompt (with a chat template)")


def placement_from_args(args: argparse.Namespace, command: str, *, embedded: bool) -> Placement:
    """The placement the flags ask for, logged (info); errors name the flag."""
    dtype = "float32" if embedded and args.dtype == "auto" else args.dtype
    try:
        placement = resolve_placement(args.device, dtype)
    except ValueError as error:
        raise SystemExit(f"{command}: --{error}") from None
    if embedded and args.dtype == "auto":
        placement = Placement(placement.device, placement.dtype, EMBEDDED_DTYPE_WHY)
    logger.info("%s: %s", command, placement.describe())
    return placement
