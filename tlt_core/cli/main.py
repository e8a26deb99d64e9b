"""The `tlt` command: the parser tree and the dispatch.

Each subcommand module (`train`, `generate`, `drafter`, `convert`, `data`, `export`,
`bench`, `demo`) adds its parsers with `add_parsers(commands)` and sets each leaf's runner
(`set_defaults(runner=...)`); `main` parses (defaults < `--config FILE` < flags,
tlt_core.cli.config_file) and calls the runner.
Every leaf takes `--config FILE` and the logging flags (-v, -q, --log-level; tlt_core.cli.logs,
which `main` configures before the runner starts), and every option's help gives its default
(tlt_core.cli.options.HelpFormatter). docs/cli.md has the details.
"""

from __future__ import annotations

import argparse
import os
import sys

from tlt_core.cli import bench, convert, data, demo, drafter, export, generate, train
from tlt_core.cli.config_file import ConfigError, add_config_argument, parse_args
from tlt_core.cli.logs import add_logging_arguments, chosen_level, configure_logging
from tlt_core.cli.options import (HelpFormatter, RawDescriptionHelpFormatter, chosen_parser,
                                  subcommand_help, subparsers_action, walk_parsers)

# in the order `tlt --help` lists them
COMMANDS = (train, generate, drafter, convert, data, export, bench, demo)


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree: every subcommand leaf gets --config FILE, every parser the
    formatter that shows defaults, and `tlt --help` lists every leaf."""
    parser = argparse.ArgumentParser(
        prog="tlt", description="tlt_core: fused tree speculative decoding for RL rollouts.",
        formatter_class=RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parsers(commands)
    leaves, helps = [], {}
    for path, each in walk_parsers(parser):
        each.formatter_class = RawDescriptionHelpFormatter if not path else HelpFormatter
        helps.update({path + (name,): text for name, text in subcommand_help(each).items()})
        if path and subparsers_action(each) is None:
            leaves.append(path)
            if "--config" not in each._option_string_actions:
                add_config_argument(each)
            add_logging_arguments(each)
    width = max(len(" ".join(path)) for path in leaves) + 6
    parser.epilog = "commands (tlt COMMAND --help for each one's options):\n" + "\n".join(
        f"  {'tlt ' + ' '.join(path):<{width}}{helps.get(path, '')}" for path in leaves)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`tlt ARGV`: parses (defaults < --config file < flags) and runs the subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    leaf = chosen_parser(parser, argv)
    try:
        args = parse_args(parser, argv)
    except ConfigError as error:
        (leaf or parser).error(str(error))
    try:
        level = chosen_level(args.log_level)
    except ValueError as error:  # it names TLT_LOG_LEVEL
        (leaf or parser).error(str(error))
    # a rank that torchrun started logs warnings only, unless it is rank 0 (tlt_core.cli.logs)
    configure_logging(level, rank=int(os.environ.get("RANK", "0")))
    return args.runner(args)
