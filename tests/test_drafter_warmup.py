"""`tlt drafter train` / tlt_core.warmup (the offline EAGLE warm-up): a drafter for
any checkpoint from the target's own responses — harvested from the passes that generated them,
a reduced draft vocabulary of the tokens they use, resumable with the same batches, the
held-out acceptance in the folder's provenance — and the result drafts losslessly in the
engine. Its work folder is a cache that heals: a torn or foreign entry is reported and built
again, and a second process waits for the first instead of training twice."""

import json
import logging
import os
import re
import threading
from dataclasses import replace

import pytest
import torch

from tlt_core.cli.main import main
from tlt_core.drafting import training
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.export import load_drafter
from tlt_core.drafting.training import collect_records
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.persistence.checkpoint_io import write_state
from tlt_core.warmup import responses, training_loop
from tlt_core.warmup.config import OfflineConfig
from tlt_core.warmup.draft_vocabulary import draft_vocabulary
from tlt_core.warmup.offline import train_offline
from tlt_core.warmup.responses import read_shard
from tlt_core.warmup.training_loop import float32_twin
from tlt_core.warmup.work_folder import claim_work_folder, record_problem

from tests.cli_fixtures import tiny_checkpoint, word
from tests.speculative_fixtures import tiny_target

CONFIG = OfflineConfig(temperature=0.0, max_tokens=24, rollout_batch=16, held_out=4,
                       draft_vocab=24, steps=30, batch_tokens=256, checkpoint_every=10,
                       eval_max_tokens=16)


def prompts(target, count=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, target.config.vocab_size, (5,), generator=g).tolist()
            for _ in range(count)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target = tiny_target()
    folder = tmp_path_factory.mktemp("offline") / "drafter"
    report = train_offline(target, prompts(target), folder, CONFIG, progress=False)
    return target, folder, report


def test_offline_drafter_drafts_and_records_its_provenance(trained):
    target, folder, report = trained
    assert report.sequences == 24 and report.steps == 30 and report.draft_vocab == 24
    assert report.final_top1 > 0.5
    record = json.loads((folder / "drafter_config.json").read_text())
    meta = record["metadata"]
    assert meta["held_out_acceptance"] == report.held_out_acceptance
    assert meta["acceptance_length"] == report.held_out_acceptance["t0"]["(6,1,7)"] > 1.5
    assert meta["held_out_by_position"]["t0"]["(6,1,7)"]["0-256"] == meta["acceptance_length"]
    assert set(meta["held_out_acceptance"]["t0"]) == {"(6,1,7)", "(5,4,16)"}
    at_t1 = meta["held_out_acceptance"]["t1"]  # the deterministic and sampled chains, a tree
    assert set(at_t1) == {"(6,1,7)", "sampled(6)", "sampled(6,2)"}
    assert all(v >= 1.0 for v in at_t1.values())
    drafter = load_drafter(folder, target)
    assert drafter.config.draft_vocab == 24
    params = SamplingParams(temperature=0.0, max_tokens=16)
    requests = [Request(p, params) for p in prompts(target, 6, seed=9)]
    engine = RolloutEngine(target, EngineConfig(max_batch=3, max_len=40), drafter)
    plain = engine.generate(requests)
    spec = engine.generate(requests, strategy=Strategy(5, 4, 16))
    assert [r.tokens.tolist() for r in spec.rollouts] == [r.tokens.tolist()
                                                          for r in plain.rollouts]


def test_harvested_features_are_the_targets_own(trained, tmp_path):
    """The shards hold what a fresh target pass over the same sequence computes, and the
    loss starts at the prompt's last position."""
    target, folder, _ = trained
    records, prompt_lengths = read_shard(folder / "work" / "responses" / "shard-00000", CONFIG)
    assert prompt_lengths[0] == 5
    fresh = collect_records(target, [records[0].tokens.tolist()], (-1,))[0]
    assert torch.allclose(records[0].features, fresh.features, atol=1e-4, rtol=0)


