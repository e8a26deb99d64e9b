"""Persistence: state on disk as plain data, written so that a reader never sees half of it.

`checkpoint_io.py` is the one atomic writer (`atomic_file`, `atomic_folder`: a temporary
sibling, fsync'd, renamed into place) and checkpoints as folders of safetensors and JSON
(`write_state`, `read_state`, step folders kept to the newest K), and `write_safetensors`, a
safetensors file readable by all; nothing it reads runs code
(no pickle). `folder_lock.py` is a folder one process writes at a time. It knows nothing of
models, training or runs: callers decide what a state holds and where it goes.
"""

from tlt_core.persistence.checkpoint_io import (atomic_file, atomic_folder, failed_write,
                                                latest_checkpoint, read_state, step_folders,
                                                write_checkpoint, write_safetensors,
                                                write_state)
from tlt_core.persistence.folder_lock import FolderLockedError, folder_lock

__all__ = ["FolderLockedError", "atomic_file", "atomic_folder", "failed_write", "folder_lock",
           "latest_checkpoint", "read_state", "step_folders", "write_checkpoint",
           "write_safetensors", "write_state"]
