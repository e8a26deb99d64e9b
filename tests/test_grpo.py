"""GRPO math against hand-derived numbers; rollout log-probs equal the trainer's recomputation;
PPO's old log-probs come from the source TrainConfig.old_logprobs names. (The rest of the
RL math: tests/test_rl_math.py.)"""

import copy
import math

import pytest
import torch

from tests.speculative_fixtures import PROMPTS, tiny_target, train_drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.rl.advantages import group_advantages
from tlt_core.rl.losses import ppo_clip_loss, response_logprobs
import tlt_core.rl.driver as driver_module
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.rl.update import pack_micro_batch
from tlt_core.tasks.inputs import Prompt


def test_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # mean .5, std .5
    assert adv[1].tolist() == [0.0] * 4  # equal rewards: nothing to learn
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(4))


def test_ratio_one_gives_the_reinforce_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    parts = ppo_clip_loss(logp, logp.detach(), adv, mask / mask.sum())  # token-mean weights
    parts.loss.backward()
    # d/dlogp of -(1/5) sum A_b logp_t over real tokens
    expected = -torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)
    assert parts.policy_loss == pytest.approx(-(2 * 3 + -1 * 2) / 5)  # ratio 1 per token
    assert parts.clipped_tokens == 0.0 and parts.tokens == 5


def test_clipping_is_active_exactly_when_expected():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 0.9; advantages +, -, +, - per token
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    parts = ppo_clip_loss(logp, old, adv, torch.ones(1, 4) / 4, epsilon_low=0.2,
                          epsilon_high=0.2)
    # clipped (min picks the clipped term) for ratio 1.5 with A > 0 and ratio 0.5 with A < 0
    assert parts.clipped_tokens == 2 and parts.tokens == 4
    parts.loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0  # no gradient through clipped tokens
    assert logp.grad[0, 2] == pytest.approx(-1.1 / 4) and logp.grad[0, 3] == pytest.approx(0.9 / 4)


def test_k3_kl_penalty():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    parts = ppo_clip_loss(logp, logp, torch.zeros(1), torch.ones(1, 2) / 2, ref_logp=ref,
                          kl_coef=0.1)
    k3 = (math.exp(-0.5) + 0.5 - 1 + 0.0) / 2
    assert parts.kl_sum / parts.tokens == pytest.approx(k3)
    assert float(parts.loss) == pytest.approx(0.1 * k3)


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    return target, train_drafter(target)


@pytest.mark.parametrize("strategy", [None, Strategy(4, 1, 5), Strategy(3, 2, 6)])
def test_rollout_logprobs_equal_the_trainers_recomputation(models, strategy):
    target, drafter = models
    engine = RolloutEngine(target, EngineConfig(max_batch=6, max_len=48), drafter)
    params = SamplingParams(temperature=0.8, max_tokens=16, n=2)
    rollouts = engine.generate([Request(p, params) for p in PROMPTS[:3]], strategy).rollouts
    micro = pack_micro_batch(rollouts, list(range(len(rollouts))), "cpu")  # as the trainer does
    with torch.no_grad():
        new = response_logprobs(target, micro.sequences, micro.prompt_lengths, micro.mask,
                                temperature=0.8)
    assert float((new - micro.rollout_logprobs).abs().max()) < 1e-4


# Old log-probs: "rollout" divides by the engine's, "recompute" by the trainer's own pass before
# any update ("auto": recompute exactly when the policy is not float32).

def distinct_tokens(prompt: str, response: str, reference: str) -> float:
    """A reward that differs between samples, so that advantages are not all 0."""
    return float(len(set(response.split())))


