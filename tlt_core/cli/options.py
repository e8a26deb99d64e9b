"""Command-line options of the `tlt` subcommands: flags derived from frozen config dataclasses,
the help formatter that shows every default, and a walk over the parser tree.

The derivation lives in tlt_core.config_flags (below every layer, so that each benchmark in
tlt_core.bench declares its own flags) and is re-exported here: a dataclass field becomes the
flag `--field-name` (dest `field_name`, so a config file uses the field's own name), its help
read from the field's metadata (`field(default=..., metadata={"help": "..."})`), or, for a
dataclass whose fields carry none, from a table the caller owns; fields with neither get no flag.
A bool field that defaults to True becomes `--no-field-name` (dest `field_name`), one that
defaults to False `--field-name`. `dataclass_from_args` builds the dataclass back and turns its
`__post_init__` errors ("name: must be ...") into errors that name the flag.
"""

from __future__ import annotations

import argparse
from typing import Iterator

from tlt_core.config_flags import (add_dataclass_arguments, dataclass_from_args, field_help,
                                   flag_name, int_list)

__all__ = ["HelpFormatter", "RawDescriptionHelpFormatter", "add_dataclass_arguments",
           "chosen_parser", "dataclass_from_args", "field_help", "flag_name", "int_list",
           "subcommand_help", "subparsers_action", "walk_parsers"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus "(default: X)" after every option whose help does not say its
    default already (None, False and store_true/store_false flags have none to show); lists
    are shown as the comma-separated text the flag takes."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or
                default is False or default is argparse.SUPPRESS or action.nargs == 0):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"  # help is %-formatted next


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that keeps the description's own line breaks (the top-level listing)."""


def subparsers_action(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    """The parser's subcommands, if it has any (argparse has no public accessor)."""
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{subcommand name: its help in the parser's listing} (argparse keeps them privately)."""
    action = subparsers_action(parser)
    if action is None:
        return {}
    return {choice.dest: choice.help or "" for choice in action._choices_actions}


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                 ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(subcommand path, parser) for the parser and every subcommand below it, depth first;
    aliases are visited once."""
    yield path, parser
    action = subparsers_action(parser)
    if action is None:
        return
    seen = set()
    for name, child in action.choices.items():
        if id(child) not in seen:
            seen.add(id(child))
            yield from walk_parsers(child, path + (name,))


def chosen_parser(parser: argparse.ArgumentParser, argv: list[str]
                  ) -> argparse.ArgumentParser | None:
    """The leaf parser argv selects (`tlt bench kernels ...` -> the kernels parser), or None
    where argv names no valid subcommand (parse_args then reports it). The parsers above a
    leaf take no option values, so the subcommand names are argv's first non-option tokens."""
    tokens = iter(argv)
    while True:
        action = subparsers_action(parser)
        if action is None:
            return parser
        name = next((t for t in tokens if not t.startswith("-")), None)
        if name not in action.choices:
            return None
        parser = action.choices[name]
