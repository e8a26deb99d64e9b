"""The one prepared GPU command, bench/gpu_check.sh, exercised on the CPU: `--device cpu` runs
the stages that need no GPU (the environment record and bench/gpu_decode.py on its tiny shape)
and writes what the GPU run writes, with the fields readers rely on; a stage that fails, or
that the time budget leaves no room for, fails the check without stopping the stages after it;
bad arguments are named. About 15 s on 2 cores.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STAGES = ("build", "environment", "gpu_tests", "decode", "sampling_kernel", "kernels_bench",
          "rollout")


def run_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    return out, run_check(str(out), "--device", "cpu")


@pytest.mark.slow  # runs the whole script's CPU stages (20 s)
def test_cpu_check_passes_and_writes_the_summary_and_logs(cpu_check):
    out, done = cpu_check
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "decode_cpu.json", "environment.json", "logs.tar.gz", "summary.json"]
    result = summary(out)
    assert result["exit_status"] == 0 and result["failed"] == []
    status = {stage["name"]: stage["status"] for stage in result["stages"]}
    assert list(status) == list(STAGES)
    assert status == {"build": "skipped", "environment": "ok", "gpu_tests": "skipped",
                      "decode": "ok", "sampling_kernel": "skipped", "kernels_bench": "skipped",
                      "rollout": "skipped"}
    assert all(stage["why"] for stage in result["stages"] if stage["status"] == "skipped")
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {Path(name).name for name in tar.getnames()}
    assert {"environment.log", "decode.log"} <= logs
    assert "PASSED" in done.stdout


@pytest.mark.slow  # runs the whole script's CPU stages (20 s)
def test_cpu_check_environment_names_versions_and_attention_backends(cpu_check):
    out, _ = cpu_check
    env = json.loads((out / "environment.json").read_text())
    assert env["device"]["type"] == "cpu"
    for key in ("python", "torch", "cuda", "cudnn", "nvcc", "transformers",
                "tlt_core_built_with_cuda"):
        assert key in env["software"]
    cases = {(row["B"], row["T"]) for row in env["sdpa"]}
    assert cases == {(1, 1), (1, 8), (16, 1), (16, 8)}
    for row in env["sdpa"]:
        assert (row["H_q"], row["H_kv"], row["head_dim"], row["dtype"]) == (28, 4, 128,
                                                                          "bfloat16")
        assert set(row["enable_gqa"]) == {"flash", "efficient", "cudnn", "math"}
        assert row["enable_gqa"]["math"]["ok"]  # math always runs
        for result in row["enable_gqa"].values():
            assert result["ok"] or result["error"]
        assert row["default"]["masked"] != "unknown"


@pytest.mark.slow  # runs the whole script's CPU stages (20 s)
def test_cpu_check_decode_measures_every_path_on_the_tiny_shape(cpu_check):
    out, _ = cpu_check
    decode = json.loads((out / "decode_cpu.json").read_text())
    assert decode["complete"] and decode["in_progress"] is None
    assert decode["device"]["type"] == "cpu" and decode["software"]["transformers"]
    assert any("acceptance" in note for note in decode["notes"])
    tiny = decode["shapes"]["tiny"]
    rows = {(row["path"], row["batch"]): row for row in tiny["decode"]}
    graphs = decode["engine_graphs_api"]["graphs"]
    for batch in (1, 4):
        for path in ("ours_eager", "hf_dynamic", "hf_static"):
            row = rows[path, batch]
            assert row["status"] == "ok", row
            assert row["step_s"] > 0 and row["tokens_per_s"] > 0
            assert row["prefill_peak_bytes"] > 0 and row["decode_peak_bytes"] > 0
        assert rows["ours_graphs", batch]["status"] == ("ok" if graphs else "unavailable")
    assert rows["hf_static_compiled", 1]["status"] == "skipped"  # CUDA only
    check = tiny["hf_logits_check"]  # the same weights in transformers' model
    assert check["max_abs_diff"] < 1e-4 and check["argmax_agreement"] == 1.0
    assert all(r["bytes_per_step"] > r["weight_bytes"] == tiny["weight_bytes_per_step"]
               for r in tiny["roofline"])
    calls = {c["path"]: c for c in tiny["calls_per_step"]}
    for path in ("ours_eager", "hf_dynamic", "hf_static"):
        assert calls[path]["aten_ops"] > 0 and calls[path]["host_syncs"] == 0  # no CUDA here
    spec = [row for row in tiny["speculative"] if row["path"] == "ours_eager"]
    assert {(row["batch"], row["strategy"]) for row in spec} == {
        (1, "(3,1,4)"), (1, "(5,1,6)"), (4, "(3,1,4)"), (4, "(5,1,6)")}
    for row in spec:
        assert row["status"] == "ok", row
        assert row["spec_steps"] > 0 and row["plain_step_s"] > 0
        assert row["break_even_acceptance"] == pytest.approx(
            (row["draft_s"] + row["verify_s"] + row["accept_s"]) / row["plain_step_s"])
    assert tiny["targets"] and not any(t["binding"] for t in tiny["targets"])


def test_a_failing_stage_fails_the_check_and_later_stages_still_run(tmp_path):
    done = run_check(str(tmp_path), "--device", "cpu", env={"PYTHON": "false"})
    assert done.returncode == 1
    result = summary(tmp_path)
    status = {stage["name"]: stage["status"] for stage in result["stages"]}
    assert status["environment"] == "failed" and status["decode"] == "failed"
    assert result["failed"] == ["environment", "decode"]
    assert "FAILED: environment decode" in done.stdout
    assert (tmp_path / "logs.tar.gz").exists()


def test_a_stage_the_budget_has_no_room_for_is_dropped_and_fails_the_check(tmp_path):
    done = run_check(str(tmp_path), "--device", "cpu", env={"TLT_GPU_CHECK_BUDGET_S": "20"})
    assert done.returncode == 1
    stages = {stage["name"]: stage for stage in summary(tmp_path)["stages"]}
    for name in ("environment", "decode"):
        assert stages[name]["status"] == "dropped"
        assert "budget" in stages[name]["why"]


def test_bad_arguments_are_named(tmp_path, capsys):
    done = run_check(str(tmp_path), "--device", "tpu")
    assert done.returncode == 2 and "--device" in done.stderr
    done = run_check()
    assert done.returncode == 2 and "usage" in done.stderr
    done = run_check("--help")
    assert done.returncode == 0 and "OUT_DIR receives at most six files" in done.stdout
    decode = _load_bench_script("gpu_decode")
    for argv, named in ((["--shape", "13b"], "--shape"), (["--new-tokens", "1"], "--new-tokens"),
                        (["--batches", "0,4"], "--batches")):
        with pytest.raises(SystemExit):
            decode.parse_args(["--device", "cpu", *argv])
        assert named in capsys.readouterr().err


def _load_bench_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module
