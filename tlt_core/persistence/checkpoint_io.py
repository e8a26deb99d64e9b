"""Checkpoints as folders of plain data: a nested state written as two files and read back
without running code (safetensors and JSON only, no pickle).

A state is dicts (OrderedDict included, read back as dict), lists and tuples of tensors, ints,
floats, bools, str, bytes and None. Its folder holds:
- `tensors.safetensors`: every tensor (on the CPU), keyed by its path in the state, components
  joined by "/" ("optimizer/state/3/exp_avg"; a "/" or "%" inside a key is written %2F, %25).
  The very same view met twice (tied weights) is stored once and referenced twice.
- `state.json`: {"format": FORMAT, "state": the state, each tensor replaced by
  {"__tensor__": its key}}. What JSON lacks is tagged: {"__tuple__": [...]} (so that
  `random.getstate()` reads back as the tuple `random.setstate` needs), {"__float__": "inf" |
  "-inf" | "nan"}, {"__bytes__": base64}, and {"__dict__": [[key, value], ...]} for a dict with
  a key that is not a str (an optimizer's int parameter ids) or that is a tag.
Anything else (an arbitrary object; a namedtuple, whose field names would be lost; a set) is
refused at save time with a TypeError naming its path.

Writes are atomic (`atomic_folder`): the files go into a temporary sibling folder
(".NAME.tmp-..."), are fsync'd with the folder, which is then renamed into place, and the parent
is fsync'd. A reader sees no folder or the complete one, never a part; a crash leaves at most a
temporary folder, which nothing reads. (Replacing a folder that exists takes two renames, the
old one aside first: for that instant there is none.) `atomic_file` does the same for one file
(os.replace over the old one). A write that fails (disk full, no permission) deletes its
temporary, leaves what was there as it was, and raises an OSError naming the folder or file it
was writing (`failed_write`): the OS's own error names a temporary file, or nothing.

Step checkpoints: `write_checkpoint(directory, step, state, keep=K)` writes
`directory/step-000004/` (the state after that many steps), then deletes all but the newest K
step folders, any of a later step (an abandoned run's: the one just written is the newest) and
temporary folders that crashed writes left; `latest_checkpoint(directory)` is the newest
complete step folder, or None.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "tlt_core.checkpoint/1"
STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"
STEP_PREFIX = "step-"
TEMPORARY_MARK = ".tmp-"
FILE_MODE = 0o644  # what write_safetensors leaves: readable by all, as a JSON file is
_STEP_NAME = re.compile(rf"{STEP_PREFIX}(\d{{6,}})")
_TAGS = ("__tensor__", "__tuple__", "__float__", "__bytes__", "__dict__")
_FAILED_WRITE = "cannot write "


# ---- folders of step checkpoints -----------------------------------------------------------

def step_folder_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step: must be an int >= 0, got {step!r}")
    return f"{STEP_PREFIX}{step:06d}"


def step_folders(directory: str | Path, *, marker: str = STATE_FILE) -> dict[int, Path]:
    """step -> folder of the complete step folders in `directory` (those holding `marker`),
    oldest first; temporary folders and other names are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    found = {}
    for path in directory.iterdir():
        match = _STEP_NAME.fullmatch(path.name)
        if match and (path / marker).is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete step folder in `directory`, or None."""
    folders = step_folders(directory)
    return folders[max(folders)] if folders else None


def write_checkpoint(directory: str | Path, step: int, state: dict, *, keep: int = 2) -> Path:
    """Writes `state` to directory/step-NNNNNN atomically, then deletes the step folders other
    than the newest `keep` up to `step`, and temporary folders left by crashed writes."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep: must be an int >= 1, got {keep!r}")
    directory = Path(directory)
    folder = write_state(state, directory / step_folder_name(step))
    kept = [s for s in step_folders(directory) if s <= step][-keep:]
    for old_step, old in step_folders(directory).items():
        if old_step not in kept:
            shutil.rmtree(old)
    for left in directory.glob(f".*{TEMPORARY_MARK}*"):
        shutil.rmtree(left, ignore_errors=True)
    return folder


