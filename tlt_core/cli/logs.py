"""The `tlt` command's logging: where tlt_core's log records go when it runs as a command.

Library code logs to `logging.getLogger(__name__)`, under the `tlt_core` logger, and never
configures logging: tlt_core/__init__.py gives `tlt_core` a NullHandler, so an application that
embeds tlt_core decides what is shown. The command configures it (`configure_logging`, once per
process: main() and each local rank): one handler on the `tlt_core` logger, to stderr, at the
level `--log-level` gives (-v: debug, -q: warning), else $TLT_LOG_LEVEL, else info. Other
libraries' loggers are left alone.

Lines are concise: an info record is its message, as the command says it to its user; the
other levels carry their name (`warning: ...`), debug also the logger's. A rank other than 0 of
a multi-process run logs warnings and errors only, prefixed `rank N:`. Records are written with
tqdm.write, so a progress bar on stderr is redrawn below them rather than broken, and to
sys.stderr as it is when the record is written (a redirect or a test's capture). stdout is left
to the command's output: tables, JSON, generated text.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tqdm import tqdm

LOGGER = "tlt_core"
LEVELS = ("debug", "info", "warning", "error")
LEVEL_VARIABLE = "TLT_LOG_LEVEL"  # the level when no flag gives one
DEFAULT_LEVEL = "info"


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """-v / -q / --log-level LEVEL on a subcommand (one of them); a config file's key is
    `log_level` (--log-level is added last, so the file's value is read as a level)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="debug",
                       help="log debug messages too (--log-level debug)")
    group.add_argument("-q", "--quiet", dest="log_level", action="store_const", const="warning",
                       help="log warnings and errors only (--log-level warning)")
    group.add_argument("--log-level", dest="log_level", choices=LEVELS, type=str.lower,
                       help=f"what tlt_core logs to stderr (default: ${LEVEL_VARIABLE}, else "
                            f"{DEFAULT_LEVEL})")


def chosen_level(flag: str | None) -> str:
    """The flag's level, else $TLT_LOG_LEVEL's, else info; ValueError naming the variable when
    it holds no level."""
    if flag is not None:
        return flag
    value = os.environ.get(LEVEL_VARIABLE)
    if value is None or not value.strip():
        return DEFAULT_LEVEL
    if value.strip().lower() not in LEVELS:
        raise ValueError(f"{LEVEL_VARIABLE}: must be one of {', '.join(LEVELS)}, got {value!r}")
    return value.strip().lower()


def configure_logging(level: str | int, rank: int = 0) -> None:
    """The `tlt_core` logger at `level` (a name of LEVELS or a logging level number; warning
    at least on ranks other than 0), with this module's one stderr handler; calling it again
    replaces the handler, so it is safe once per command run."""
    number = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(number, int):
        raise ValueError(f"level: must be one of {', '.join(LEVELS)}, got {level!r}")
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter(rank))
    logger.addHandler(handler)
    logger.setLevel(max(number, logging.WARNING) if rank else number)


def current_level() -> int:
    """The `tlt_core` logger's effective level (what a local rank started now should use)."""
    return logging.getLogger(LOGGER).getEffectiveLevel()


class _StderrHandler(logging.Handler):
    """Writes each record with tqdm.write to the sys.stderr of the moment (module docstring)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's contract: a failed write is reported, never raised
            self.handleError(record)


class _Formatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__("%(message)s")
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.DEBUG:
            text = f"debug [{record.name}]: {text}"
        elif record.levelno != logging.INFO:
            text = f"{record.levelname.lower()}: {text}"
        return f"rank {self.rank}: {text}" if self.rank else text
