"""wandb, the optional logger (tlt_core.outputs.wandb_logger): an offline run holds exactly the
scalars of metrics.jsonl under the same names, at wandb step = the record's step, and the
response lengths as a histogram; a resumed run continues the same wandb run, logging only the
steps it lacks; the run is finished (failed when an exception ended it); rank != 0 writes
nothing; without the package the error says `pip install wandb`; `tlt train --wandb-project`
writes a run, and --overwrite clears it.

Offline runs are read back from wandb's own `run-ID.wandb` files (the LevelDB log format, each
record a protobuf `Record`), since the installed wandb ships no reader of them."""

import json
import struct
import subprocess
import sys
import time
import types
import zlib
from pathlib import Path

import pytest

from tlt_core.outputs.metrics import METRICS, RECORD_FIELDS, MetricsWriter
from tlt_core.outputs.wandb_logger import (WANDB_DIR, WANDB_RUN_ID_FILE, WandbError, WandbLogger,
                                           WandbSettings, wandb_available)

needs_wandb = pytest.mark.skipif(not wandb_available(), reason="the wandb package is not "
                                 "installed (pip install wandb)")

OFFLINE = WandbSettings("tlt-test", mode="offline", run_name="tiny", group="tiny-group",
                        config={"lr": 5e-5, "tlt": True})
BUCKET = next(name for name in METRICS if name.startswith("spec/acceptance_length/"))


def fake_records(steps: int) -> list[dict]:
    """Step records as RLDriver.step() returns them (every key of both tables), with values
    that say which step and metric they are; spec/acceptance_length is null in step 1 (no
    speculative step) and so is every bucket but BUCKET."""
    records = []
    for step in range(steps):
        record = {name: None for name in RECORD_FIELDS} | {"step": step}
        for index, name in enumerate(METRICS):
            record[name] = None if name.startswith("spec/acceptance_length/") else \
                round(step + index / 100 + 0.123456789, 9)
        record.update({"drafter/version": step, "drafter/spot_steps": 3 * step,
                       "train/reward_errors": 0, "response_lengths": [4, 9, 9, 30 + step],
                       "trace_time_s": [0.1, 0.2], "trace_running": [4, 1],
                       "drafter_event": "ok"})
        record[BUCKET] = 2.5 + step
        if step == 1:
            record["spec/acceptance_length"] = None
        records.append(record)
    return records


@pytest.fixture(autouse=True)
def wandb_home(tmp_path, monkeypatch):
    """wandb's caches, settings and logs under tmp_path, never the home directory."""
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)


# ---- reading an offline run back -------------------------------------------------------------

_BLOCK = 32768  # the LevelDB log's block size; a record header is 7 bytes: crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """The protobuf Records of a run-ID.wandb file, checksums checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    records, payload, position = [], b"", 7
    while position + 7 <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < 7:  # a block's tail too short for a header is zero padding
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (checksum, length, kind) == (0, 0, 0):  # zeroes past the last record
            break
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, path
        payload = chunk if kind in (_FULL, _FIRST) else payload + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
    return records


def _finished(path: Path) -> bool:
    try:
        records = read_records(path)
    except (AssertionError, struct.error):  # a record not yet written whole
        return False
    return bool(records) and records[-1].WhichOneof("record_type") == "exit"


def offline_runs(folder: Path) -> list[Path]:
    """The run-ID.wandb files of folder's offline runs, oldest first, once each is complete:
    wandb-core writes a file out after `finish` has returned (the exit record comes last)."""
    deadline = time.monotonic() + 60
    while True:
        files = sorted((folder / WANDB_DIR).glob("offline-run-*/run-*.wandb"),
                       key=lambda path: path.parent.name)
        if files and all(_finished(path) for path in files):
            return files
        assert time.monotonic() < deadline, \
            f"no complete offline run under {folder / WANDB_DIR} after 60 s: {files}"
        time.sleep(0.05)


