"""Calibrations kept on disk: a run that would calibrate what an earlier run on this machine
already calibrated reads that run's cost model instead (a timing cache, as TensorRT keeps one
for its kernel choices).

Calibration costs tens of seconds to minutes (SmolLM2-135M bf16 on 2 CPU cores: 82 s for the
RL driver's plans), paid again by every run that starts: in a short run, or a benchmark of a
few RL steps, it is most of what TLT loses. What it measures is the cost of a step of each plan
at each batch size, which depends on the model's shape, dtype and weight layout, the drafter's
form, the engine's settings, the prompts' lengths and the machine, and a plan's acceptance on
the calibration prompts, and the code a step runs: the compiled kernels and the engine's,
model's, drafters' and calibration's Python (`code_digest`: a rebuilt kernel is another entry).
All of those except the weights form the cache key (`CalibrationCache.fingerprint`); the
weights are left out on purpose, so a run resumed from a later checkpoint of the same model
reuses the calibration: its step costs are the same, and the acceptance part of its rates is a
prior that the adaptive loop corrects from its own steps anyway (as it must while the drafter
is refreshed every RL step).

An entry is one JSON file, `<key>.json`, holding its fingerprint in full (a hash collision, or
an entry edited by hand, is recognised and recalibrated), the cost model and when it was
measured; it is written atomically, and one that does not read back is reported and replaced.
A cache that cannot be written (a full disk, no permission) is reported; the run goes on.
Nothing loaded runs code: entries are plain JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from tlt_core import _C
from tlt_core._version import __version__
from tlt_core.adaptive.cost_model import CostModel, calibrate
from tlt_core.drafting.plan import DraftPlan
from tlt_core.engine.engine import RolloutEngine
from tlt_core.engine.records import Request
from tlt_core.persistence.checkpoint_io import atomic_file

logger = logging.getLogger(__name__)

FORMAT = 1  # of an entry file; another format is recalibrated
# CostModel's tables keyed by (batch, plan key), stored as [batch, key, value] rows
_TABLES = ("rates", "context_slope", "context_mean", "context_max", "admission_s")


class CalibrationCache:
    """Cost models on disk under `directory`, one file per fingerprint (module docstring)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"calibration_cache: {self.directory} is a file, expected a folder")

    def calibrate(self, engine: RolloutEngine, plans: Sequence[DraftPlan],
                  batches: Sequence[int], calibration_requests: Sequence[Request],
                  **options) -> CostModel:
        """cost_model.calibrate(engine, plans, batches, calibration_requests, **options), read
        from the cache when an entry has this fingerprint (its `calibration_s` then the
        seconds reading it took, `cached_from` its file), else measured and stored."""
        start = time.perf_counter()
        fingerprint = self.fingerprint(engine, plans, batches, calibration_requests, **options)
        path = self.directory / f"{_digest(fingerprint)}.json"
        model = self._read(path, fingerprint)
        if model is not None:
            model.calibration_s = time.perf_counter() - start
            logger.info("calibration: reusing %s (delete it to calibrate afresh)", path)
            return model
        model = calibrate(engine, plans, batches, calibration_requests, **options)
        entry = {"format": FORMAT, "fingerprint": fingerprint, "cost_model": _encode(model),
                 "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            with atomic_file(path) as temporary:
                temporary.write_text(json.dumps(entry, indent=1) + "\n", encoding="utf-8")
        except OSError as error:  # a cache that cannot be written costs the next run, not this
            logger.warning("calibration cache: could not store %s (%s); this run goes on with "
                           "the calibration it measured", path, error)
        return model

    @staticmethod
    def fingerprint(engine: RolloutEngine, plans: Sequence[DraftPlan], batches: Sequence[int],
                    calibration_requests: Sequence[Request], **options) -> dict:
        """What a calibration's result depends on, the weights' values aside, as JSON data."""
        model = engine.model
        drafter = engine.drafter
        requests = [[list(map(int, r.prompt_ids)), _plain(r.params)]
                    for r in calibration_requests]
        return json.loads(json.dumps({
            "tlt_core": __version__, "code": code_digest(), "torch": torch.__version__,
            "machine": _machine(model),
            "model": {"config": _plain(model.config),
                      "dtype": str(model.lm_head.weight.dtype),
                      "layout": getattr(model, "inference_layout", None)},
            "drafter": None if drafter is None else {
                "kind": type(drafter).__name__, "config": _plain(getattr(drafter, "config", None)),
                "dtype": str(next(drafter.parameters()).dtype),
                "shapes": [list(p.shape) for p in drafter.parameters()]},
            # the seed only picks the samples: not what a step costs
            "engine": {k: v for k, v in _plain(engine.config).items() if k != "seed"},
            "plans": [plan.key for plan in plans], "batches": sorted(map(int, batches)),
            "requests": hashlib.sha256(json.dumps(requests).encode()).hexdigest(),
            "options": {name: options[name] for name in sorted(options)},
        }, default=str))

    def _read(self, path: Path, fingerprint: dict) -> CostModel | None:
        """The cost model stored at path for fingerprint; None (saying why, unless there is
        no file) when there is none to use."""
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                raise ValueError(f"not a format-{FORMAT} calibration entry")
            if entry.get("fingerprint") != fingerprint:
                raise ValueError("its fingerprint differs from this run's (a hash collision or "
                                 "an edit)")
            model = _decode(entry["cost_model"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            logger.warning("calibration cache: %s cannot be used (%s); calibrating afresh and "
                           "replacing it", path, error)
            return None
        model.cached_from = str(path)
        return model


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of the code that sets what a step costs: the compiled kernels (tlt_core._C) and
    the Python of tlt_core.engine, .model, .drafting and .ops and of calibration itself."""
    package = Path(__file__).resolve().parent.parent
    files = [Path(_C.__file__)] + sorted(
        path for folder in ("engine", "model", "drafting", "ops")
        for path in (package / folder).rglob("*.py")) + [package / "adaptive" / "cost_model.py"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() if path.is_relative_to(
            package) else path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _machine(model: torch.nn.Module) -> dict:
    """The processor (or GPU) a step runs on, and the threads it gets."""
    device = model.lm_head.weight.device
    described = {"device": device.type, "threads": torch.get_num_threads(),
                 "cpus": os.cpu_count(), "cpu": _cpu_name()}
    if device.type == "cuda":
        described["gpu"] = torch.cuda.get_device_name(device)
    return described


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plain(value):
    """A dataclass as a dict; anything else as it is (json.dumps writes what it cannot encode
    as its str)."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _digest(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:32]


def _encode(model: CostModel) -> dict:
    tables = {name: [[batch, key, value] for (batch, key), value in getattr(model, name).items()]
              for name in _TABLES}
    return {**tables, "acceptance": model.acceptance, "calibration_s": model.calibration_s}


def _decode(data: dict) -> CostModel:
    """A CostModel from _encode's data; ValueError when it is not that."""
    tables = {}
    for name in _TABLES:
        table = {}
        for row in data[name]:
            batch, key, value = row
            if not (isinstance(batch, int) and isinstance(key, str)
                    and isinstance(value, (int, float))):
                raise ValueError(f"cost_model.{name} has a malformed row {row!r}")
            table[(batch, key)] = float(value)
        tables[name] = table
    acceptance = {str(k): float(v) for k, v in data["acceptance"].items()}
    return CostModel(tables["rates"], float(data["calibration_s"]), acceptance,
                     tables["context_slope"], tables["context_mean"], tables["context_max"],
                     tables["admission_s"])