# ---- one state folder ------------------------------------------------------------------------

def write_state(state: dict, folder: str | Path) -> Path:
    """`state` (module docstring) as `folder`, atomically; replaces a folder already there."""
    if not isinstance(state, dict):
        raise TypeError(f"state: expected a dict, got {type(state).__name__}")
    store = _TensorStore()
    encoded = _encode(state, (), store)  # refuses before anything is written
    with atomic_folder(folder) as temporary:
        try:
            write_safetensors(store.tensors, temporary / TENSORS_FILE, {"format": "pt"})
        except SafetensorError as error:  # how safetensors reports its I/O errors
            raise failed_write(folder, error) from error
        text = json.dumps({"format": FORMAT, "state": encoded}, allow_nan=False)
        (temporary / STATE_FILE).write_text(text + "\n", encoding="utf-8")
    return Path(folder)


def read_state(folder: str | Path) -> dict:
    """The state `write_state` wrote into `folder`, tensors on the CPU."""
    folder = Path(folder)
    if folder.is_file():
        raise ValueError(f"checkpoint: {folder} is a single file, not a checkpoint folder "
                         f"({STATE_FILE} + {TENSORS_FILE}); a single-file checkpoint.pt is "
                         "written by an older tlt_core, whose pickled checkpoints this version "
                         "does not read (unpickling one can run any code); start a new run")
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint: no checkpoint folder at {folder}")
    for name in (STATE_FILE, TENSORS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"checkpoint: {folder} has no {name}")
    damaged = ("; it was not written by tlt_core or is damaged: move this checkpoint aside to "
               "resume from an older one, or start a new run")
    try:
        record = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"checkpoint: {folder / STATE_FILE} is not valid JSON ({error}), "
                         f"expected a checkpoint's state in format {FORMAT!r}{damaged}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else None
        raise ValueError(f"checkpoint: {folder / STATE_FILE} has format {found!r}, expected "
                         f"{FORMAT!r}{damaged}")
    try:
        tensors = load_file(str(folder / TENSORS_FILE), device="cpu")
    except SafetensorError as error:
        raise ValueError(f"checkpoint: {folder / TENSORS_FILE} is not a readable safetensors "
                         f"file ({error}){damaged}") from None
    state = _decode(record.get("state"), tensors, folder)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint: {folder / STATE_FILE} holds no state dict")
    return state


@contextlib.contextmanager
def atomic_folder(folder: str | Path) -> Iterator[Path]:
    """Yields an empty temporary sibling of `folder` to write into; on a clean exit its files
    are fsync'd and it replaces `folder` (module docstring), on an exception it is deleted and
    `folder` is left as it was."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"folder: {folder} exists and is not a folder")
    temporary = _temporary_sibling(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        temporary.mkdir()
        try:
            yield temporary
            for path in sorted(temporary.rglob("*"), reverse=True):  # files before folders
                _fsync(path)
            _fsync(temporary)
            if folder.exists():  # a directory cannot be renamed over a non-empty one: swap
                previous = folder.parent / f".{folder.name}{TEMPORARY_MARK}old-{uuid.uuid4().hex}"
                folder.rename(previous)
                temporary.rename(folder)
                shutil.rmtree(previous)
            else:
                temporary.rename(folder)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        _fsync(folder.parent)
    except OSError as error:
        raise failed_write(folder, error) from error


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yields a temporary sibling of the file `path` to write; on a clean exit it is fsync'd,
    replaces `path` and the folder is fsync'd; on an exception it is deleted and `path` is left
    as it was (module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path: {path} is a folder, expected a file")
    temporary = _temporary_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            yield temporary
            _fsync(temporary)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync(path.parent)
    except OSError as error:
        raise failed_write(path, error) from error


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                      metadata: dict[str, str] | None = None) -> None:
    """tensors as a safetensors file at `path`, readable by all (mode FILE_MODE): safetensors
    writes a private temporary file and renames it, which leaves the file 0600, and a folder
    handed to a serving engine or another user must be readable as its JSON files are."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, FILE_MODE)


