"""`tlt data arithmetic OUT`: the project's own GSM8K-style arithmetic word problems as JSON
Lines (tlt_core.tasks.arithmetic_problems), for `tlt train --model DIR --data OUT` without any
download: "question" is the prompt, "answer" a worked solution ending in `#### N`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tlt_core.tasks.arithmetic_problems import generate_problems, write_jsonl

logger = logging.getLogger(__name__)


def add_parsers(commands) -> None:
    data = commands.add_parser(
        "data", help="training data the project generates itself (no downloads)",
        description="Writes data sets the project generates deterministically.")
    kinds = data.add_subparsers(dest="data", required=True, metavar="WHAT")
    arithmetic = kinds.add_parser(
        "arithmetic", help="GSM8K-style arithmetic word problems as JSON Lines",
        description="GSM8K-style word problems (1-3 steps of +, -, *, exact division on small "
                    "integers; GSM8K's fields: question, and an answer ending '#### N'), the "
                    "same rows for the same --n and --seed on every machine.")
    arithmetic.add_argument("out", type=Path, metavar="OUT", help="the .jsonl file to write")
    arithmetic.add_argument("--n", type=int, default=256, help="number of problems")
    arithmetic.add_argument("--seed", type=int, default=0, help="which problems")
    arithmetic.set_defaults(runner=run_arithmetic)


def run_arithmetic(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise SystemExit(f"tlt data arithmetic: --n must be >= 1, got {args.n}")
    write_jsonl(args.out, generate_problems(args.n, seed=args.seed))
    logger.info("wrote %d problems (seed %d) to %s", args.n, args.seed, args.out)
    return 0