def spied_step(monkeypatch, dtype: torch.dtype, old_logprobs: str, minibatch_size: int = 4):
    """One GRPO step of the tiny target in `dtype` on 2 prompts x 2 samples (one micro-batch per
    mini-batch), and what the trainer did: ("pack", the packed micro-batch) and ("loss", ppo_clip_loss's
    logp, old, advantages, mask) in call order, the metrics, and the policy as it rolled out."""
    events = []

    def pack(rollouts, rows, device):
        out = pack_micro_batch(rollouts, rows, device)
        events.append(("pack", out))
        return out

    def loss(logp, old, advantages, weights, **options):
        events.append(("loss", (logp.detach(), old, advantages, weights)))
        return ppo_clip_loss(logp, old, advantages, weights, **options)

    monkeypatch.setattr(driver_module, "pack_micro_batch", pack)
    monkeypatch.setattr(driver_module, "ppo_clip_loss", loss)
    policy = tiny_target(sharpen=2.0).to(dtype)
    prompts = [Prompt(str(p), tuple(p), "") for p in PROMPTS[:4]]
    config = TrainConfig(steps=1, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=6,
                         lr=1e-2, minibatch_size=minibatch_size, max_batch=4, tlt=False,
                         old_logprobs=old_logprobs)
    trainer = RLDriver(policy, prompts, distinct_tokens, lambda ids: " ".join(map(str, ids)),
                       (), config)
    before = copy.deepcopy(policy)
    metrics = trainer.step()
    return events, metrics, before


def loss_calls(events):
    """(packed micro-batch, ppo_clip_loss's arguments) of each loss call: the pack just before
    it is its micro-batch's."""
    calls, packed = [], None
    for kind, value in events:
        if kind == "pack":
            packed = value
        else:
            calls.append((packed, value))
    return calls


@pytest.mark.parametrize("dtype, old_logprobs, recomputes", [
    (torch.bfloat16, "recompute", True), (torch.bfloat16, "auto", True),
    (torch.bfloat16, "rollout", False), (torch.float32, "rollout", False),
    (torch.float32, "auto", False), (torch.float32, "recompute", True)])
def test_first_ratio_is_one_when_recomputed_and_the_gap_is_the_engines(monkeypatch, dtype,
                                                                      old_logprobs, recomputes):
    events, metrics, _ = spied_step(monkeypatch, dtype, old_logprobs)
    [(micro, (logp, old, advantages, weights))] = loss_calls(events)
    mask, engine_logp = micro.mask, micro.rollout_logprobs
    assert advantages.abs().max() > 0  # the loss below has something to weigh
    torch.testing.assert_close(weights, mask / mask.sum())  # token-mean: 1 / #tokens each
    if recomputes:
        assert torch.equal(old, logp)  # ratio exp(logp - old) = 1 exactly, at every token
        assert metrics["train/clip_fraction"] == 0.0
        # at ratio 1 the surrogate is A itself: L = -(1/#tokens) sum_b A_b n_b
        assert metrics["train/loss"] == pytest.approx(float(-(advantages * mask).sum()
                                                      / mask.sum()), rel=1e-6)
    else:
        assert torch.equal(old, engine_logp)  # the rollout's own log-probs
    # logprob_gap compares the engine with the trainer whichever old log-probs PPO divides by
    assert metrics["train/logprob_gap"] == float(((logp - engine_logp) * mask).abs().max())
    if dtype == torch.float32:
        assert metrics["train/logprob_gap"] < 1e-4  # SD is lossless: ~0 in float32
    else:  # the engine's fused bf16 pass rounds differently: recomputing is what fixes ratio 1
        assert metrics["train/logprob_gap"] > 1e-3


def test_recomputed_old_logprobs_are_the_pre_update_policys_in_every_minibatch(monkeypatch):
    """Two mini-batches: the second one's old log-probs are still the rollout policy's (computed
    before the first update), not the updated policy's."""
    events, _, before = spied_step(monkeypatch, torch.bfloat16, "recompute", minibatch_size=2)
    calls = loss_calls(events)
    assert len(calls) == 2
    for micro, (logp, old, _, _) in calls:
        with torch.no_grad():
            expected = response_logprobs(before, micro.sequences, micro.prompt_lengths,
                                         micro.mask)
        assert torch.equal(old, expected)
    second_logp, second_old = calls[1][1][:2]
    assert not torch.equal(second_logp, second_old)  # the first update moved the policy


def test_old_logprobs_must_be_a_known_source():
    with pytest.raises(ValueError, match="^old_logprobs: .*'engine'"):
        TrainConfig(old_logprobs="engine")
