"""Command-line flags derived from frozen config dataclasses, the help beside each field.

A field whose metadata has "help" becomes the flag `--field-name` (dest `field_name`, so a config file
uses the field's own name), typed from its default or its annotation, with its default appended
to the help unless the help says it. A bool field that defaults to True becomes
`--no-field-name` (dest `field_name`), one that defaults to False `--field-name`; a field with no
default is a required flag. `dataclass_from_args` builds the dataclass back and turns its
`__post_init__` errors ("name: must be ...") into errors that name the flag.

Field metadata the flags read (all optional but "help"):
- help: what the option does (the one place it is written);
- metavar: the value's placeholder (FILE, DIR, N); default: the type's name, or the choices;
- choices: the allowed values;
- parse: the function that turns the command line's text into the value (e.g. `int_list`),
  where the annotation alone does not say it;
- repeatable: True for a flag given once per item (the value is then a list).

Standard library only, below every layer: the benchmarks (tlt_core.bench) declare their flags
here and the command line (tlt_core.cli) uses the same functions.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Mapping

_SCALARS = {"int": int, "float": float, "str": str, "Path": Path}


def flag_name(name: str, default: object = None) -> str:
    """The flag of a dataclass field: --name-with-dashes, or --no-name for a bool on by
    default."""
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if default is True else f"--{dashed}"


def option(help: str, default: object = MISSING, **metadata):
    """A config field with its flag's help beside it (and metavar, choices, parse or repeatable
    where the default does not say them); no default: a required flag."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def int_list(text: str) -> tuple[int, ...]:
    """The value of a comma-separated integer flag (`--batch 1,4,16`)."""
    try:
        return tuple(int(part) for part in text.split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def field_help(field) -> str | None:
    """The field's help, from its metadata; None: the field has no flag."""
    return field.metadata.get("help")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *,
                            defaults: Mapping[str, object] | None = None,
                            choices: Mapping[str, tuple] | None = None) -> None:
    """One flag per field of `cls` that has help (field_help). defaults: per-field defaults
    that replace the dataclass's own (a command whose sensible default differs, e.g. greedy);
    choices: per-field allowed values beside the metadata's (the flag then shows and checks
    them)."""
    for field in fields(cls):
        text = field_help(field)
        if text is None:
            continue
        default = _default(field, defaults)
        if isinstance(default, bool):
            parser.add_argument(flag_name(field.name, default), dest=field.name,
                                action="store_false" if default else "store_true",
                                help=text + (" (default: on; this flag turns it off)" if default
                                             else " (default: off; this flag turns it on)"))
            continue
        kind = field.metadata.get("parse") or _field_type(cls, field, default)
        allowed = (choices or {}).get(field.name) or field.metadata.get("choices")
        metavar = field.metadata.get("metavar") or (
            "|".join(allowed) if allowed else
            kind.__name__.upper() if kind is not str else "TEXT")
        required = default is MISSING
        extra = {"action": "append"} if field.metadata.get("repeatable") else {}
        parser.add_argument(flag_name(field.name), dest=field.name, type=kind,
                            default=None if required else default, required=required,
                            choices=allowed, metavar=metavar,
                            help=_with_default(text, default).replace("%", "%%"), **extra)


def dataclass_from_args(cls: type, args: argparse.Namespace, prog: str, **extra):
    """cls(**the flags' values, **extra); a ValueError naming a field ("lr: must be ...")
    becomes SystemExit naming its flag."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)
              if field_help(f) is not None}
    try:
        return cls(**values, **extra)
    except ValueError as error:
        name, sep, rest = str(error).partition(":")
        if sep and name in values:
            raise SystemExit(f"{prog}: {flag_name(name, _default_of(cls, name))}:{rest}") from None
        raise SystemExit(f"{prog}: {error}") from None


def _with_default(text: str, default: object) -> str:
    """The help with "(default: X)" appended, unless it says its default already or there is
    none (a required flag)."""
    if default is MISSING or "default" in text:
        return text
    if default is None:
        shown = "none"
    elif isinstance(default, (list, tuple)):
        shown = ",".join(map(str, default))
    else:
        shown = default
    return f"{text} (default: {shown})"


def _default(field, overrides: Mapping[str, object] | None) -> object:
    """The flag's default; MISSING for a field without one (a required flag)."""
    if overrides and field.name in overrides:
        return overrides[field.name]
    if field.default_factory is not MISSING:
        return field.default_factory()
    return field.default


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
                        f"{annotation!r} (give metadata 'parse')")
    return kinds[0]
