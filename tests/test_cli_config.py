"""The `tlt` command line: config files (TOML, YAML) between the defaults and the flags, errors
that name the key and the file, flags derived from the config dataclasses, complete help for
every subcommand, and every subcommand wired to its runner."""

import argparse
import sys

import pytest

from tlt_core.cli import build_parser, main
from tlt_core.cli.options import walk_parsers, subparsers_action
from tlt_core.cli.config_file import ConfigError, load_config_file, parse_args
from tlt_core.rl.driver import TrainConfig

TOML = """
steps = 3
lr = 1e-4
tlt = false
max-batch = 8          # '-' and '_' spell the same key
out = "runs/from-file"
compare = true
"""

YAML = """
steps: 3
lr: 1e-4               # PyYAML reads this as text (YAML 1.1): still a number here
tlt: false
max-batch: 8
out: runs/from-file
compare: true
"""


@pytest.fixture(params=["toml", "yaml"])
def config_file(request, tmp_path):
    if request.param == "yaml":
        pytest.importorskip("yaml")
    path = tmp_path / f"train.{request.param}"
    path.write_text(TOML if request.param == "toml" else YAML)
    return path


def parse(argv):
    return parse_args(build_parser(), argv)


def test_defaults_then_file_then_flags(config_file):
    defaults = parse(["train"])
    assert (defaults.steps, defaults.lr, defaults.tlt, defaults.max_batch) == \
        (TrainConfig().steps, TrainConfig().lr, True, TrainConfig().max_batch)
    from_file = parse(["train", "--config", str(config_file)])
    assert (from_file.steps, from_file.lr, from_file.tlt, from_file.max_batch,
            str(from_file.out), from_file.compare) == (3, 1e-4, False, 8, "runs/from-file", True)
    assert from_file.seed == TrainConfig().seed  # not in the file: the default
    flags = parse(["train", "--steps", "5", "--config", str(config_file), "--out", "elsewhere"])
    assert (flags.steps, str(flags.out), flags.lr) == (5, "elsewhere", 1e-4)


def test_on_off_flags_and_lists(tmp_path):
    on = tmp_path / "on.toml"
    on.write_text("tlt = true\nsuffix_drafts = false\n")
    args = parse(["train", "--config", str(on), "--no-tlt"])
    assert (args.tlt, args.suffix_drafts) == (False, False)  # the flag beats the file
    bench = tmp_path / "bench.toml"
    bench.write_text('batch = [1, 2]\nvocab = "100,200"\n')
    args = parse(["bench", "kernels", "--config", str(bench), "--nodes", "4"])
    assert (args.batch, args.vocab, args.nodes) == ((1, 2), (100, 200), (4,))
    prompts = tmp_path / "generate.toml"
    prompts.write_text('prompt = ["a", "b"]\n')
    assert parse(["generate", "--config", str(prompts)]).prompt == ["a", "b"]
    # a repeatable flag on the command line replaces the file's list, not extends it
    assert parse(["generate", "--config", str(prompts), "--prompt", "c"]).prompt == ["c"]


