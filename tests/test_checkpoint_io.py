"""Checkpoint folders (tlt_core.persistence.checkpoint_io): a nested state round-trips exactly, RNG
states included; what it cannot store is refused by path before anything is written; reading
runs no code and refuses what it cannot trust; a crash or a failed write (disk full, no
permission) mid-write leaves the previous checkpoint as it was and no temporary behind, and the
error names the path; the newest K step folders are kept."""

import collections
import errno
import json
import math
import os
import pickle
import random
import re

import pytest
import torch
from safetensors import SafetensorError, safe_open

from tests.speculative_fixtures import tiny_target
import tlt_core.persistence.checkpoint_io as checkpoint_io
from tlt_core.persistence.checkpoint_io import (STATE_FILE, TENSORS_FILE, atomic_file,
                                                atomic_folder, latest_checkpoint, read_state,
                                                step_folders, write_checkpoint, write_state)


def assert_same(a, b, path="state"):
    """Equal values of the same types all the way down (nan equals nan)."""
    assert type(a) is type(b) or isinstance(a, dict) and type(b) is dict, (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu", path
        assert torch.equal(a.cpu(), b) or a.is_floating_point() and torch.equal(
            a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def nested_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(4, 6, generator=generator)
    return {
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "policy": collections.OrderedDict(w=weights, tied=weights, half=torch.ones(3).bfloat16(),
                                          row=weights[1], columns=weights.t()),
        "optimizer": {"state": {3: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(2, 2)},
                                0: {"step": torch.tensor(1.0)}},
                      "param_groups": [{"betas": (0.9, 0.95), "params": [0, 3], "lr": 5e-5,
                                        "fused": None, "amsgrad": False}]},
        "floats": [math.inf, -math.inf, math.nan, -0.0, 1e-310, 0.1, 2 ** 0.5],
        "ints": [0, -1, 2 ** 80, True, False],
        "text": ["", "ünïcode", "a/b%c"],
        "bytes": b"\x00\xffbandit",
        "empty": {"list": [], "tuple": (), "dict": {}, "tensor": torch.zeros(0, 3),
                  "scalar": torch.tensor(7, dtype=torch.int64)},
        "keys": {"a/b": torch.ones(1), "__tuple__": [1, 2], (1, "x"): "tuple key", None: 0},
        "nested": [({"deep": (1, [2.5, None])},)],
        "flags": torch.tensor([True, False]),
    }


def test_nested_state_round_trips_exactly(tmp_path):
    state = nested_state()
    write_state(state, tmp_path / "c")
    back = read_state(tmp_path / "c")
    assert_same(state, back)
    assert type(back["rng"]["python"]) is tuple and type(back["rng"]["python"][1]) is tuple
    assert list(back["optimizer"]["state"]) == [3, 0]  # int keys, in order
    random.setstate(back["rng"]["python"])
    after_resume = [random.random() for _ in range(3)]
    random.setstate(state["rng"]["python"])
    assert after_resume == [random.random() for _ in range(3)]
    torch.set_rng_state(back["rng"]["torch"])
    resumed_draws = torch.rand(5)
    torch.set_rng_state(state["rng"]["torch"])
    assert torch.equal(resumed_draws, torch.rand(5))
    # state.json is strict JSON: no NaN or Infinity tokens, which JSON does not have
    json.loads((tmp_path / "c" / STATE_FILE).read_text(),
               parse_constant=lambda token: pytest.fail(f"non-JSON token {token}"))


def test_tensors_are_keyed_by_path_and_a_shared_view_is_stored_once(tmp_path):
    write_state(nested_state(), tmp_path / "c")
    with safe_open(str(tmp_path / "c" / TENSORS_FILE), framework="pt") as reader:
        keys = set(reader.keys())
    assert {"optimizer/state/3/exp_avg", "policy/w", "keys/a%2Fb", "rng/torch"} <= keys
    assert "policy/tied" not in keys  # the same view as policy/w: one copy on disk
    back = read_state(tmp_path / "c")
    assert back["policy"]["tied"] is back["policy"]["w"]
    assert back["rng"]["torch"].dtype == torch.uint8

    policy = tiny_target()
    policy.fuse_projections_()  # q|k|v and gate|up as views of one tensor (the CUDA layout)
    write_state({"policy": policy.state_dict()}, tmp_path / "fused")
    back = read_state(tmp_path / "fused")["policy"]
    assert all(torch.equal(back[k], v) for k, v in policy.state_dict().items())


class Point(collections.namedtuple("Point", "x y")):
    pass


@pytest.mark.parametrize("bad, path", [
    ({"a": {"b": [1, object()]}}, "a/b/1"),
    ({"optimizer": {"state": {2: Point(1, 2)}}}, "optimizer/state/2"),  # its field names
    ({"s": {1, 2}}, "s"),
    ({"m": {object(): 1}}, "m"),
    ({"k": {(torch.ones(1),): 1}}, "k"),  # a tensor inside a key
])
def test_what_a_checkpoint_cannot_store_is_refused_by_its_path(tmp_path, bad, path):
    with pytest.raises(TypeError, match=f"state: {path} "):
        write_state(bad, tmp_path / "c")
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())
    with pytest.raises(TypeError, match="state: expected a dict"):
        write_state([1], tmp_path / "c")


