"""The embedded model's warm-up: reproducible, cached, and (slow test) good enough for RL —
right 30-80% of the time at temperature 1, with the heavy-tailed response lengths of reasoning
RL (p99 >= 5x the median), measured on its own samples."""

import pytest
import torch

from tlt_core.warmup import WarmupConfig, load_or_train, train

TINY = WarmupConfig(steps=3, warmup_steps=1, batch_size=8, problems_per_epoch=64)


def test_same_seed_same_weights():
    first, losses_a, _, _ = train(TINY, progress=False)
    second, losses_b, _, _ = train(TINY, progress=False)
    assert losses_a == losses_b
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_warm_model_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    model, report = load_or_train(TINY, progress=False, eval_problems=4)
    assert report.steps == 3 and 0.0 <= report.accuracy_t1 <= 1.0
    (folder,) = tmp_path.iterdir()
    assert (folder / "model.safetensors").is_file() and (folder / "warmup_report.json").is_file()
    again, report_again = load_or_train(TINY, progress=False, eval_problems=4)
    assert report_again == report
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_bad_warmup_config_names_the_field():
    with pytest.raises(ValueError, match="steps"):
        WarmupConfig(steps=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupConfig(steps=10, warmup_steps=11)


@pytest.mark.slow
def test_default_warm_model_is_right_sometimes_with_a_long_tail():
    """Trains the default model (a few minutes) unless $TLT_CACHE_DIR already holds it."""
    _, report = load_or_train(progress=False)
    assert 0.3 <= report.accuracy_t1 <= 0.8, report
    lengths = report.response_length
    assert lengths["p99"] >= 5 * lengths["median"], lengths
    assert report.token_entropy > 0.0
