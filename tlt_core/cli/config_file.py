"""Option values from a config file (`tlt SUBCOMMAND --config FILE`), for any subcommand.

A config file is a flat mapping from option names to values, TOML (`.toml`, read with the
standard library's tomllib) or YAML (`.yaml` / `.yml`, read with PyYAML, which is not a core
dependency). A key is the option's destination: the flag without its dashes, `-` and `_` alike
(`max_new_tokens = 128` for `--max-new-tokens 128`); a `--no-X` flag's key is `X` with a bool
(`tlt = false` for `--no-tlt`), another on/off flag's its own name (`compare = true`); a
repeatable flag takes a list (`prompt = ["a", "b"]`); a comma-separated one a list or the text.

Precedence: the command's defaults < the file < flags given on the command line. Unknown keys,
values of the wrong type and unreadable files are errors that name the key and the file; a
positional argument (an output path) is never read from a file.

Mechanism: the file's values become the chosen subcommand parser's defaults before argv is
parsed, so anything on the command line overrides them by argparse's own rules; a repeatable
flag's list is filled in after parsing when the command line gave none (argparse would append
the command line's items to a default list instead of replacing it).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any, Mapping

from tlt_core.cli.options import chosen_parser

TOML_SUFFIXES = (".toml",)
YAML_SUFFIXES = (".yaml", ".yml")


class ConfigError(ValueError):
    """A config file that cannot be used: the message names the file and, where one is to
    blame, the key."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, metavar="FILE",
        help="read option values from a TOML (.toml) or YAML (.yaml, .yml) file: keys are the "
             "option names with underscores (max_new_tokens = 128; --no-X flags as X = false); "
             "flags given on the command line override the file")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The file's top-level mapping, as parsed; ConfigError if it is missing, unreadable, in
    an unknown format or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    suffix = path.suffix.lower()
    if suffix in TOML_SUFFIXES:
        data = _read_toml(path)
    elif suffix in YAML_SUFFIXES:
        data = _read_yaml(path)
    else:
        raise ConfigError(f"{path}: unknown config format {suffix or '(no suffix)'!r}; use "
                          f"{', '.join(TOML_SUFFIXES + YAML_SUFFIXES)}")
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values at the top "
                          f"level, got {type(data).__name__}")
    return data


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11: the same parser as the tomli package
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading TOML needs Python >= 3.11 or the tomli package "
                              "(pip install tomli)") from None
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from None


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError(f"{path}: reading YAML needs PyYAML, which tlt_core does not install; "
                          "pip install pyyaml (or use a .toml file)") from None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from None


def option_values(parser: argparse.ArgumentParser, data: Mapping[str, Any], source: str | Path
                  ) -> dict[str, Any]:
    """{dest: value} for the file's entries, checked against the parser's options and converted
    as the command line would convert them; ConfigError naming the key and `source` otherwise."""
    actions = {a.dest: a for a in parser._actions if _settable(a)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(_unknown_key(parser, key, source, actions))
        if dest in values:
            raise ConfigError(f"{source}: key {key!r} is given twice (as '-' and '_' spellings)")
        values[dest] = _convert(action, value, key, source)
    return values


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None
               ) -> argparse.Namespace:
    """parser.parse_args(argv), with the --config file of the subcommand argv chooses (if it
    gives one) between the defaults and the command line. ConfigError for a bad file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    leaf = chosen_parser(parser, argv)
    path = _config_path(argv) if leaf is not None and _has_config(leaf) else None
    if path is None:
        return parser.parse_args(argv)
    values = option_values(leaf, load_config_file(path), path)
    actions = {a.dest: a for a in leaf._actions}
    appended = {}
    for dest, value in values.items():
        action = actions[dest]
        action.required = False  # given by the file; the command line may still override it
        if isinstance(action, argparse._AppendAction):
            appended[dest] = value
        else:
            leaf.set_defaults(**{dest: value})
    args = parser.parse_args(argv)
    if getattr(args, "config", None) != path:  # argparse read --config differently (abbreviated)
        raise ConfigError(f"{path}: --config was not understood as given; spell it out as "
                          "--config FILE")
    for dest, value in appended.items():
        if getattr(args, dest) is actions[dest].default:  # the command line gave none
            setattr(args, dest, value)
    return args


def _config_path(argv: list[str]) -> Path | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    return known.config


def _has_config(parser: argparse.ArgumentParser) -> bool:
    return "--config" in parser._option_string_actions


def _settable(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.dest not in ("help", "config") and not \
        isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                            argparse._SubParsersAction))


def _unknown_key(parser, key, source, actions) -> str:
    positional = [a.dest for a in parser._actions if not a.option_strings]
    if str(key).replace("-", "_") in positional:
        return (f"{source}: key {key!r} is a positional argument of `{parser.prog}`; give it on "
                "the command line")
    close = difflib.get_close_matches(str(key).replace("-", "_"), list(actions), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{source}: unknown key {key!r} for `{parser.prog}`{hint}; known keys: "
            f"{', '.join(sorted(actions))}")


def _wrong(source, key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{source}: key {key!r} must be {expected}, got {value!r} "
                       f"({type(value).__name__})")


def _convert(action: argparse.Action, value: Any, key: str, source) -> Any:
    """value as the action would hold it, or ConfigError naming key."""
    if action.nargs == 0:  # store_true / store_false / store_const: the dest's own value
        if not isinstance(value, bool):
            raise _wrong(source, key, "true or false", value)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return value
        if value is not True:
            raise _wrong(source, key, "true (this flag has no off form)", value)
        return action.const
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or \
            isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise _wrong(source, key, f"a list of {action.nargs} values", value)
        return [_convert_one(action, item, key, source) for item in items]
    return _convert_one(action, value, key, source)


def _convert_one(action: argparse.Action, value: Any, key: str, source) -> Any:
    kind = action.type
    if kind is None or kind is str:
        if not isinstance(value, str):
            raise _wrong(source, key, "a string", value)
        converted = value
    elif kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _wrong(source, key, "an integer", value)
        converted = value
    elif kind is float:
        number = value
        if isinstance(value, str):  # PyYAML reads 1e-5 (no dot, YAML 1.1) as a string
            try:
                number = float(value)
            except ValueError:
                raise _wrong(source, key, "a number", value) from None
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            raise _wrong(source, key, "a number", value)
        converted = float(number)
    else:  # Path, or a parser such as a comma-separated list: give it the command line's text
        text = value
        if isinstance(value, list) and all(isinstance(v, (int, float, str)) and
                                           not isinstance(v, bool) for v in value):
            text = ",".join(map(str, value))
        if not isinstance(text, str):
            raise _wrong(source, key, "a string", value)
        try:
            converted = kind(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            raise ConfigError(f"{source}: key {key!r}: {error}") from None
    if action.choices is not None and converted not in action.choices:
        raise _wrong(source, key, f"one of {', '.join(map(repr, action.choices))}", value)
    return converted
