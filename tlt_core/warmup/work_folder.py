"""The warm-up's work folder (`out/work/`): a cache several processes may reach for at once,
and which a crash, a full disk or a hand may damage.

`work/run.json` records the settings, the prompts' hash and the target's a folder belongs to
(`claim_work_folder`): a resumed run with other settings is refused, naming them (`steps`,
`checkpoint_every` and `matmul_dtype` may change: none changes the data or the drafter's float32
state); a record that is damaged or foreign, or missing beside shards
and checkpoints, starts the folder afresh (nothing vouches for their settings any more). The
record is written atomically (tlt_core.persistence.checkpoint_io.atomic_file). `discard`
deletes an entry found damaged, so that its phase builds it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from tlt_core.persistence.checkpoint_io import atomic_file
from tlt_core.warmup.config import OfflineConfig

logger = logging.getLogger(__name__)

WORK_DIR, RESPONSES_DIR, TRAIN_DIR = "work", "responses", "train"
WORK_RECORD = "run.json"  # the settings and prompts a work folder belongs to
# Settings a work record may lack, with the value its run used: a record without `unroll`
# belongs to a teacher-forced run (unroll 1), one without `rejection_weight` to a run of
# EAGLE's loss alone (0), one without `ignore_eos` to responses that end at the end of turn,
# one without `regression_weight` to a run with EAGLE's feature regression (1): a resume with
# those values keeps its shards and checkpoints, one with others is refused.
IMPLIED_SETTINGS = {"unroll": 1, "rejection_weight": 0.0, "ignore_eos": False,
                    "regression_weight": 1.0}


def claim_work_folder(work: Path, config: OfflineConfig, prompts: list[tuple[int, ...]],
                      weights_sha256: str) -> None:
    """Records what this run's work folder holds (the settings, the prompts' hash and the
    target's), or checks that an earlier run's matches: resuming with other settings, or for
    another target, would mix two runs' data.
    `steps`, `checkpoint_every` and `matmul_dtype` may change (a resumed run may train longer,
    or its matmuls in another dtype). A record that is
    damaged or foreign, or missing beside shards and checkpoints, starts the folder afresh."""
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    mine = {**asdict(config), "prompts_sha256": digest, "target_sha256": weights_sha256}
    for free in ("steps", "checkpoint_every", "matmul_dtype"):
        mine.pop(free)
    mine = json.loads(json.dumps(mine))  # tuples as lists, as read back
    path = work / WORK_RECORD
    problem = record_problem(path, set(mine))
    if problem is None:
        theirs = {**IMPLIED_SETTINGS, **json.loads(path.read_text(encoding="utf-8"))}
        changed = sorted(key for key in mine if mine[key] != theirs[key])
        if changed:
            raise ValueError(f"out: {work.parent} holds a run with other settings "
                             f"({', '.join(changed)}); resume it with the same ones or choose "
                             "another --out")
        return
    stale = [work / name for name in (RESPONSES_DIR, TRAIN_DIR) if (work / name).exists()]
    if path.exists() or stale:
        logger.warning("out: %s %s, so nothing vouches for the settings of %s; starting it "
                       "afresh", path, problem,
                       ", ".join(str(s) for s in stale) or "the work folder")
        for entry in stale:
            shutil.rmtree(entry)
    with atomic_file(path) as temporary:
        temporary.write_text(json.dumps(mine, indent=1) + "\n", encoding="utf-8")


def record_problem(path: Path, keys: set[str]) -> str | None:
    """What keeps `path` from being a work record with exactly `keys` (those of
    IMPLIED_SETTINGS optional); None when it is one."""
    if not path.is_file():
        return "is missing"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"is not valid JSON ({error})"
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not a work record"
    missing = sorted(keys - set(record) - IMPLIED_SETTINGS.keys())
    foreign = sorted(set(record) - keys)
    if missing or foreign:
        return ("is not a work record of this version ("
                + "; ".join(part for part in (missing and f"missing {', '.join(missing)}",
                                              foreign and f"unknown {', '.join(foreign)}")
                            if part) + ")")
    return None


def discard(entry: Path) -> None:
    """Deletes a damaged cache entry (a folder, or a file where a folder belongs)."""
    if entry.is_dir():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)