def test_draft_vocabulary_is_the_responses_most_used_tokens(trained):
    target, folder, _ = trained
    records, starts = [], []
    for shard in sorted((folder / "work" / "responses").iterdir()):
        r, p = read_shard(shard, CONFIG)
        records += r
        starts += p
    counts = torch.zeros(target.config.vocab_size, dtype=torch.int64)
    for record, start in zip(records, starts):
        counts += torch.bincount(record.tokens[start:], minlength=target.config.vocab_size)
    ids = draft_vocabulary(records, starts, 3, (7,), target.config.vocab_size)
    top = set(torch.sort(counts, descending=True, stable=True).indices[:3].tolist())
    assert 7 in ids.tolist() and len(ids) == 3  # a stop id is always in
    assert set(ids.tolist()) - {7} <= top
    assert ids.tolist() == sorted(ids.tolist())


def test_an_interrupted_run_resumes_with_the_same_batches(tmp_path, monkeypatch):
    target = tiny_target()
    data = prompts(target)
    whole = train_offline(target, data, tmp_path / "whole", CONFIG, progress=False)
    real_step, calls = training.train_step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 15:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr("tlt_core.warmup.training_loop.train_step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        train_offline(target, data, tmp_path / "again", CONFIG, progress=False)
    monkeypatch.setattr("tlt_core.warmup.training_loop.train_step", real_step)
    resumed = train_offline(target, data, tmp_path / "again", CONFIG, progress=False)
    assert resumed.steps == whole.steps
    a = Drafter.load(tmp_path / "whole", target).state_dict()
    b = Drafter.load(tmp_path / "again", target).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="other settings"):
        train_offline(target, data, tmp_path / "again",
                      OfflineConfig(**{**CONFIG.__dict__, "max_tokens": 20}), progress=False)


def test_float32_twin_is_the_same_model_widened():
    target = tiny_target().to(torch.bfloat16)
    twin = float32_twin(target)
    ids = torch.tensor([[1, 2, 3, 4]])
    positions = torch.arange(4)[None]
    with torch.no_grad():
        for name, tensor in twin.state_dict().items():
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor, target.state_dict()[name].float())
        twin(ids, positions)
    assert float32_twin(twin) is twin


def test_bad_offline_settings_are_refused(tmp_path):
    target = tiny_target()
    for field, value in (("held_out", 0), ("steps", 0), ("lr", 0.0), ("draft_vocab", 0),
                         ("ignore_eos", "yes")):
        with pytest.raises(ValueError, match=field):
            OfflineConfig(**{**CONFIG.__dict__, field: value})
    with pytest.raises(ValueError, match="prompts"):
        train_offline(target, prompts(target, 4), tmp_path / "d", CONFIG, progress=False)


