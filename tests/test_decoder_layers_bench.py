"""bench/decoder_layers.py on a tiny checkpoint: a row per case, the pass timed with the layers
in one kernel call and one by one, and far fewer of PyTorch's ops dispatched with one call."""

import json
import subprocess
import sys
from pathlib import Path

from tests.cli_fixtures import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_rows_time_the_pass_in_one_call_and_one_by_one(tmp_path):
    model, _ = tiny_checkpoint(tmp_path, with_drafter=False)
    out = tmp_path / "decoder_layers.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "decoder_layers.py"), "--model",
                    str(model), "--reps", "2", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.read_text())
    assert result["model"].endswith("(bfloat16)")
    rows = result["rows"]
    assert [(r["batch"], r["context"], r["tokens"]) for r in rows] == [
        (1, 200, 1), (1, 200, 3), (1, 200, 8), (1, 200, 16), (1, 800, 1), (4, 200, 1),
        (16, 200, 1), (64, 200, 1)]
    layers = 2  # the tiny checkpoint's: each layer's dozen ops or more go into the one call
    for row in rows:
        assert row["one_call_ms"] > 0 and row["one_by_one_ms"] > 0
        assert row["speedup"] == row["one_by_one_ms"] / row["one_call_ms"]
        assert row["aten_ops_one_call"] + 10 * layers <= row["aten_ops_one_by_one"]
