"""The embedded model's pre-training: reproducible, cached, and good enough for RL — right
30-80% of the time at temperature 1, with the heavy-tailed response lengths of reasoning RL
(p99 >= 5x the median), measured on its own samples."""

import logging

import pytest
import torch

from tlt_core.embedded.pretrain import PretrainConfig, pretrain
from tlt_core.embedded.workload import load_pretrained

TINY = PretrainConfig(steps=3, warmup_steps=1, batch_size=8, problems_per_epoch=64)


def test_same_seed_same_weights():
    first, losses_a, _, _ = pretrain(TINY, progress=False)
    second, losses_b, _, _ = pretrain(TINY, progress=False)
    assert losses_a == losses_b
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_pretrained_model_is_cached_and_announced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="tlt_core")
    model, report, folder = load_pretrained(TINY, progress=False, eval_problems=4)
    assert "pre-training it now (3 steps" in caplog.records[0].getMessage()  # said first
    assert report.steps == 3 and 0.0 <= report.accuracy_t1 <= 1.0
    assert [path.name for path in tmp_path.iterdir()] == [folder.name]
    assert (folder / "model.safetensors").is_file() and (folder / "pretrain_report.json").is_file()
    caplog.clear()
    again, report_again, _ = load_pretrained(TINY, progress=False, eval_problems=4)
    assert report_again == report and not caplog.records  # loaded, not trained
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_bad_pretrain_config_names_the_field():
    with pytest.raises(ValueError, match="steps"):
        PretrainConfig(steps=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        PretrainConfig(steps=10, warmup_steps=11)


def test_default_pretrained_model_is_right_sometimes_with_a_long_tail():
    """The shipped model's report (tests/test_shipped_weights.py retrains it and compares)."""
    _, report, _ = load_pretrained(progress=False)
    assert 0.3 <= report.accuracy_t1 <= 0.8, report
    lengths = report.response_length
    assert lengths["p99"] >= 5 * lengths["median"], lengths
    assert report.token_entropy > 0.0
