"""Command-line options of the `tlt` subcommands: flags derived from frozen config dataclasses,
the help formatter that shows every default, and a walk over the parser tree.

A dataclass field becomes the flag `--field-name` (dest `field_name`, so a config file uses the
field's own name), typed from its default or its annotation, with help text from a table the
caller owns (fields without an entry get no flag) and its default appended. A bool field that
defaults to True becomes `--no-field-name` (dest `field_name`), one that defaults to False
`--field-name`. `dataclass_from_args` builds the dataclass back and turns its `__post_init__`
errors ("name: must be ...") into errors that name the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Iterator, Mapping

_SCALARS = {"int": int, "float": float, "str": str, "Path": Path}


def flag_name(name: str, default: object = None) -> str:
    """The flag of a dataclass field: --name-with-dashes, or --no-name for a bool on by
    default."""
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if default is True else f"--{dashed}"


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type,
                            help_table: Mapping[str, str], *,
                            defaults: Mapping[str, object] | None = None,
                            choices: Mapping[str, tuple] | None = None) -> None:
    """One flag per field of `cls` named in `help_table`. defaults: per-field defaults that
    replace the dataclass's own (a command whose sensible default differs, e.g. greedy);
    choices: per-field allowed values (the flag then shows and checks them)."""
    for field in fields(cls):
        if field.name not in help_table:
            continue
        default = _default(field, defaults)
        text = help_table[field.name]
        if isinstance(default, bool):
            parser.add_argument(flag_name(field.name, default), dest=field.name,
                                action="store_false" if default else "store_true",
                                help=text + (" (default: on; this flag turns it off)" if default
                                             else " (default: off; this flag turns it on)"))
            continue
        kind = _field_type(cls, field, default)
        shown = "none" if default is None else default
        allowed = (choices or {}).get(field.name)
        metavar = ("|".join(allowed) if allowed else
                   kind.__name__.upper() if kind is not str else "TEXT")
        parser.add_argument(flag_name(field.name), dest=field.name, type=kind, default=default,
                            choices=allowed, metavar=metavar,
                            help=f"{text} (default: {shown})".replace("%", "%%"))


def dataclass_from_args(cls: type, args: argparse.Namespace, help_table: Mapping[str, str],
                        prog: str, **extra):
    """cls(**the flags' values, **extra); a ValueError naming a field ("lr: must be ...")
    becomes SystemExit naming its flag."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name in help_table}
    try:
        return cls(**values, **extra)
    except ValueError as error:
        name, sep, rest = str(error).partition(":")
        if sep and name in values:
            raise SystemExit(f"{prog}: {flag_name(name, _default_of(cls, name))}:{rest}") from None
        raise SystemExit(f"{prog}: {error}") from None


def _default(field, overrides: Mapping[str, object] | None) -> object:
    if overrides and field.name in overrides:
        return overrides[field.name]
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    raise TypeError(f"{field.name}: a derived flag needs a default (give one in defaults=)")


def _default_of(cls: type, name: str) -> object:
    field = next(f for f in fields(cls) if f.name == name)
    return field.default if field.default is not MISSING else None


def _field_type(cls: type, field, default: object) -> type:
    """int / float / str / Path, from the default or (default None) the annotation."""
    if default is not None and type(default) in _SCALARS.values():
        return type(default)
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    names = [part.strip() for part in annotation.replace("Optional[", "").rstrip("]").split("|")]
    kinds = [_SCALARS[n] for n in names if n in _SCALARS]
    if len(kinds) != 1:
        raise TypeError(f"{cls.__name__}.{field.name}: cannot derive a flag type from "
                        f"{annotation!r}")
    return kinds[0]


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