def test_tlt_drafter_train_command(tmp_path, capsys):
    model, _ = tiny_checkpoint(tmp_path, with_drafter=False)
    data = tmp_path / "prompts.jsonl"
    g = torch.Generator().manual_seed(2)
    lines = [{"prompt": " ".join(word(int(i)) for i in torch.randint(0, 32, (5,), generator=g))}
             for _ in range(24)]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "drafter"
    args = ["drafter", "train", "--model", str(model), "--data", str(data), "--out", str(out),
            "--held-out", "4", "--steps", "12", "--max-tokens", "16", "--draft-vocab", "20",
            "--rollout-batch", "8", "--batch-tokens", "256", "--dtype", "float32",
            "--unroll", "2", "--chat-template", "none", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "held-out acceptance length T = 0: (6,1,7)" in printed and "step 2 " in printed
    record = json.loads((out / "drafter_config.json").read_text())
    assert record["metadata"]["train_prompts"] == 20
    assert record["metadata"]["offline"]["unroll"] == 2
    assert set(record["metadata"]["final_top1_by_step"]) == {"top1_step2"}
    assert record["drafter"]["draft_vocab"] <= 20
    assert main(args) == 0  # a second run finds everything done and resumes to the same end
    with pytest.raises(SystemExit, match="held-out"):
        main(args[:-1] + ["--held-out", "0", "--no-progress"])


def same_drafters(folder_a, folder_b, target):
    a = Drafter.load(folder_a, target).state_dict()
    b = Drafter.load(folder_b, target).state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def counting(monkeypatch):
    """Counts the shards written and the training steps taken through the warm-up."""
    counts = {"shards": 0, "steps": 0}
    real_write, real_step = responses.write_shard, training_loop.train_step

    def write_shard(*args, **kwargs):
        counts["shards"] += 1
        return real_write(*args, **kwargs)

    def step(*args, **kwargs):
        counts["steps"] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(responses, "write_shard", write_shard)
    monkeypatch.setattr(training_loop, "train_step", step)
    return counts


def test_nothing_a_user_gave_is_lost_a_damaged_cache_entry_heals(trained, tmp_path,
                                                                  monkeypatch, caplog):
    """A truncated work/run.json, a shard missing its tensors and a torn step checkpoint are each
    reported with their path and built again, and the drafter comes out as an undamaged run's."""
    target, reference, _ = trained
    data = prompts(target)
    out = tmp_path / "drafter"
    train_offline(target, data, out, CONFIG, progress=False)
    work = out / "work"
    counts = counting(monkeypatch)

    record = work / "run.json"
    record.write_text(record.read_text()[:40])  # torn mid-write
    caplog.set_level(logging.WARNING, logger="tlt_core.warmup")
    train_offline(target, data, out, CONFIG, progress=False)
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{record} is not valid JSON" in line and "starting it afresh" in line
               for line in logged), logged
    assert counts == {"shards": 2, "steps": CONFIG.steps}  # everything built again
    assert record_problem(record, set(json.loads(record.read_text()))) is None
    assert same_drafters(out, reference, target)

    shard = work / "responses" / "shard-00001"
    (shard / "tensors.safetensors").unlink()
    write_state({"lengths": torch.ones(2)}, work / "responses" / "shard-00000")  # foreign
    checkpoint = work / "train" / f"step-{CONFIG.steps:06d}"
    (checkpoint / "state.json").write_text('{"format": "tlt_core.checkpoint/1", "sta')
    caplog.clear()
    train_offline(target, data, out, CONFIG, progress=False)
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{shard} has no tensors.safetensors" in line and "generating shard-00001 again"
               in line for line in logged), logged
    assert any("shard-00000 lacks the tensors features, prompt_lengths, tokens" in line
               for line in logged), logged
    assert any(f"{checkpoint / 'state.json'} is not valid JSON" in line
               and "resuming from the checkpoint before it, or from the start" in line
               for line in logged), logged
    assert counts == {"shards": 4, "steps": 2 * CONFIG.steps}
    assert same_drafters(out, reference, target)
    assert not [p for p in work.rglob("*") if ".tmp-" in p.name]


@pytest.mark.parametrize("setting, implied, other", [
    ("unroll", 1, 3),  # a teacher-forced run's
    ("rejection_weight", 0.0, 1.0),  # a run of EAGLE's loss alone
    ("ignore_eos", False, True),  # responses that end at the end of turn
    ("regression_weight", 1.0, 0.0),  # a run with EAGLE's feature regression
])
def test_a_work_record_without_a_setting_belongs_to_the_run_that_lacked_it(tmp_path, setting,
                                                                            implied, other):
    """A work record that does not name `setting` resumes with the value its run used, its
    shards kept, and is refused, naming it, with another."""
    work, data = tmp_path / "work", [(1, 2, 3)]
    config = replace(CONFIG, **{setting: implied})
    claim_work_folder(work, config, data, "sha")
    record = json.loads((work / "run.json").read_text())
    del record[setting]
    (work / "run.json").write_text(json.dumps(record))
    (work / "responses").mkdir()
    claim_work_folder(work, config, data, "sha")  # the implied value: the same run
    assert (work / "responses").is_dir()
    with pytest.raises(ValueError, match=rf"other settings \({setting}\)"):
        claim_work_folder(work, replace(config, **{setting: other}), data, "sha")
    # the matmuls' dtype changes neither the data nor the float32 state: a resume may change it
    claim_work_folder(work, replace(config, matmul_dtype="bfloat16"), data, "sha")
    assert (work / "responses").is_dir()


