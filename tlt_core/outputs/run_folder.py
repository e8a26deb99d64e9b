"""A `tlt train` run folder (--out): its parts, and when a run may use the folder.

A run's parts (docs/cli.md, "the run folder"): metrics.jsonl and TensorBoard event files,
checkpoints/, policy/, tokenizer/, report.md and its plots, baseline/ (the SD-off run of
--compare, itself a run folder), wandb's files (wandb/ and wandb_run_id) and an older version's checkpoint.pt. A
folder holding any of them holds a run; every other file in it is the user's, and no flag
touches it.

Nothing a user gave is lost (`resume_point`):
- a run without flags starts only in a folder that holds no run: an earlier one is refused,
  naming the folder and its parts, and pointing to --resume and --overwrite;
- --resume continues from the newest complete checkpoint, and is refused where there is none
  (a mistyped --out would otherwise start afresh over the folder's metrics). The one exception
  is the baseline folder of --compare, which the user never named: while no step of it has
  finished (no checkpoint, no metrics), it starts fresh, so that a --compare run interrupted
  before its baseline's first step resumes;
- --overwrite deletes the run's parts first (`clear_run`), and nothing else.
A run holds its folder's lock (`hold_run_folder`, tlt_core.persistence.folder_lock) from before
these checks to its end, so that a second run on the same folder stops at once, naming the first's
pid, instead of interleaving the two runs' metrics and checkpoints. Rank 0, which writes, holds
it in a multi-process run.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from tlt_core.outputs.metrics import JSONL_FILE, TENSORBOARD_EVENTS
from tlt_core.outputs.report import PLOTS
from tlt_core.outputs.wandb_logger import WANDB_DIR, WANDB_RUN_ID_FILE
from tlt_core.persistence.checkpoint_io import failed_write, latest_checkpoint
from tlt_core.persistence.folder_lock import FolderLockedError, folder_lock

# A run folder's parts (module docstring); `tlt export` reads them too.
CHECKPOINTS_DIR, POLICY_DIR, TOKENIZER_DIR = "checkpoints", "policy", "tokenizer"
BASELINE_DIR = "baseline"
REPORT_FILE = "report.md"
OLD_CHECKPOINT = "checkpoint.pt"  # the single torch.save file of older versions: not read
_PART_NAMES = (JSONL_FILE, CHECKPOINTS_DIR, POLICY_DIR, TOKENIZER_DIR, REPORT_FILE, *PLOTS,
               BASELINE_DIR, WANDB_DIR, WANDB_RUN_ID_FILE, OLD_CHECKPOINT)


class RunFolderError(ValueError):
    """A run may not use its folder as asked; the message names the folder and what to do."""


def run_parts(folder: Path) -> list[Path]:
    """The parts of a run `folder` holds (module docstring); baseline/ counts when it holds a
    run's parts itself (a lock file alone is no run)."""
    if not folder.is_dir():
        return []
    return ([folder / name for name in _PART_NAMES if (folder / name).exists()
             and (name != BASELINE_DIR or run_parts(folder / name))]
            + sorted(folder.glob(TENSORBOARD_EVENTS)))


def resume_point(folder: Path, *, resume: bool, overwrite: bool, nested: bool = False
                 ) -> Path | None:
    """The checkpoint a run in `folder` continues from, None to start fresh, or a
    RunFolderError (module docstring). nested: the baseline folder of --compare."""
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite: give one (continue the run in --out, "
                             "or replace it)")
    if overwrite:
        return None
    parts = run_parts(folder)
    if not resume:
        if parts:
            raise RunFolderError(f"--out: {folder} holds an earlier run ({_names(parts)}); "
                                 "continue it with --resume, replace it with --overwrite "
                                 "(which deletes those), or give another --out")
        return None
    latest = latest_checkpoint(folder / CHECKPOINTS_DIR)
    if latest is not None:
        return latest
    if (folder / OLD_CHECKPOINT).is_file():
        raise RunFolderError(f"--resume: {folder / OLD_CHECKPOINT} was written by an older "
                             "tlt_core, whose checkpoints this version does not read; start a "
                             "new run (with --overwrite, which deletes it, or with another "
                             "--out)")
    if nested and not (folder / JSONL_FILE).exists():  # nothing of its own to lose
        return None
    fresh = (f"start a new run there with --overwrite (which deletes {_names(parts)})" if parts
             else "start a new run without --resume")
    raise RunFolderError(f"--resume: {folder} has no checkpoint to resume from (none in "
                         f"{CHECKPOINTS_DIR}/); {fresh}, or give the --out of the run to resume")


def clear_run(folder: Path) -> None:
    """Deletes the parts of a run `folder` holds (--overwrite); its other files stay, and so do
    the lock files (another run may be waiting on one)."""
    for part in run_parts(folder):
        try:
            if part.name == BASELINE_DIR and part.is_dir():  # a run folder: its parts only
                clear_run(part)
            elif part.is_dir():
                shutil.rmtree(part)
            else:
                part.unlink()
        except OSError as error:
            raise failed_write(part, error) from error


@contextlib.contextmanager
def hold_run_folder(folder: Path) -> Iterator[None]:
    """Holds `folder`'s lock for the with-block, or raises a RunFolderError at once, naming the
    folder and the run that holds it."""
    try:
        with folder_lock(folder, wait=False):
            yield
    except FolderLockedError as error:
        holder = f"pid {error.pid}" if error.pid is not None else "its pid not yet recorded"
        raise RunFolderError(f"--out: {folder} is in use by another tlt train run ({holder}); "
                             "wait for it to end, or give another --out") from None


def _names(parts: list[Path]) -> str:
    return ", ".join(part.name + "/" * part.is_dir() for part in parts)
