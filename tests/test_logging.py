"""Logging: the library only logs (a NullHandler on `tlt_core`, never a configuration of its
own), the `tlt` command shows its diagnostics on stderr at the level -v / -q / --log-level /
$TLT_LOG_LEVEL / a config file asks for, keeps stdout for its output, and a rank other than 0
logs warnings only, marked with its rank."""

import logging
import subprocess
import sys

import pytest

from tlt_core.cli import main
from tlt_core.cli.logs import LEVEL_VARIABLE, configure_logging

LIBRARY_LOGS = """
import logging, sys
import tlt_core
logging.getLogger("tlt_core.anything").warning("a warning from inside tlt_core")
assert not logging.getLogger().handlers  # the library configured nothing
if sys.argv[1] == "configured":
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("tlt_core.anything").warning("shown once configured")
"""


@pytest.fixture(autouse=True)
def restore_tlt_core_logger():
    """Each test configures the `tlt_core` logger; the next starts from what it was."""
    logger = logging.getLogger("tlt_core")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.mark.parametrize("how", ["silent", "configured"])
def test_the_library_logs_only_where_the_application_configured_logging(how):
    done = subprocess.run([sys.executable, "-c", LIBRARY_LOGS, how], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    if how == "silent":  # the NullHandler: not even logging's last-resort handler writes
        assert done.stderr == ""
    else:
        assert done.stderr == "tlt_core.anything WARNING shown once configured\n"


def data_command(tmp_path, *flags) -> list[str]:
    return ["data", "arithmetic", str(tmp_path / "problems.jsonl"), "--n", "2", *flags]


def test_the_command_logs_to_stderr_and_keeps_stdout_for_output(tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.delenv(LEVEL_VARIABLE, raising=False)
    assert main(data_command(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"wrote 2 problems (seed 0) to {tmp_path / 'problems.jsonl'}\n"  # info: as is
    assert main(data_command(tmp_path, "-q")) == 0
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv(LEVEL_VARIABLE, "WARNING")
    assert main(data_command(tmp_path)) == 0
    assert capsys.readouterr() == ("", "")
    assert main(data_command(tmp_path, "--log-level", "info")) == 0  # the flag wins
    assert "wrote 2 problems" in capsys.readouterr().err
    config = tmp_path / "quiet.toml"
    config.write_text('log_level = "warning"\n')
    monkeypatch.delenv(LEVEL_VARIABLE)
    assert main(data_command(tmp_path, "--config", str(config))) == 0
    assert capsys.readouterr() == ("", "")
    assert main(data_command(tmp_path, "--config", str(config), "-v")) == 0
    assert "wrote 2 problems" in capsys.readouterr().err


def test_bad_levels_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(LEVEL_VARIABLE, "loud")
    with pytest.raises(SystemExit) as exit_:
        main(data_command(tmp_path))
    assert exit_.value.code == 2
    assert "TLT_LOG_LEVEL: must be one of debug, info, warning, error, got 'loud'" in \
        capsys.readouterr().err
    monkeypatch.delenv(LEVEL_VARIABLE)
    with pytest.raises(SystemExit):
        main(data_command(tmp_path, "--log-level", "loud"))
    assert "--log-level: invalid choice: 'loud'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(data_command(tmp_path, "-v", "-q"))
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(ValueError, match="level: must be one of"):
        configure_logging("loud")


def test_lines_are_concise_and_ranks_other_than_zero_log_warnings_only(capsys):
    logger = logging.getLogger("tlt_core.some.module")
    configure_logging("debug")
    configure_logging("debug")  # again: still one handler
    logger.debug("a detail")
    logger.info("what happens")
    logger.warning("a problem")
    assert capsys.readouterr().err.splitlines() == [
        "debug [tlt_core.some.module]: a detail", "what happens", "warning: a problem"]
    configure_logging("info", rank=1)
    logger.info("what happens")
    logger.error("it failed")
    assert capsys.readouterr().err.splitlines() == ["rank 1: error: it failed"]
    logging.getLogger("another.library").warning("not ours")  # other loggers are left alone
    assert capsys.readouterr().err == ""
