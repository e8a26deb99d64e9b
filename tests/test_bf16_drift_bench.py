"""bench/bf16_drift.py on a tiny checkpoint: a row per bfloat16 variant that applies on this CPU,
each a proper comparison with the float32 model (KL >= 0, an agreement share), and the panel
products rounding no worse than PyTorch's bfloat16 ops by more than a small factor."""

import json
import subprocess
import sys
from pathlib import Path

from tlt_core.ops.panel_matmul import vectorised

from tests.cli_fixtures import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_rows_compare_each_bf16_variant_with_float32(tmp_path):
    model, _ = tiny_checkpoint(tmp_path, with_drafter=False)
    out = tmp_path / "drift.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bf16_drift.py"), "--model", str(model),
                    "--prompt", "t3 t4 t5", "--tokens", "12", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    assert {"forward", "step, views"} <= set(rows)
    assert ("step, panels" in rows) == vectorised()
    for row in rows.values():
        assert row["positions"] == 12
        assert 0 <= row["kl_mean"] <= row["kl_max"] < 0.1
        assert row["argmax_agreement"] >= 0.75  # rounding flips a near tie, not most tokens
    if vectorised():
        worst_torch = max(rows["forward"]["kl_mean"], rows["step, views"]["kl_mean"])
        assert rows["step, panels"]["kl_mean"] <= 3 * worst_torch + 1e-7
