"""bench/draft_sample.py runs at a small vocabulary and writes a row per case in which the kernel
and the tensor ops drew the same ids and wrote the same q to rounding."""

import json

import pytest

from tests.bench_scripts import load_bench


@pytest.mark.parametrize("greedy", [False, True])
def test_a_row_per_case_with_the_same_draws(tmp_path, greedy):
    out = tmp_path / "draft_sample.json"
    argv = ["--batch", "1,3", "--nodes", "1,2", "--draft-vocab", "50", "--vocab", "301",
            "--repeats", "2", "--json", str(out)] + (["--greedy"] if greedy else [])
    assert load_bench("draft_sample").main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["B"], r["R"]) for r in rows} == {(1, 1), (1, 2), (3, 1), (3, 2)}
    for r in rows:
        assert r["same_ids"] and r["q_max_abs_diff"] < 1e-6
        assert r["kernel_ms"] > 0 and r["speedup"] == pytest.approx(r["tensor_ops_ms"]
                                                                      / r["kernel_ms"])


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        load_bench("draft_sample").main(["--draft-vocab", "10", "--vocab", "5"])
    assert "--draft-vocab" in capsys.readouterr().err
