"""`tlt bench NAME` and `tlt task lengths`: every option is a field of the benchmark's options
dataclass, with its help beside it. For each registered subcommand, each field of each dataclass
in its module's CLI_OPTIONS maps to its flag (same dest, same default) with non-empty help, and
the parser has no flag that is not such a field (no help written anywhere else)."""

import argparse
import sys
from dataclasses import MISSING, fields

import pytest

from tlt_core.cli import bench as cli_bench
from tlt_core.cli import build_parser, main
from tlt_core.config_flags import flag_name

LEAVES = [("bench", leaf) for leaf in cli_bench.BENCHMARKS] + \
         [("task", leaf) for leaf in cli_bench.TASKS]


def leaf_parser(command: str, name: str) -> argparse.ArgumentParser:
    top = build_parser()
    group = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    kinds = next(a for a in group.choices[command]._actions
                 if isinstance(a, argparse._SubParsersAction))
    return kinds.choices[name]


def test_every_benchmark_is_registered():
    assert [leaf.name for leaf in cli_bench.BENCHMARKS] == [
        "kernels", "engine", "prefill", "speculative", "drafter", "rollout", "train",
        "simulate", "peers"]


@pytest.mark.parametrize("command, leaf", LEAVES, ids=lambda x: getattr(x, "name", x))
def test_every_field_has_a_flag_with_help(command, leaf):
    module = sys.modules[leaf.add_cli_args.__module__]
    parser = leaf_parser(command, leaf.name)
    flags = parser._option_string_actions
    derived = set()
    for options in module.CLI_OPTIONS:
        for field in fields(options):
            where = f"tlt {command} {leaf.name}: {options.__name__}.{field.name}"
            help_text = field.metadata.get("help", "")
            assert help_text.strip(), f"{where}: no help beside the field"
            flag = flag_name(field.name, field.default)
            assert flag in flags, f"{where}: no {flag}"
            action = flags[flag]
            assert action.dest == field.name, where
            assert action.help.startswith(help_text.replace("%", "%%")), where
            if field.default is MISSING:
                assert action.required, where
            else:
                assert action.default == field.default, where
            derived.add(action.dest)
    handwritten = {action.dest for action in parser._actions if action.option_strings} - \
        derived - {"help", "config", "log_level"}
    assert not handwritten, f"tlt {command} {leaf.name}: flags not from a field: {handwritten}"


def test_help_shows_the_workload_dependent_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "drafter", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "evolving-target rounds (default: 8; with --model 4)" in text
    assert "--world INT rollout ranks (processes) (default: 2)" in text