def history(path: Path) -> dict[int, dict]:
    """step -> {name: value} of what the run logged (wandb's own _step, _runtime, _timestamp
    left out; a histogram as {"_type", "values", "bins"})."""
    steps = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        logged: dict = {}
        for item in record.history.item:
            # a name, or a histogram's part: ("response_lengths", "bins")
            name, *part = [item.key] if item.key else item.nested_key
            if name.startswith("_"):
                continue
            value = json.loads(item.value_json)
            if part:
                logged.setdefault(name, {})[part[0]] = value
            else:
                logged[name] = value
        steps[record.history.step.num] = logged
    return steps


def run_record(path: Path):
    """The run's own record (id, project, name, group, config) and its exit code."""
    records = read_records(path)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    return run, exits


def config_of(run) -> dict:
    """The run's config, wandb's own `_wandb` entry left out."""
    return {item.key: json.loads(item.value_json) for item in run.config.update
            if not item.key.startswith("_")}


# ---- the logger -------------------------------------------------------------------------------

def expected_scalars(record: dict) -> dict:
    return {name: record[name] for name in METRICS if record[name] is not None}


@needs_wandb
def test_an_offline_run_holds_the_metrics_under_their_names(tmp_path):
    """About a second: wandb's start-up (its service process) in this process."""
    records = fake_records(3)
    with MetricsWriter(tmp_path, wandb=OFFLINE) as writer:
        assert writer.wandb.offline and writer.wandb.url is None
        run_id = writer.wandb.run_id
        for record in records:
            writer.write(record)
    assert writer.wandb is None  # finished
    (path,) = offline_runs(tmp_path)
    assert path.name == f"run-{run_id}.wandb"
    assert (tmp_path / WANDB_RUN_ID_FILE).read_text() == run_id + "\n"
    logged = history(path)
    assert sorted(logged) == [0, 1, 2]  # wandb step = the record's step
    for record in records:
        step = logged[record["step"]]
        histogram = step.pop("response_lengths")
        assert step == expected_scalars(record)  # exact names and values; nulls not logged
        assert histogram["_type"] == "histogram"
        assert sum(histogram["values"]) == len(record["response_lengths"])
        assert (histogram["bins"][0], histogram["bins"][-1]) == \
            (min(record["response_lengths"]), max(record["response_lengths"]))
    assert logged[0]["train/reward"] == records[0]["train/reward"] == 0.123456789
    assert logged[2][BUCKET] == 4.5
    assert "spec/acceptance_length" not in logged[1]
    run, exits = run_record(path)
    assert (run.run_id, run.project, run.display_name, run.run_group) == \
        (run_id, "tlt-test", "tiny", "tiny-group")
    assert config_of(run) == {"lr": 5e-5, "tlt": True}
    assert exits == [0]


@needs_wandb
def test_a_resumed_writer_continues_the_same_run(tmp_path):
    """An attempt interrupted after 2 steps is finished as failed; the resumed writer continues
    its id in a second offline folder holding only the new step (offline, wandb cannot know
    what the first folder holds); a fresh run makes a new id, deleting the earlier files."""
    records = fake_records(3)
    with pytest.raises(KeyboardInterrupt):
        with MetricsWriter(tmp_path, wandb=OFFLINE) as writer:
            first_id = writer.wandb.run_id
            for record in records[:2]:
                writer.write(record)
            raise KeyboardInterrupt
    with MetricsWriter(tmp_path, wandb=OFFLINE, history=records[:2]) as writer:
        assert writer.wandb.run_id == first_id
        writer.write(records[2])
    first, second = offline_runs(tmp_path)
    assert [run_record(path)[0].run_id for path in (first, second)] == [first_id, first_id]
    assert [run_record(path)[1] for path in (first, second)] == [[1], [0]]
    assert sorted(history(first)) == [0, 1] and sorted(history(second)) == [2]
    assert (tmp_path / WANDB_RUN_ID_FILE).read_text() == first_id + "\n"

    with MetricsWriter(tmp_path, wandb=OFFLINE) as writer:  # fresh
        fresh_id = writer.wandb.run_id
        writer.write(records[0])
    (path,) = offline_runs(tmp_path)
    assert fresh_id != first_id and path.name == f"run-{fresh_id}.wandb"