@pytest.mark.parametrize("text, key, expected", [
    ("stepz = 3\n", "stepz", "unknown key 'stepz' for `tlt train` (did you mean 'steps'?)"),
    ('steps = "many"\n', "steps", "must be an integer"),
    ("steps = 2.5\n", "steps", "must be an integer"),
    ("lr = true\n", "lr", "must be a number"),
    ("tlt = 1\n", "tlt", "must be true or false"),
    ("out = 3\n", "out", "must be a string"),
    ("tensorboard = \"maybe\"\n", "tensorboard", "must be one of 'auto', 'on', 'off'"),
    ("config = \"other.toml\"\n", "config", "unknown key 'config'"),
])
def test_bad_keys_are_named_with_the_file(tmp_path, capsys, text, key, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        parse(["train", "--config", str(path)])
    assert str(path) in str(error.value) and f"'{key}'" in str(error.value)
    assert expected in str(error.value)
    with pytest.raises(SystemExit) as exit_:  # through main: argparse's usage error, exit 2
        main(["train", "--config", str(path)])
    assert exit_.value.code == 2 and expected in capsys.readouterr().err


def test_unreadable_files_are_named(tmp_path, monkeypatch):
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = \n")
    with pytest.raises(ConfigError, match=f"{broken}: not valid TOML"):
        load_config_file(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.toml")
    odd = tmp_path / "train.ini"
    odd.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="unknown config format '.ini'"):
        load_config_file(odd)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(ConfigError, match="pip install pyyaml"):
        load_config_file(listed)
    monkeypatch.undo()
    pytest.importorskip("yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config_file(listed)


def test_positional_arguments_stay_on_the_command_line(tmp_path):
    path = tmp_path / "export.toml"
    path.write_text('out = "somewhere"\n')
    with pytest.raises(ConfigError, match="'out' is a positional argument"):
        parse(["export", "drafter", "x", "--config", str(path)])


def test_dataclass_errors_name_the_flag():
    with pytest.raises(SystemExit, match="tlt train: --lr: must be a finite number > 0"):
        main(["train", "--lr", "-1"])
    with pytest.raises(SystemExit, match="tlt train: --samples-per-prompt"):
        main(["train", "--samples-per-prompt", "1"])


def leaves():
    return [(path, parser) for path, parser in walk_parsers(build_parser())
            if path and subparsers_action(parser) is None]


def test_every_option_of_every_subcommand_is_explained_with_its_default():
    seen = 0
    for path, parser in leaves():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = f"tlt {' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{name}: no help"
            meaningful = action.default not in (None, False, argparse.SUPPRESS) and \
                action.nargs != 0 and action.option_strings
            if meaningful:
                assert "default" in formatter._expand_help(action), f"{name}: default not shown"
            seen += 1
        assert "--config" in parser._option_string_actions, path
        parser.format_help()  # renders (a % in a help text would raise here)
    assert seen > 80


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for path, _ in leaves():
        assert f"tlt {' '.join(path)} " in text
    for command in ("train", "bench", "export", "generate"):
        assert command in text


def test_export_is_wired():
    args = parse(["export", "drafter", "--to", "eagle", "out-folder"])
    assert (args.command, args.export, args.to, str(args.out)) == \
        ("export", "drafter", "eagle", "out-folder")


def test_every_leaf_has_a_runner():
    for path, parser in leaves():
        assert callable(parser.get_default("runner")), f"tlt {' '.join(path)}: no runner"


def test_flag_help_is_read_beside_the_field():
    """tlt_core.config_flags: a field's help is its metadata's; a field without help gets no
    flag; no default: a required flag."""
    from dataclasses import dataclass, field
    from tlt_core.config_flags import add_dataclass_arguments, int_list, option

    @dataclass(frozen=True)
    class Options:
        out: str = option("where it goes", metavar="DIR")
        beside: int = option("help beside the field", 3)
        sizes: tuple[int, ...] = option("sizes", (1, 2), parse=int_list)
        hidden: int = field(default=7)

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, Options)
    flags = parser._option_string_actions
    assert "--hidden" not in flags and flags["--out"].required
    assert flags["--beside"].help == "help beside the field (default: 3)"
    assert flags["--sizes"].help == "sizes (default: 1,2)"
    args = parser.parse_args(["--out", "x", "--sizes", "4,5"])
    assert (args.out, args.beside, args.sizes) == ("x", 3, (4, 5))


@pytest.mark.parametrize("command", ["train", "generate"])
def test_every_config_field_of_train_and_generate_is_a_flag_with_its_help(command):
    """The help is written once, beside the field; the parser has a flag for every field."""
    from dataclasses import fields

    from tlt_core.cli.generate import GenerateConfig
    from tlt_core.cli.main import build_parser
    from tlt_core.config_flags import flag_name
    from tlt_core.rl.config import TrainConfig

    cls = {"train": TrainConfig, "generate": GenerateConfig}[command]
    commands = next(a for a in build_parser()._actions if a.choices and command in a.choices)
    flags = commands.choices[command]._option_string_actions
    for field in fields(cls):
        help_text = field.metadata.get("help")
        assert help_text, f"{cls.__name__}.{field.name}: no help"
        flag = flags[flag_name(field.name, field.default)]
        assert flag.dest == field.name and flag.help.startswith(help_text.replace("%", "%%"))
