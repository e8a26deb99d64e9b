"""The spot trainer: preempted within one step of the signal, resumes exactly, trains only the
drafter's own tensors (the target stays bit-identical); its checkpoints are written atomically,
a failed write is reported with its path, and a planted pickle is refused, never run."""

import errno
import os
import threading
import time

import pytest
import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.training import make_optimizer, train_step
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.persistence import checkpoint_io
from tlt_core.persistence.checkpoint_io import STATE_FILE, TENSORS_FILE, read_state
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer

from tests.speculative_fixtures import PROMPTS, tiny_target
from tests.test_speculative import state_hash


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def harvest(target):
    """A buffer filled by a rollout (greedy, so the data is the same on every run)."""
    torch.manual_seed(0)
    buffer = HarvestBuffer()
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=48), Drafter(target), buffer)
    engine.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=30)) for p in PROMPTS])
    return buffer


def fresh_drafter(target):
    torch.manual_seed(7)
    return Drafter(target).eval()


def test_training_improves_the_drafter_and_never_touches_the_target(target, harvest):
    before = state_hash(target)
    trainer = SpotTrainer(fresh_drafter(target), harvest, SpotConfig(lr=3e-3, batch_tokens=256))
    first = trainer.train_until(lambda: False, max_steps=1)
    later = trainer.train_until(lambda: False, max_steps=60)
    assert first.stopped == later.stopped == "max_steps" and trainer.steps == 61
    assert later.last_loss < first.last_loss
    assert state_hash(target) == before
    assert all(p.grad is None for p in target.parameters())


