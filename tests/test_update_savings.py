"""The RL update's two savings change no weight: inert sequences (a GRPO advantage of exactly
0, as in a group that scored alike, and no KL term) pass through no model, and the first
mini-batch's old log-probs come from its own training pass instead of a forward pass before the
update. A driver with both is checked
against one with neither, with several mini-batches and epochs, and the passes each one ran are
counted. One sequence a micro-batch, so that both runs compute each sequence's gradient the
same way, and the weights agree bit for bit: packed differently, they would agree to rounding,
which AdamW magnifies where a gradient is near zero."""

import pytest
import torch

import tlt_core.rl.driver as driver_module
from tlt_core.rl.advantages import group_advantages
from tests.test_rl_options import constant_for_odd_prompts, make, small


class NotOurTransformer:
    """Stands in for tlt_core's Transformer in the driver's isinstance test: the policy is then
    treated as any module, whose training pass may differ from an evaluation one."""


def run(config, reward, monkeypatch, *, savings: bool):  # reward: a fresh reward function
    """Final weights, per-step metrics, the sequences each kind of pass saw and each step's
    share of samples with an advantage of exactly 0."""
    passes = {"before": [], "train": [], "zero": []}  # zero: share of advantages exactly 0
    logprobs = driver_module.response_logprobs

    def spy(model, sequences, *args, **kwargs):
        passes["train" if torch.is_grad_enabled() else "before"].append(sequences.shape[0])
        return logprobs(model, sequences, *args, **kwargs)

    update = driver_module.RLDriver._update

    def spy_update(self, rollouts, scores):
        advantages = group_advantages(scores.view(-1, config.samples_per_prompt),
                                      config.scale_rewards)
        passes["zero"].append(float((advantages == 0).float().mean()))
        return update(self, rollouts, scores)

    driver = make(config, reward=reward())
    with monkeypatch.context() as patch:
        patch.setattr(driver_module, "response_logprobs", spy)
        patch.setattr(driver_module.RLDriver, "_update", spy_update)
        if not savings:
            patch.setattr(driver_module.RLDriver, "_inert", lambda self, *_: frozenset())
            patch.setattr(driver_module, "Transformer", NotOurTransformer)
        metrics = [driver.step() for _ in range(config.steps)]
    return driver.policy.state_dict(), metrics, passes


def assert_same_update(config, reward, monkeypatch):
    weights, metrics, saved = run(config, reward, monkeypatch, savings=True)
    reference, expected, full = run(config, reward, monkeypatch, savings=False)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name
    for got, want in zip(metrics, expected):
        for key in ("train/loss", "train/clip_fraction", "train/grad_norm", "train/reward"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    return saved, full, metrics


def test_inert_groups_and_deferred_old_logprobs_leave_the_update_unchanged(monkeypatch):
    # odd prompts' groups all score 0.5: inert; 2 mini-batches of 8, 2 epochs
    config = small(steps=2, minibatch_size=8, ppo_epochs=2, old_logprobs="recompute",
                   micro_batch_tokens=1)
    saved, full, metrics = assert_same_update(config, lambda: constant_for_odd_prompts,
                                              monkeypatch)
    assert [m["train/inert_fraction"] for m in metrics] == saved["zero"]
    assert any(0 < share < 1 for share in saved["zero"])  # some samples learn, some not
    sequences = config.prompts_per_step * config.samples_per_prompt
    assert len(full["before"]) == sequences * config.steps  # every sequence, once a step
    assert len(full["train"]) == sequences * config.ppo_epochs * config.steps
    # half the groups inert; the first mini-batch's old log-probs from its training pass
    assert len(saved["train"]) < len(full["train"])
    assert len(saved["before"]) < len(saved["train"]) / config.ppo_epochs


def test_a_step_with_nothing_to_learn_still_steps_the_optimizer(monkeypatch):
    """Every group scores alike: no sequence passes, but each mini-batch's optimizer step
    (AdamW's moments from the step before, its decay) runs on zero gradients as before."""
    config = small(steps=3, minibatch_size=8, micro_batch_tokens=1)

    def learns_once():  # step 0's groups score apart, later ones alike
        rewards = iter([float(i % 3) for i in range(16)] + [1.0] * 32)
        return lambda *_: next(rewards)

    saved, full, metrics = assert_same_update(config, learns_once, monkeypatch)
    assert [m["train/inert_fraction"] for m in metrics][1:] == [1.0, 1.0]
    assert len(saved["train"]) < len(full["train"])


@pytest.mark.parametrize("options", [
    dict(kl_coef=0.05, kl_placement="loss"),
    dict(algorithm="ppo", critic_lr=1e-2, kl_coef=0.05, kl_placement="reward")], ids=str)
def test_with_a_kl_term_the_update_is_unchanged_too(options, monkeypatch):
    """A KL term gives every sample a gradient (none is inert); in the reward it reads the old
    log-probs before the update, so none is taken from the training pass there."""
    config = small(steps=2, minibatch_size=8, ppo_epochs=2, old_logprobs="recompute",
                   micro_batch_tokens=1, **options)
    saved, full, metrics = assert_same_update(config, lambda: constant_for_odd_prompts,
                                              monkeypatch)
    assert all(m["train/inert_fraction"] == 0.0 for m in metrics)
    assert len(saved["train"]) == len(full["train"])
    in_reward = options["kl_placement"] == "reward"
    assert (len(saved["before"]) == len(full["before"])) == in_reward
