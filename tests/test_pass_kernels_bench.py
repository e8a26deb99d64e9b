"""bench/pass_kernels.py on a tiny checkpoint: a row per case, each with the attention call and
the pass timed with both CPU kernels called one by one, without each, without either and with
the decoder layers in one call, and fewer of PyTorch's ops left with the kernels than without,
fewest in one call."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_fixtures import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_time_the_pass_with_and_without_each_kernel(dtype, tmp_path):
    model, _ = tiny_checkpoint(tmp_path, with_drafter=False)
    out = tmp_path / "pass_kernels.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "pass_kernels.py"), "--model",
                    str(model), "--dtype", dtype, "--reps", "3", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["batch"], r["context"], r["tokens"]) for r in rows] == [
        (1, 200, 1), (1, 200, 5), (1, 200, 16), (1, 800, 1), (1, 800, 5), (16, 200, 1),
        (64, 200, 1)]
    for row in rows:
        for key in ("kernel_us", "pytorch_us", "pass_one_call_ms", "pass_both_ms",
                    "pass_no_attention_ms", "pass_no_silu_mul_ms", "pass_neither_ms"):
            assert row[key] > 0, key
        assert row["pass_speedup_both"] == row["pass_neither_ms"] / row["pass_both_ms"]
        assert row["pass_speedup_one_call"] == row["pass_both_ms"] / row["pass_one_call_ms"]
        # the kernels take ops out of PyTorch's hands: fewer are left there (counted: their
        # time on a tiny model is a fraction of a millisecond, which load moves either way)
        assert row["aten_ops_both"] < row["aten_ops_neither"]
        assert row["aten_both_ms"] > 0 and row["aten_neither_ms"] > 0
        # bf16 panels fit the one call; float32 folds its norms and goes one by one
        assert row["one_call_fits"] == (dtype == "bfloat16" and result["layout"] == "panels")
        if row["one_call_fits"]:  # each of the 2 layers' dozen ops or more in one call
            assert row["aten_ops_one_call"] + 20 <= row["aten_ops_both"]
        else:
            assert row["aten_ops_one_call"] == row["aten_ops_both"]