@needs_wandb
def test_a_resumed_run_without_an_id_logs_its_history_to_a_new_run(tmp_path):
    """The earlier attempts ran without wandb: the new run gets every step."""
    records = fake_records(3)
    with MetricsWriter(tmp_path) as writer:
        for record in records[:2]:
            writer.write(record)
    with MetricsWriter(tmp_path, wandb=OFFLINE, history=records[:2]) as writer:
        writer.write(records[2])
    (path,) = offline_runs(tmp_path)
    logged = history(path)
    assert sorted(logged) == [0, 1, 2]
    assert {name: value for name, value in logged[1].items() if name in METRICS} == \
        expected_scalars(records[1])


class FakeWandb(types.ModuleType):
    """Just what WandbLogger calls, recording it: an online run that the server holds with
    `starting_step` steps, or an init that fails as wandb does when not logged in."""

    class Error(Exception):
        pass

    def __init__(self, *, starting_step: int = 0, fail: str | None = None):
        super().__init__("wandb")
        self.errors = types.SimpleNamespace(Error=FakeWandb.Error)
        self.starting_step, self.fail = starting_step, fail
        self.init_arguments, self.logged, self.exit_codes = None, [], []

    def Settings(self, **settings):  # noqa: N802 (wandb's name)
        return settings

    def setup(self, settings):
        pass

    def Histogram(self, values):  # noqa: N802
        return ("histogram", values)

    def init(self, **arguments):
        if self.fail:
            raise FakeWandb.Error(self.fail)
        self.init_arguments = arguments
        fake = self
        run_id = arguments["id"] or "newid123"

        class Run:
            id, resumed, starting_step = run_id, arguments["id"] is not None, fake.starting_step
            offline, url = False, f"https://wandb.example/runs/{run_id}"

            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self, exit_code):
                fake.exit_codes.append(exit_code)

        return Run()


def test_an_online_resume_logs_only_the_steps_the_server_lacks(tmp_path, monkeypatch):
    """The server holds steps 0-1 of the run; steps 2 (checkpointed, never logged) and 3 follow.
    Cheap: a stand-in for wandb records the calls."""
    records = fake_records(4)
    fake = FakeWandb(starting_step=2)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / WANDB_RUN_ID_FILE).write_text("abc12345\n")
    online = WandbSettings("tlt-test", mode="online", run_name="tiny")
    with MetricsWriter(tmp_path, wandb=online, history=records[:3]) as writer:
        writer.write(records[3])
    assert (fake.init_arguments["id"], fake.init_arguments["resume"]) == ("abc12345", "allow")
    assert [step for step, _ in fake.logged] == [2, 3]
    assert fake.logged[0][1] == expected_scalars(records[2]) | \
        {"response_lengths": ("histogram", records[2]["response_lengths"])}
    assert fake.exit_codes == [0]


def test_a_run_wandb_cannot_start_names_the_fix_and_writes_no_id(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail="No API key configured."))
    with pytest.raises(WandbError, match=r"No API key configured\. \(log in with `wandb login`, "
                                         r"or log offline"):
        MetricsWriter(tmp_path, wandb=WandbSettings("tlt-test", mode="online"))
    assert not (tmp_path / WANDB_RUN_ID_FILE).exists()


def test_without_wandb_the_error_says_pip_install_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbLogger(tmp_path, OFFLINE)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsWriter(tmp_path / "run", wandb=OFFLINE)
    MetricsWriter(tmp_path / "rank1", wandb=OFFLINE, enabled=False).write(fake_records(1)[0])
    assert not (tmp_path / "rank1").exists()  # rank != 0: nothing, not even an import

    from tests.test_run_folder import tiny_train_argv, tiny_train_inputs
    from tlt_core.cli import main

    model, data = tiny_train_inputs(tmp_path)
    with pytest.raises(SystemExit, match=r"tlt train: --wandb-project: the wandb package is not "
                                         r"installed \(pip install wandb\)"):
        main(tiny_train_argv(model, data, tmp_path / "cli", "--steps", "1", "--wandb-project",
                             "tlt-test"))