@pytest.mark.parametrize("text, problem", [
    ('{"temperature": 0.0, "max_tok', "is not valid JSON"),
    ("[1, 2]", "holds a JSON list"),
    ('{"temperature": 0.0, "colour": "red"}', "missing max_tokens.*unknown colour"),
])
def test_a_foreign_work_record_is_told_apart(tmp_path, text, problem):
    path = tmp_path / "run.json"
    path.write_text(text)
    assert re.search(problem, record_problem(path, {"temperature", "max_tokens"}))
    path.write_text('{"temperature": 1.0, "max_tokens": 3}')
    assert record_problem(path, {"temperature", "max_tokens"}) is None


def test_two_concurrent_warm_ups_train_once(tmp_path, monkeypatch, caplog):
    """A second call on the same --out while the first runs waits for it (saying so), then
    reuses its responses and training: one run's worth of shards and steps in all."""
    target = tiny_target()
    data = prompts(target)
    counts = counting(monkeypatch)
    training, reports = threading.Event(), {}
    real_step = training_loop.train_step

    def step(*args, **kwargs):
        training.set()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training_loop, "train_step", step)

    def run(name):
        reports[name] = train_offline(target, data, tmp_path / "drafter", CONFIG,
                                      progress=False)

    caplog.set_level(logging.INFO, logger="tlt_core.warmup")
    first = threading.Thread(target=run, args=("first",))
    first.start()
    training.wait()  # the first holds the work folder
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join()
    second.join()
    assert reports["first"].steps == reports["second"].steps == CONFIG.steps
    assert reports["second"].final_loss == reports["first"].final_loss
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(waits) == 1 and f"in use by another process (pid {os.getpid()}); waiting" \
        in waits[0], waits
    assert counts == {"shards": 2, "steps": CONFIG.steps}


def test_ignore_eos_runs_every_response_to_max_tokens(tmp_path):
    """Under ignore_eos the responses run past the stop id (a fixed-length benchmark's text),
    and the held-out measurement decodes them so too; without it the same prompts stop."""
    target = tiny_target()
    data = prompts(target)
    stop = frequent_response_token(target, data)
    config = replace(CONFIG, steps=2, checkpoint_every=2)
    lengths = {}
    for ignore in (False, True):
        out = tmp_path / f"ignore-{ignore}"
        report = train_offline(target, data, out, replace(config, ignore_eos=ignore),
                               stop_ids=(stop,), progress=False)
        assert report.held_out_acceptance["t0"]["(6,1,7)"] >= 1.0
        shard = out / "work" / "responses" / "shard-00000"
        records, prompt_lengths = read_shard(shard, replace(config, ignore_eos=ignore))
        lengths[ignore] = [int(r.tokens.shape[0]) - p for r, p in zip(records, prompt_lengths)]
    # a record holds the positions the target was fed: a response's last token never was
    assert set(lengths[True]) == {CONFIG.max_tokens - 1}
    assert min(lengths[False]) < CONFIG.max_tokens - 1


def frequent_response_token(target, data) -> int:
    """The token the target's greedy responses to `data` use most: a stop id they reach."""
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=40))
    params = SamplingParams(temperature=0.0, max_tokens=CONFIG.max_tokens)
    result = engine.generate([Request(p, params) for p in data[:8]])
    tokens = torch.cat([r.tokens for r in result.rollouts])
    return int(torch.bincount(tokens).argmax())