def test_spot_steps_are_the_unrolled_objective_of_its_config(target, harvest):
    """SpotConfig.unroll is the objective the trainer steps on: one spot step equals one
    train_step with that unroll on the same batch."""
    config = SpotConfig(lr=3e-3, batch_tokens=256, unroll=2)
    trainer = SpotTrainer(fresh_drafter(target), harvest, config)
    batch = trainer._batch(0)
    trainer.train_until(lambda: False, max_steps=1)
    reference = fresh_drafter(target)
    train_step(reference, make_optimizer(reference, config.lr), batch, unroll=2)
    for (name, a), b in zip(trainer.drafter.state_dict().items(),
                            reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_rl_driver_spot_trains_with_the_configs_unroll(target):
    """`tlt train --drafter-unroll N` reaches the spot trainer; a bad value names the field."""
    from tlt_core.rl.driver import RLDriver, TrainConfig
    from tlt_core.tasks.inputs import Prompt

    config = TrainConfig(steps=1, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=6,
                         minibatch_size=4, max_batch=4, suffix_drafts=False, drafter_unroll=3)
    prompts = [Prompt(str(p), tuple(p), "7") for p in PROMPTS[:2]]
    driver = RLDriver(target, prompts, lambda prompt, response, reference: 0.0,
                      lambda ids: " ".join(map(str, ids)), (), config,
                      drafter=fresh_drafter(target))
    assert driver.spot_config.unroll == 3  # the trainer's, where other ranks run beside
    with pytest.raises(ValueError, match="^drafter_unroll"):
        TrainConfig(drafter_unroll=0)


def test_preempted_within_one_step_of_the_signal(target, harvest):
    trainer = SpotTrainer(fresh_drafter(target), harvest, SpotConfig(batch_tokens=256))
    calls = []
    session = trainer.train_until(lambda: calls.append(1) or len(calls) > 5)
    assert session.stopped == "signal" and session.steps == 5  # checked before every step

    # From another thread, as the idle detector would: the call returns within one step.
    trainer.train_until(lambda: False, max_steps=3)  # warm
    step_s = trainer.train_until(lambda: False, max_steps=10).seconds / 10
    signal, signalled_at = threading.Event(), []

    def fire():
        signalled_at.append(time.perf_counter())
        signal.set()

    threading.Timer(0.2, fire).start()
    session = trainer.train_until(signal.is_set)
    lag = time.perf_counter() - signalled_at[0]
    assert session.stopped == "signal" and session.steps > 0
    assert lag < 2 * step_s + 0.05  # the step in flight, then out


def test_resume_continues_exactly_like_an_uninterrupted_run(target, harvest, tmp_path):
    config = SpotConfig(lr=3e-3, batch_tokens=128, seed=3)
    straight = SpotTrainer(fresh_drafter(target), harvest, config)
    straight.train_until(lambda: False, max_steps=13)

    interrupted = SpotTrainer(fresh_drafter(target), harvest, config)
    interrupted.train_until(lambda: False, max_steps=6)
    interrupted.checkpoint(tmp_path / "spot")  # written in the background
    interrupted.train_until(lambda: False, max_steps=2)  # lost work: the checkpoint is from step 6
    interrupted.wait()
    resumed = SpotTrainer(fresh_drafter(target), harvest, config)
    resumed.resume(tmp_path / "spot")
    assert resumed.steps == 6
    resumed.train_until(lambda: False, max_steps=7)
    for (name, a), b in zip(straight.drafter.state_dict().items(),
                            resumed.drafter.state_dict().values()):
        assert torch.equal(a, b), name
    saved = read_state(tmp_path / "spot")
    assert not any(k.startswith(("model.", "lm_head")) for k in saved["drafter"])


def test_no_data_and_bad_config(target):
    trainer = SpotTrainer(fresh_drafter(target), HarvestBuffer())
    assert trainer.train_until(lambda: False).stopped == "no_data"
    with pytest.raises(ValueError, match="lr"):
        SpotConfig(lr=0)
    with pytest.raises(FileNotFoundError, match="path"):
        trainer.resume("/nonexistent/spot")


def test_nothing_a_user_gave_is_lost_and_nothing_loaded_runs_code(target, harvest, tmp_path,
                                                                    monkeypatch):
    """A checkpoint write that fails (disk full) is raised by wait(), naming the path, and
    leaves the previous checkpoint and no temporary; a pickle with a live payload, as the path
    or as a file of the folder, is refused by resume and the payload never runs."""
    from tests.test_checkpoint_io import Payload

    trainer = SpotTrainer(fresh_drafter(target), harvest, SpotConfig(batch_tokens=128))
    trainer.train_until(lambda: False, max_steps=2)
    path = tmp_path / "spot"
    trainer.checkpoint(path)
    trainer.wait()
    before = {name: (path / name).read_bytes() for name in (STATE_FILE, TENSORS_FILE)}
    real_save = checkpoint_io.save_file

    def disk_full(tensors, file, **kwargs):
        real_save(tensors, file, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_io, "save_file", disk_full)
    trainer.train_until(lambda: False, max_steps=1)
    trainer.checkpoint(path)
    with pytest.raises(OSError, match=f"cannot write {path}: No space left on device"):
        trainer.wait()
    monkeypatch.undo()
    trainer.wait()  # reported once
    assert {name: (path / name).read_bytes() for name in before} == before
    assert os.listdir(tmp_path) == ["spot"]
    resumed = SpotTrainer(fresh_drafter(target), harvest, SpotConfig(batch_tokens=128))
    resumed.resume(path)
    assert resumed.steps == 2

    marker = tmp_path / "payload-ran"
    torch.save({"drafter": {}, "x": Payload(marker)}, tmp_path / "planted.pt")
    with pytest.raises(ValueError, match="planted.pt is not a spot-trainer checkpoint"):
        resumed.resume(tmp_path / "planted.pt")
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / STATE_FILE).write_bytes(before[STATE_FILE])
    torch.save({"x": Payload(marker)}, planted / TENSORS_FILE)
    with pytest.raises(ValueError, match="planted is not a spot-trainer checkpoint"):
        resumed.resume(planted)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / STATE_FILE).write_bytes(before[STATE_FILE])
    (torn / TENSORS_FILE).write_bytes(before[TENSORS_FILE][:len(before[TENSORS_FILE]) // 2])
    with pytest.raises(ValueError, match="torn is not a spot-trainer checkpoint"):
        resumed.resume(torn)
    assert not marker.exists() and resumed.steps == 2
