"""bench/sampling_kernel.py runs on the CPU at a small vocabulary and writes a row per case with
positive times; its PyTorch baseline accepts the same drafts as the fused kernel (same uniforms),
so the speed it is compared with is the speed of the same computation."""

import json

import pytest

from tests.bench_scripts import load_bench


def test_cpu_run_writes_a_row_per_case(tmp_path):
    bench = load_bench("sampling_kernel")
    out = tmp_path / "sampling_kernel_cpu.json"
    assert bench.main(["--device", "cpu", "--vocab", "512", "--batch", "1,4", "--nodes", "1,4",
                       "--warmup", "1", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["vocab"] == 512 and result["config"]["device"] == "cpu"
    rows = result["rows"]
    assert {(r["B"], r["N"], r["mode"]) for r in rows} == {
        (b, n, "eager") for b in (1, 4) for n in (1, 4)}
    for r in rows:
        assert r["V"] == 512 and r["ours_ms"] > 0 and r["baseline_ms"] > 0
        assert r["ratio"] == pytest.approx(r["baseline_ms"] / r["ours_ms"])
        assert r["accepted"] == r["baseline_accepted"]
        assert r["portable_ms"] > 0
        assert r["portable_ratio"] == pytest.approx(r["portable_ms"] / r["ours_ms"])


def test_bad_arguments_are_named(capsys):
    bench = load_bench("sampling_kernel")
    for argv, named in ((["--batch", "0,4"], "--batch"), (["--modes", "graph"], "--modes"),
                        (["--top-p", "1.5"], "--top-p")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", *argv])
        assert named in capsys.readouterr().err