def failed_write(path: str | Path, error: OSError | SafetensorError) -> OSError:
    """An OSError saying that writing `path` failed and why, with error's errno (so of the same
    subclass: PermissionError for EACCES); one that does already is returned as it is."""
    if isinstance(error, OSError) and (error.strerror or str(error)).startswith(_FAILED_WRITE):
        return error
    number = getattr(error, "errno", None)
    if number is None:  # safetensors' message ends in "(os error N)"
        found = re.search(r"os error (\d+)", str(error))
        number = int(found.group(1)) if found else None
    reason = getattr(error, "strerror", None) or str(error)
    message = f"{_FAILED_WRITE}{path}: {reason}"
    return OSError(number, message) if number is not None else OSError(message)


def _temporary_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}{TEMPORARY_MARK}{os.getpid()}-{uuid.uuid4().hex}"


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ---- encoding --------------------------------------------------------------------------------

class _TensorStore:
    """The tensors of one state, keyed by path, each a contiguous CPU tensor with its own
    memory (safetensors refuses shared or strided ones)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[tuple, str] = {}  # a view already stored -> its key
        self._storages: set[int] = set()  # the memory the stored tensors own

    def add(self, tensor: torch.Tensor, path: tuple[str, ...]) -> str:
        if tensor.layout != torch.strided:
            raise TypeError(f"state: {_show(path)} is a {tensor.layout} tensor; only dense "
                            "tensors are stored")
        view = (tensor.device, tensor.dtype, tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and view in self._keys:
            return self._keys[view]
        key = "/".join(p.replace("%", "%25").replace("/", "%2F") for p in path)
        number = 2
        while key in self.tensors:  # only keys of different types print alike (3 and "3")
            key, number = f"{key}~{number}", number + 1
        cpu = tensor.detach().to("cpu")
        storage = cpu.untyped_storage()
        if not (cpu.is_contiguous() and cpu.storage_offset() == 0
                and storage.nbytes() == cpu.nbytes and storage.data_ptr() not in self._storages):
            cpu = cpu.clone(memory_format=torch.contiguous_format)
        self.tensors[key] = cpu
        self._keys[view] = key
        self._storages.add(cpu.untyped_storage().data_ptr())
        return key


def _encode(value: Any, path: tuple[str, ...], store: _TensorStore) -> Any:
    """value as JSON data, its tensors put in `store`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": store.add(value, path)}
    if type(value) is list:
        return [_encode(v, path + (str(i),), store) for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"__tuple__": [_encode(v, path + (str(i),), store) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _encode(v, path + (k,), store) for k, v in value.items()}
        return {"__dict__": [[_encode_key(k, path), _encode(v, path + (str(k),), store)]
                             for k, v in value.items()]}
    raise TypeError(f"state: {_show(path)} is a {type(value).__module__}."
                    f"{type(value).__qualname__}, which a checkpoint does not store (only dicts, "
                    "lists, tuples, tensors, ints, floats, bools, str, bytes and None)")


def _encode_key(key: Any, path: tuple[str, ...]) -> Any:
    keys = _TensorStore()  # a dict key may hold no tensor
    if isinstance(key, (str, int, float, bytes, tuple, type(None))):
        encoded = _encode(key, path, keys)
        if not keys.tensors:
            return encoded
    raise TypeError(f"state: {_show(path)} has a key of type {type(key).__name__}, which a "
                    "checkpoint does not store")


def _decode(value: Any, tensors: dict[str, torch.Tensor], folder: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, folder) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)) in _TAGS:
        (tag, content), = value.items()
        if tag == "__tensor__":
            if content not in tensors:
                raise ValueError(f"checkpoint: {folder / STATE_FILE} names tensor {content!r}, "
                                 f"which {TENSORS_FILE} lacks")
            return tensors[content]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors, folder) for v in content)
        if tag == "__float__":
            return float(content)
        if tag == "__bytes__":
            return base64.b64decode(content)
        return {_decode(k, tensors, folder): _decode(v, tensors, folder) for k, v in content}
    return {k: _decode(v, tensors, folder) for k, v in value.items()}


def _show(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "the state"
