"""An advisory lock on a folder: one process at a time writes into it.

`folder_lock(folder, wait=...)` holds the `filelock` lock on the file `LOCK_FILE` inside the
folder (creating both) for the duration of a with-block, and records the holder's pid in the
file. Without waiting, a folder another holder has raises `FolderLockedError` at once, naming
the folder and that pid; with wait=True the call blocks until the holder lets go, after telling
`on_wait` the holder's pid (so that a caller can say why it is not moving).

filelock's native lock is a `flock`: the kernel releases it when its file is closed, which
happens when the process exits or is killed, so a lock never outlives its holder and no stale
lock needs clearing by hand. The lock file is kept on release (`preserve_lock_file`), so the
last holder's pid stays readable and a folder holds the same file whoever locked it last. A
flock belongs to an open file, not to a process, and each call opens its own, so two holders in
one process (threads) exclude each other as processes do. The lock is advisory: it keeps out
the writers that take it, nothing else.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_FILE = ".tlt.lock"


class FolderLockedError(RuntimeError):
    """The folder is held by another holder: `folder`, and its `pid` (None when unreadable)."""

    def __init__(self, folder: Path, pid: int | None):
        self.folder, self.pid = folder, pid
        holder = f"pid {pid}" if pid is not None else "a process whose pid it did not record"
        super().__init__(f"{folder} is in use by another process ({holder})")


@contextlib.contextmanager
def folder_lock(folder: str | Path, *, wait: bool,
                on_wait: Callable[[int | None], None] | None = None) -> Iterator[Path]:
    """Holds `folder`'s lock (module docstring) for the with-block; yields the lock file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    lock = FileLock(path, mode=0o644, preserve_lock_file=True, on_acquired=_record_pid)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        if not wait:
            raise FolderLockedError(folder, _holder(path)) from None
        if on_wait is not None:
            on_wait(_holder(path))
        lock.acquire()
    try:
        yield path
    finally:
        lock.release()


def _record_pid(descriptor: int) -> None:
    """filelock's on_acquired: the holder's pid, in the lock file it now holds."""
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)


def _holder(path: Path) -> int | None:
    """The pid the holder wrote; None while it has not yet (it writes right after locking)."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None
