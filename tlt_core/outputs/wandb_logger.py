"""A run's step metrics as a Weights & Biases run: the optional logger beside metrics.jsonl and
TensorBoard.

`WandbLogger` logs one step at a time: the scalars and histograms it is given, at wandb step =
the record's step. It knows nothing of the records' layout; `tlt_core.outputs.metrics.MetricsWriter`
picks the scalars of `METRICS` (the names of metrics.jsonl and TensorBoard alike) and the
`response_lengths` histogram, and drives it.

wandb is not a dependency: it is imported when a logger starts, and a missing package is an
ImportError that says `pip install wandb`. Modes: "online" streams to the W&B server (after
`wandb login`); "offline" writes the run locally, and `wandb sync FOLDER/wandb/offline-run-*`
uploads it later; None leaves the choice to wandb (WANDB_MODE, else online). An offline run
reads no login (~/.netrc) and reaches no server: wandb's process-wide settings are set to the
mode too, since its usage telemetry follows those rather than the run's own mode.

A run's files live under its folder: wandb's own `FOLDER/wandb/` (one `run-*` or
`offline-run-*` folder per start, the history in its `run-ID.wandb`), and `FOLDER/wandb_run_id`,
the run's id, written atomically when the run starts. A resumed run reads the id back and
continues the same wandb run (`resume="allow"`); a fresh run makes a new id. On resume, the
earlier steps the wandb run lacks are logged first: all of them under a new id (the earlier
attempts ran without wandb, or the id file is gone); when the server holds the run, those from
its next step on (a step checkpointed but not logged before an interruption); otherwise
(offline) none: wandb cannot know what the earlier attempts' offline folders hold, and
`wandb sync` uploads those folders, each a part of the same run, in order.

`close` finishes the run: exit code 0, or 1 when the with-block or the caller reports a
failure (the run shows as failed, never as still running). wandb's console output is silenced
and it does not capture the process's stdout and stderr.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tlt_core.persistence.checkpoint_io import atomic_file

WANDB_MODES = ("online", "offline")
WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run folder: the id a resumed run continues
WANDB_DIR = "wandb"  # wandb's own folder under the run folder (its `dir=`)


class WandbError(RuntimeError):
    """wandb could not start or finish the run (not logged in, server unreachable); the
    message says what wandb said and what to do."""


@dataclass(frozen=True)
class WandbSettings:
    """Where a run's metrics go in W&B. project: the W&B project (required); mode: "online",
    "offline" or None (module docstring); run_name: the run's display name (None: wandb picks
    one); group: runs shown together (a run and its SD-off baseline); config: the run's
    configuration, e.g. `dataclasses.asdict(TrainConfig)`."""

    project: str
    mode: str | None = None
    run_name: str | None = None
    group: str | None = None
    config: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.project, str) or not self.project.strip():
            raise ValueError(f"project: must be a non-empty str, got {self.project!r}")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"mode: must be one of {', '.join(WANDB_MODES)} or None, got "
                             f"{self.mode!r}")
        for name in ("run_name", "group"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}: must be a non-empty str or None, got {value!r}")


def wandb_available() -> bool:
    """Whether the wandb package is installed (without importing it: that takes a while)."""
    return importlib.util.find_spec("wandb") is not None


def _import_wandb():
    try:
        import wandb
    except ImportError as error:
        raise ImportError("wandb: the package is not installed; pip install wandb (or log to "
                          "metrics.jsonl and TensorBoard only)") from error
    return wandb


def remove_local_run(folder: str | Path) -> None:
    """Deletes a run folder's wandb files (its id and wandb's own folder): a fresh run's metrics
    must not continue an earlier run's."""
    folder = Path(folder)
    (folder / WANDB_RUN_ID_FILE).unlink(missing_ok=True)
    if (folder / WANDB_DIR).is_dir():
        shutil.rmtree(folder / WANDB_DIR)


class WandbLogger:
    """One W&B run, its files under `folder` (module docstring).

    history: None starts a fresh run (a new id); a resumed run passes its earlier step records,
    as (step, scalars, histograms) triples, and continues the run whose id the folder holds."""

    def __init__(self, folder: str | Path, settings: WandbSettings, *,
                 history: Sequence[tuple[int, Mapping[str, float], Mapping[str, Sequence[float]]]]
                 | None = None):
        if not isinstance(settings, WandbSettings):
            raise TypeError(f"settings: must be a WandbSettings, got {type(settings).__name__}")
        wandb = _import_wandb()
        self._wandb = wandb
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        id_path = self.folder / WANDB_RUN_ID_FILE
        earlier_id = (id_path.read_text(encoding="utf-8").strip()
                      if history is not None and id_path.is_file() else "")
        if settings.mode is not None:
            # The run's mode alone leaves wandb's process-wide telemetry online: it would read
            # ~/.netrc and call the server from an offline run.
            wandb.setup(settings=wandb.Settings(mode=settings.mode))
        try:
            self._run = wandb.init(
                project=settings.project, mode=settings.mode, name=settings.run_name,
                group=settings.group, config=dict(settings.config), dir=str(self.folder),
                id=earlier_id or None, resume="allow",  # None: wandb makes a new id
                # create_new: a run of the caller's own stays active and stays wandb.run
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off"))
        except wandb.errors.Error as error:
            raise WandbError(f"wandb: could not start the run of project {settings.project!r}: "
                             f"{error} (log in with `wandb login`, or log offline: mode "
                             "'offline', uploaded later by `wandb sync`)") from error
        self.run_id: str = self._run.id
        self.offline: bool = self._run.offline
        self.url: str | None = self._run.url  # None offline
        try:
            with atomic_file(id_path) as temporary:
                temporary.write_text(self.run_id + "\n", encoding="utf-8")
            first_missing = self._first_missing_step(continued=bool(earlier_id))
            for step, scalars, histograms in history or ():
                if first_missing is not None and step >= first_missing:
                    self.log(step, scalars, histograms)
        except BaseException:
            self.close(failed=True)
            raise

    def _first_missing_step(self, *, continued: bool) -> int | None:
        """The first of the earlier steps this run lacks, None for none (module docstring)."""
        if not continued:
            return 0
        if self._run.resumed:  # the server holds the run and knows its next step
            return self._run.starting_step
        return None

    def log(self, step: int, scalars: Mapping[str, float],
            histograms: Mapping[str, Sequence[float]]) -> None:
        """One step: each scalar, and each non-empty list of numbers as a wandb.Histogram."""
        if self._run is None:
            raise ValueError("the wandb run is closed")
        data: dict[str, object] = dict(scalars)
        data.update({name: self._wandb.Histogram(list(values))
                     for name, values in histograms.items() if len(values)})
        self._run.log(data, step=step)

    def close(self, *, failed: bool = False) -> None:
        """Finishes the run (exit code 1 when failed); once."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=1 if failed else 0)
        except self._wandb.errors.Error as error:
            raise WandbError(f"wandb: could not finish run {self.run_id}: {error}") from error

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)