def test_reading_refuses_what_it_cannot_trust(tmp_path):
    torch.save({"step": 1}, tmp_path / "checkpoint.pt")  # a pickle: never unpickled
    with pytest.raises(ValueError, match="written by an older tlt_core.*start a new run"):
        read_state(tmp_path / "checkpoint.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        read_state(tmp_path / "missing")
    folder = write_state({"w": torch.ones(2)}, tmp_path / "c")
    record = json.loads((folder / STATE_FILE).read_text())
    (folder / STATE_FILE).write_text(json.dumps({**record, "format": "other/9"}))
    with pytest.raises(ValueError, match="format 'other/9'"):
        read_state(folder)
    (folder / STATE_FILE).write_text(json.dumps({**record, "state": {"w": {"__tensor__": "x"}}}))
    with pytest.raises(ValueError, match="names tensor 'x'"):
        read_state(folder)
    (folder / STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_state(folder)
    (folder / TENSORS_FILE).write_bytes(b"garbage")
    (folder / STATE_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="not a readable safetensors"):
        read_state(folder)
    (folder / TENSORS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=TENSORS_FILE):
        read_state(folder)


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    first = write_checkpoint(directory, 1, {"w": torch.ones(3), "step": 1})
    assert first == directory / "step-000001"

    def crash(tensors, path, metadata=None):  # half a file, then the process "dies"
        with open(path, "wb") as handle:
            handle.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_io, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(directory, 2, {"w": torch.zeros(3), "step": 2})
    monkeypatch.undo()
    assert latest_checkpoint(directory) == first and list(directory.iterdir()) == [first]
    assert_same(read_state(first), {"w": torch.ones(3), "step": 1})
    with pytest.raises(RuntimeError), atomic_folder(first) as temporary:  # replacing in place
        (temporary / STATE_FILE).write_text("{}")
        raise RuntimeError("crash while writing")
    assert_same(read_state(first), {"w": torch.ones(3), "step": 1})
    # what a killed process leaves: a temporary folder, a step folder without its state
    (directory / ".step-000003.tmp-123-abc").mkdir()
    (directory / ".step-000003.tmp-123-abc" / STATE_FILE).write_text("{}")
    (directory / "step-000004").mkdir()
    assert latest_checkpoint(directory) == first and list(step_folders(directory)) == [1]
    write_checkpoint(directory, 2, {"step": 2})  # the next write clears the temporary folder
    assert sorted(p.name for p in directory.iterdir()) == ["step-000001", "step-000002",
                                                           "step-000004"]


class Payload:
    """Unpickled, it creates `marker`: what a planted checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_nothing_loaded_runs_code_from_a_planted_pickle(tmp_path):
    """A pickle with a payload, planted as a single-file checkpoint or as either file of a
    checkpoint folder, is refused with what was expected, and its payload never runs."""
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(Payload(live)))  # the payload is real: unpickling runs it
    assert live.exists()
    marker = tmp_path / "ran"
    torch.save({"step": 1, "x": Payload(marker)}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="single file, not a checkpoint folder.*older tlt_core"):
        read_state(tmp_path / "checkpoint.pt")
    for name in (STATE_FILE, TENSORS_FILE):
        folder = write_state({"w": torch.ones(2)}, tmp_path / name)
        torch.save({"x": Payload(marker)}, folder / name)
        with pytest.raises(ValueError, match=f"{name} is not .*not written by tlt_core"):
            read_state(folder)
    assert not marker.exists()


def test_nothing_a_user_gave_is_lost_when_a_write_fails(tmp_path, monkeypatch):
    """Disk full or no permission while writing a checkpoint: an OSError of that errno naming
    the step folder; the previous checkpoint as it was; no temporary folder or file left."""
    directory = tmp_path / "checkpoints"
    first = write_checkpoint(directory, 1, {"w": torch.ones(3), "step": 1})
    step2 = re.escape(str(directory / "step-000002"))

    def disk_full(tensors, path, metadata=None):  # half a file, then ENOSPC
        with open(path, "wb") as handle:
            handle.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    failures = [(disk_full, OSError, errno.ENOSPC, "No space left on device"),
                (SafetensorError("Error while serializing: I/O error: No space left on device "
                                 "(os error 28)"), OSError, errno.ENOSPC, "os error 28"),
                (PermissionError(errno.EACCES, "Permission denied"), PermissionError,
                 errno.EACCES, "Permission denied")]
    for failure, kind, number, reason in failures:
        if isinstance(failure, BaseException):
            def failure(tensors, path, metadata=None, error=failure):
                raise error
        monkeypatch.setattr(checkpoint_io, "save_file", failure)
        with pytest.raises(kind, match=f"cannot write {step2}: .*{reason}") as caught:
            write_checkpoint(directory, 2, {"w": torch.zeros(3), "step": 2})
        assert caught.value.errno == number
        assert list(directory.iterdir()) == [first]
        assert_same(read_state(first), {"w": torch.ones(3), "step": 1})
    monkeypatch.undo()

    path = tmp_path / "notes.json"
    path.write_text("before")
    with pytest.raises(OSError, match=f"cannot write {re.escape(str(path))}: No space"), \
            atomic_file(path) as temporary:
        temporary.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert path.read_text() == "before"
    with atomic_file(path) as temporary:
        temporary.write_text("after")
    assert path.read_text() == "after"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "notes.json"]


def test_the_newest_k_step_folders_are_kept(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    synced = []
    real_fsync = checkpoint_io._fsync
    monkeypatch.setattr(checkpoint_io, "_fsync", lambda path: synced.append(path.name)
                        or real_fsync(path))
    for step in range(1, 6):
        write_checkpoint(directory, step, {"step": step}, keep=2)
        assert list(step_folders(directory)) == [max(1, step - 1), step][-min(step, 2):]
    assert {STATE_FILE, TENSORS_FILE, "checkpoints"} <= set(synced)  # files, folder, parent
    assert read_state(latest_checkpoint(directory))["step"] == 5
    write_checkpoint(directory, 6, {"step": 6}, keep=3)
    assert list(step_folders(directory)) == [4, 5, 6]
    # a fresh run in the same folder: the abandoned run's later steps go, so that
    # latest_checkpoint is the checkpoint just written
    write_checkpoint(directory, 1, {"step": 1}, keep=2)
    assert list(step_folders(directory)) == [1] and latest_checkpoint(tmp_path / "none") is None
    for keep in (0, 1.5, True):
        with pytest.raises(ValueError, match="keep"):
            write_checkpoint(directory, 2, {}, keep=keep)
    with pytest.raises(ValueError, match="step"):
        write_checkpoint(directory, -1, {})


def test_every_safetensors_file_is_readable_by_all(tmp_path, target):
    """safetensors writes a private temporary file and renames it (0600): the policy folder,
    the drafter folder and the checkpoint tensors a person hands on come out 0644."""
    import stat

    from tlt_core.drafting.drafter import Drafter, DrafterConfig
    from tlt_core.model.checkpoint import save_checkpoint

    save_checkpoint(target, tmp_path / "policy")
    Drafter(target, DrafterConfig()).save(tmp_path / "drafter")
    checkpoint_io.write_state({"w": torch.ones(2)}, tmp_path / "state")
    checkpoint_io.write_safetensors({"w": torch.ones(2)}, tmp_path / "one.safetensors")
    files = [tmp_path / "one.safetensors", tmp_path / "state" / TENSORS_FILE,
             *(tmp_path / "policy").glob("*.safetensors"),
             *(tmp_path / "drafter").glob("*.safetensors")]
    assert len(files) == 4
    assert {stat.S_IMODE(path.stat().st_mode) for path in files} == {0o644}
