"""The embedded model and drafter ship with the package (tlt_core/embedded/weights/): the
loader uses them without training, they are the weights the default configs name, their
provenance describes them, and (slow) retraining both from scratch reproduces them within
tolerance."""

import json
import logging
import time

import pytest
import torch

from tlt_core.drafting.tree import Strategy
from tlt_core.embedded import (CharTokenizer, OfflineDrafterConfig, PretrainConfig, TaskConfig,
                               drafter_folder_name, generate_problems, load_drafter,
                               load_embedded, load_pretrained, model_folder_name,
                               train_default_weights)
from tlt_core.embedded.workload import MAIN_JOB_DRAFTER, PROVENANCE_FILE, SHIPPED_ROOT
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model import load_checkpoint


def test_the_default_workload_loads_from_the_package_without_training(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))  # an empty cache: a fresh machine
    caplog.set_level(logging.INFO, logger="tlt_core")
    start = time.perf_counter()
    workload = load_embedded()
    assert time.perf_counter() - start < 30  # loading, not training (which takes minutes)
    assert not caplog.records  # nothing announced: nothing trained
    assert not list(tmp_path.iterdir())  # and nothing written to the cache
    assert workload.target_folder == SHIPPED_ROOT / model_folder_name(PretrainConfig())
    assert workload.drafter_folder == workload.target_folder / drafter_folder_name(
        OfflineDrafterConfig())
    main_job = load_embedded(drafter_config=MAIN_JOB_DRAFTER)  # `tlt train`'s early drafter
    assert not caplog.records and not list(tmp_path.iterdir())
    assert main_job.drafter_folder == workload.target_folder / drafter_folder_name(
        MAIN_JOB_DRAFTER)


def test_the_provenance_describes_the_shipped_files():
    provenance = json.loads((SHIPPED_ROOT / PROVENANCE_FILE).read_text())
    workload = load_embedded(progress=False)
    assert provenance["model"]["folder"] == workload.target_folder.name
    assert provenance["drafter"]["folder"] == (f"{workload.target_folder.name}/"
                                               f"{workload.drafter_folder.name}")
    assert provenance["model"]["report"] == json.loads(
        (workload.target_folder / "pretrain_report.json").read_text())
    assert provenance["drafter"]["report"] == json.loads(
        (workload.drafter_folder / "drafter_report.json").read_text())
    main_job = load_embedded(progress=False, drafter_config=MAIN_JOB_DRAFTER)
    assert provenance["main_job_drafter"]["folder"] == (f"{main_job.target_folder.name}/"
                                                        f"{main_job.drafter_folder.name}")
    assert provenance["main_job_drafter"]["report"] == json.loads(
        (main_job.drafter_folder / "drafter_report.json").read_text())
    for key in ("torch", "machine", "date", "git_commit"):
        assert provenance[key], key


def _greedy_answers(target, drafter, prompts):
    """The target's greedy responses (SD on, which is lossless) and the acceptance length."""
    params = SamplingParams(temperature=0.0, max_tokens=460, stop_ids=(CharTokenizer().eos_id,))
    requests = [Request(prompt, params) for prompt in prompts]
    engine = RolloutEngine(target, EngineConfig(max_batch=32, max_len=480), drafter)
    result = engine.generate(requests, Strategy(6, 1, 7))
    return [r.tokens.tolist() for r in result.rollouts], result.acceptance_length


@pytest.mark.slow
def test_retraining_reproduces_the_shipped_weights(tmp_path):
    """Both trainings from scratch with the default configs (about 10 minutes on 2 cores).
    On the machine and torch build that made them the weights come out bit for bit; elsewhere
    rounding may differ, so what must hold is behaviour: the same training curve ends, the
    same accuracy, the same greedy answers, the same drafter quality, within tolerance."""
    fresh = train_default_weights(tmp_path, progress=False)
    shipped = json.loads((SHIPPED_ROOT / PROVENANCE_FILE).read_text())
    new_model, old_model = fresh["model"]["report"], shipped["model"]["report"]
    # The curve's end is noisy (loss spikes within the last 50 steps) and CPUs that round
    # differently follow different trajectories: 0.050 where the weights were made, 0.022 on
    # this project's CI machines. Converged to the same level means within a factor of 2.5.
    assert 0.4 <= new_model["final_loss"] / old_model["final_loss"] <= 2.5, new_model
    assert abs(new_model["accuracy_t1"] - old_model["accuracy_t1"]) <= 0.1
    new_drafter, old_drafter = fresh["drafter"]["report"], shipped["drafter"]["report"]
    assert abs(new_drafter["final_top1"] - old_drafter["final_top1"]) <= 0.02
    new_early, old_early = (run["main_job_drafter"]["report"] for run in (fresh, shipped))
    assert abs(new_early["final_top1"] - old_early["final_top1"]) <= 0.03

    old_target, _, old_folder = load_pretrained(progress=False)
    old_drafter_model = load_drafter(old_target, old_folder, progress=False)[0]
    new_target = load_checkpoint(tmp_path / fresh["model"]["folder"]).eval()
    new_drafter_model = load_drafter(new_target, tmp_path / fresh["model"]["folder"],
                                     shipped=False, cache=tmp_path, progress=False)[0]
    same_weights = all(torch.equal(a, b) for a, b in zip(old_target.state_dict().values(),
                                                         new_target.state_dict().values()))
    print(f"retrained model bit-identical to the shipped one: {same_weights}")
    tokenizer = CharTokenizer()
    prompts = [tokenizer.prompt_ids(p.prompt)
               for p in generate_problems(TaskConfig(seed=31337, num_problems=64))]
    old_answers, old_acceptance = _greedy_answers(old_target, old_drafter_model, prompts)
    new_answers, new_acceptance = _greedy_answers(new_target, new_drafter_model, prompts)
    # Whole greedy responses (up to 460 tokens): all equal where the retrained weights are the
    # shipped ones bit for bit; on this project's CI machines, whose trajectory differs
    # (above), 67% of them; the bound keeps a margin below that.
    agreement = sum(a == b for a, b in zip(old_answers, new_answers)) / len(prompts)
    assert agreement >= 0.5, agreement
    assert new_acceptance == pytest.approx(old_acceptance, rel=0.1)
