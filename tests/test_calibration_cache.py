"""The calibration cache: a second run with the same fingerprint reads the first run's cost
model instead of calibrating; anything a step's cost depends on (plans, batches, prompts, the
model's dtype, the engine's settings) is a miss; a damaged or foreign entry is reported and
replaced, never trusted; the RL driver reads it and says so in its metrics."""

import json
import logging
from dataclasses import replace

import pytest
import torch

from tests.speculative_fixtures import PROMPTS, tiny_target
from tlt_core.adaptive import calibration_cache
from tlt_core.adaptive.calibration_cache import CalibrationCache
from tlt_core.adaptive.cost_model import calibrate
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.inputs import Prompt

PLANS = (Strategy(2, 1, 3), SuffixMatch(4))
BATCHES = (1, 4)
REQUESTS = [Request(p, SamplingParams(temperature=1.0, max_tokens=6)) for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def engine(target):
    return RolloutEngine(target, EngineConfig(max_batch=4, max_len=48),
                         Drafter(target, DrafterConfig()).eval())


@pytest.fixture
def counted(monkeypatch):
    """How many times the cache calibrated for real."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(calibration_cache, "calibrate", counting)
    return calls


def test_a_second_run_reads_the_first_runs_cost_model(tmp_path, engine, counted):
    cache = CalibrationCache(tmp_path)
    measured = cache.calibrate(engine, PLANS, BATCHES, REQUESTS, max_tokens=6)
    assert len(counted) == 1 and measured.cached_from is None
    assert len(list(tmp_path.glob("*.json"))) == 1
    read = CalibrationCache(tmp_path).calibrate(engine, PLANS, BATCHES, REQUESTS, max_tokens=6)
    assert len(counted) == 1  # nothing was timed again
    assert read.cached_from == str(next(tmp_path.glob("*.json")))
    for table in ("rates", "acceptance", "context_slope", "context_mean", "context_max",
                  "admission_s"):
        assert getattr(read, table) == getattr(measured, table), table
    assert 0 <= read.calibration_s < measured.calibration_s
    assert read.rate(2, PLANS[0], 20) == measured.rate(2, PLANS[0], 20)


@pytest.mark.parametrize("change", ["plans", "batches", "prompts", "temperature", "options",
                                    "engine", "dtype", "code"])
def test_what_a_step_costs_depends_on_is_a_miss(tmp_path, target, engine, counted, change,
                                                 monkeypatch):
    cache = CalibrationCache(tmp_path)
    cache.calibrate(engine, PLANS, BATCHES, REQUESTS, max_tokens=6)
    plans, batches, requests, options, other = PLANS, BATCHES, REQUESTS, {"max_tokens": 6}, engine
    if change == "plans":
        plans = PLANS[:1]
    elif change == "batches":
        batches = (1, 2)
    elif change == "prompts":
        requests = [replace(REQUESTS[0], prompt_ids=PROMPTS[3])] + REQUESTS[1:]
    elif change == "temperature":
        requests = [replace(r, params=replace(r.params, temperature=0.0)) for r in REQUESTS]
    elif change == "options":
        options = {"max_tokens": 5}
    elif change == "engine":
        other = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), engine.drafter)
    elif change == "code":  # a rebuilt kernel, or an edited engine
        assert calibration_cache.code_digest() == calibration_cache.code_digest()
        monkeypatch.setattr(calibration_cache, "code_digest", lambda: "another build")
    else:  # the same model without a drafter in float32, then in bf16: two more entries
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny_target().to(dtype)
            cache.calibrate(RolloutEngine(model, engine.config), [PLANS[1]], BATCHES, REQUESTS,
                            max_tokens=6)
        assert len(counted) == 3 and len(list(tmp_path.glob("*.json"))) == 3
        return
    cache.calibrate(other, plans, batches, requests, **options)
    assert len(counted) == 2 and len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "edited fingerprint", "other format",
                                    "malformed table"])
def test_a_damaged_entry_is_reported_and_replaced(tmp_path, engine, counted, caplog, damage):
    cache = CalibrationCache(tmp_path)
    cache.calibrate(engine, PLANS, BATCHES, REQUESTS, max_tokens=6)
    path = next(tmp_path.glob("*.json"))
    entry = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:100])
    else:
        if damage == "edited fingerprint":
            entry["fingerprint"]["plans"] = ["plain"]
        elif damage == "other format":
            entry["format"] = 99
        else:
            entry["cost_model"]["rates"][0][2] = "fast"
        path.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="tlt_core.adaptive.calibration_cache"):
        model = cache.calibrate(engine, PLANS, BATCHES, REQUESTS, max_tokens=6)
    assert len(counted) == 2 and model.cached_from is None
    assert any(str(path) in r.message and "calibrating afresh" in r.message
               for r in caplog.records)
    assert json.loads(path.read_text())["fingerprint"] == entry["fingerprint"] or \
        damage == "edited fingerprint"  # replaced by a whole entry again
    assert cache.calibrate(engine, PLANS, BATCHES, REQUESTS, max_tokens=6).cached_from


def test_a_cache_that_cannot_be_written_costs_nothing_but_a_warning(tmp_path, engine,
                                                                   monkeypatch, caplog):
    def refuse(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibration_cache, "atomic_file", refuse)
    with caplog.at_level(logging.WARNING, logger="tlt_core.adaptive.calibration_cache"):
        model = CalibrationCache(tmp_path).calibrate(engine, PLANS, BATCHES, REQUESTS,
                                                     max_tokens=6)
    assert model.rates and model.cached_from is None
    assert any("could not store" in r.message and "No space left" in r.message
               for r in caplog.records)


def test_a_cache_path_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="calibration_cache: .* is a file"):
        CalibrationCache(tmp_path / "file")


def test_the_rl_driver_reads_a_cached_calibration_and_says_so(tmp_path, target):
    drafter = Drafter(target, DrafterConfig()).eval()
    prompts = [Prompt(str(p), tuple(p), "7") for p in PROMPTS[:4]]
    config = TrainConfig(steps=1, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=6,
                         minibatch_size=4, max_batch=4, calibration_cache=tmp_path)

    def driver():
        return RLDriver(target, prompts, lambda prompt, response, reference: 0.0,
                        lambda ids: " ".join(map(str, ids)), (), config, drafter=drafter)

    first = driver()
    assert not first.adaptive.cost_model.cached_from
    second = driver()
    assert second.adaptive.cost_model.cached_from
    assert second.adaptive.cost_model.rates == first.adaptive.cost_model.rates
    metrics = second.step()
    assert metrics["rollout/calibration_cached"] == 1.0
    assert metrics["rollout/calibration_s"] < first.adaptive.cost_model.calibration_s
