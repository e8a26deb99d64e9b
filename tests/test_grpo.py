"""GRPO math against hand-derived numbers; rollout log-probs equal the trainer's recomputation."""

import math

import pytest
import torch

from tests.speculative_fixtures import PROMPTS, tiny_target, train_drafter
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.rl.grpo import group_advantages, ppo_clip_loss, response_logprobs
from tlt_core.drafting.tree import Strategy
from tlt_core.rl.driver import _pack


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
    parts = ppo_clip_loss(logp, logp.detach(), adv, mask)
    parts.loss.backward()
    # d/dlogp of -(1/5) sum A_b logp_t over real tokens
    expected = -torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)
    assert parts.policy_loss == pytest.approx(-(2 * 3 + -1 * 2) / 5)  # ratio 1 per token
    assert parts.clip_fraction == 0.0


def test_clipping_is_active_exactly_when_expected():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 0.9; advantages +, -, +, - per token
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    parts = ppo_clip_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    # clipped (min picks the clipped term) for ratio 1.5 with A > 0 and ratio 0.5 with A < 0
    assert parts.clip_fraction == pytest.approx(0.5)
    parts.loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0  # no gradient through clipped tokens
    assert logp.grad[0, 2] == pytest.approx(-1.1 / 4) and logp.grad[0, 3] == pytest.approx(0.9 / 4)


def test_k3_kl_penalty():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    parts = ppo_clip_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_coef=0.1)
    k3 = (math.exp(-0.5) + 0.5 - 1 + 0.0) / 2
    assert parts.kl == pytest.approx(k3)
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
    sequences, lengths, mask, old = _pack(rollouts, "cpu")  # as the trainer packs them
    with torch.no_grad():
        new = response_logprobs(target, sequences, lengths, mask, temperature=0.8)
    assert float((new - old).abs().max()) < 1e-4