# Run in a child process: an audit hook, once added, stays for the life of the process.
# wandb's telemetry may export as the process exits: each event is written out at once.
_WATCHED_RUN = """
import os, socket, sys
netrc = sys.argv[2]
def watch(event, args):
    if event == "open" and str(args[0]) == netrc or \\
            event in ("socket.getaddrinfo", "socket.connect") and \\
            not (event == "socket.connect" and args[0].family == socket.AF_UNIX):
        os.write(2, f"TOUCHED {event} {args[:2]!r}\\n".encode())
sys.addaudithook(watch)
from tlt_core.outputs.metrics import MetricsWriter, METRICS
from tlt_core.outputs.wandb_logger import WandbSettings
with MetricsWriter(sys.argv[1], wandb=WandbSettings("tlt-test", mode="offline")) as writer:
    writer.write({"step": 0, **{name: 1.0 for name in METRICS}, "response_lengths": [3]})
"""


@needs_wandb
@pytest.mark.slow
def test_an_offline_run_reads_no_login_and_reaches_no_server(tmp_path, monkeypatch):
    """With a login in ~/.netrc, an offline run's process neither opens it nor resolves or
    connects to a host (wandb's usage telemetry would, were its process-wide mode left online).
    wandb-core, a process of its own, is outside the audit hook."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    (home / ".netrc").chmod(0o600)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    child = subprocess.run([sys.executable, "-c", _WATCHED_RUN, str(tmp_path / "run"),
                            str(home / ".netrc")], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert "TOUCHED" not in child.stderr, child.stderr
    (path,) = offline_runs(tmp_path / "run")
    assert sorted(history(path)) == [0]


def test_settings_name_the_bad_field():
    with pytest.raises(ValueError, match="project: must be a non-empty str"):
        WandbSettings("")
    with pytest.raises(ValueError, match="mode: must be one of online, offline or None, got "
                                         "'disabled'"):
        WandbSettings("p", mode="disabled")


@needs_wandb
@pytest.mark.slow
def test_tlt_train_writes_an_offline_run_and_overwrite_clears_it(tmp_path, caplog):
    """The embedded default, one small step: the run holds the step's metrics.jsonl scalars,
    named after --out, with the run's config; --overwrite's clear_run deletes wandb's files."""
    from tlt_core.cli import main
    from tlt_core.outputs.run_folder import clear_run, run_parts

    out = tmp_path / "run"
    assert main(["train", "--steps", "1", "--prompts-per-step", "2", "--samples-per-prompt",
                 "2", "--max-new-tokens", "16", "--wandb-project", "test", "--wandb-mode",
                 "offline", "--no-progress", "--nproc", "1", "--out", str(out)]) == 0
    (path,) = offline_runs(out)
    run_id = (out / WANDB_RUN_ID_FILE).read_text().strip()
    assert f"wandb: run {run_id} of project test, offline in {out / WANDB_DIR}" in caplog.text
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = history(path)
    assert sorted(logged) == [0]
    assert {n: v for n, v in logged[0].items() if n in METRICS} == expected_scalars(record)
    run, exits = run_record(path)
    assert (run.run_id, run.project, run.display_name, run.run_group, exits) == \
        (run_id, "test", "run", "", [0])
    assert config_of(run)["steps"] == 1 and config_of(run)["tlt"] is True

    (out / "notes.txt").write_text("the user's own file")
    assert {out / WANDB_DIR, out / WANDB_RUN_ID_FILE} <= set(run_parts(out))
    clear_run(out)
    assert not run_parts(out)
    assert not (out / WANDB_DIR).exists() and not (out / WANDB_RUN_ID_FILE).exists()
    assert (out / "notes.txt").read_text() == "the user's own file"
