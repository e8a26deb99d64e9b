"""The RL update's pure arithmetic against numbers derived by hand.

Each expected value below is worked out in the test's comments (or is a literal / a closed form
of the inputs), never by calling the function under test another way:
- tlt_core.rl.advantages: group advantages under the three reward scalings, dynamic sampling's
  varied groups, GAE, batch whitening, DAPO's soft overlong penalty;
- tlt_core.rl.losses: the four loss aggregation modes, the clip-higher PPO loss (values,
  clip counts, gradients), the three KL estimators, the clipped value loss;
- tlt_core.optim.schedule: warm-up, constant and cosine learning-rate multipliers;
- tlt_core.rl.evaluation: unbiased pass@k (also against brute force) and the eval summary;
- tlt_core.rl.critic: the value model built from the tiny target and the gather of V_t;
- PPO with gamma = lam = 1 and a zero critic reducing to REINFORCE with the return.
"""

import itertools
import math

import pytest
import torch
from torch import nn

from tests.speculative_fixtures import tiny_target
from tlt_core.optim.schedule import lr_multiplier
from tlt_core.rl.advantages import gae, group_advantages, overlong_penalty, varied_groups, whiten
from tlt_core.rl.critic import ValueModel, response_values
from tlt_core.rl.evaluation import evaluation_metrics, pass_at_k
from tlt_core.rl.losses import kl_estimate, ppo_clip_loss, token_weights, value_loss

F64 = torch.float64


def close(actual, expected, tol=1e-6):
    actual = torch.as_tensor(actual, dtype=F64)
    expected = torch.as_tensor(expected, dtype=F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=tol, rtol=0), (actual, expected)


# ---------------------------------------------------------------------------------------------
# advantages.py

# three groups of 4: [1,0,0,0] (mean 1/4), [1,1,1,1] (all equal), [0,1,1,0] (mean 1/2)
REWARDS = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])


def test_group_advantages_group_scaling():
    # group 0: centered [3/4, -1/4, -1/4, -1/4]; population var = (9/16 + 3/16) / 4 = 3/16,
    # std = sqrt(3)/4, so A = [3/sqrt3, -1/sqrt3, ...] = [sqrt3, -1/sqrt3, ...]
    # group 2: centered [-1/2, 1/2, 1/2, -1/2], std 1/2, so A = [-1, 1, 1, -1]
    s3 = math.sqrt(3)
    close(group_advantages(REWARDS, "group"),
          [[s3, -1 / s3, -1 / s3, -1 / s3], [0, 0, 0, 0], [-1, 1, 1, -1]], 1e-5)


def test_group_advantages_batch_scaling():
    # the whole batch is 12 rewards in {0, 1} with 7 ones: p = 7/12, population var p (1 - p)
    # = 35/144, std = sqrt(35)/12; group means are still subtracted per group
    d = math.sqrt(35) / 12
    close(group_advantages(REWARDS, "batch"),
          [[0.75 / d, -0.25 / d, -0.25 / d, -0.25 / d], [0, 0, 0, 0],
           [-0.5 / d, 0.5 / d, 0.5 / d, -0.5 / d]], 1e-5)


def test_group_advantages_no_scaling_is_dr_grpo():
    # only the group mean is subtracted
    close(group_advantages(REWARDS, "none"),
          [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0], [-0.5, 0.5, 0.5, -0.5]])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_zero_advantage_under_every_scaling(scale):
    # a batch with only equal groups: batch std is 0 too (eps keeps the division finite)
    rewards = torch.tensor([[0.5, 0.5, 0.5], [2.0, 2.0, 2.0]])
    assert torch.equal(group_advantages(rewards, scale), torch.zeros(2, 3))


def test_group_advantages_bad_inputs():
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(4), "group")
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(2, 4), "std")


def test_varied_groups():
    rewards = torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [0.5, 0.5, 0.5, 0.5],
                            [1, 0, 0, 0]])
    assert varied_groups(rewards).tolist() == [False, False, True, False, True]


def test_gae_three_tokens_by_hand():
    # rewards [0, 0, 1], values [0.5, 0.2, 0.6], gamma 0.9, lam 0.8, V_3 = 0:
    #   delta_2 = 1 + 0.9 * 0   - 0.6 =  0.4
    #   delta_1 = 0 + 0.9 * 0.6 - 0.2 =  0.34
    #   delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32
    # gamma lam = 0.72:
    #   A_2 = 0.4
    #   A_1 = 0.34  + 0.72 * 0.4   = 0.628
    #   A_0 = -0.32 + 0.72 * 0.628 = 0.13216
    # R = A + V = [0.63216, 0.828, 1.0]
    adv, ret = gae(torch.tensor([0.0, 0, 1]), torch.tensor([0.5, 0.2, 0.6]), 0.9, 0.8)
    assert adv.dtype == ret.dtype == torch.float32
    close(adv, [0.13216, 0.628, 0.4])
    close(ret, [0.63216, 0.828, 1.0])
    close(ret - adv, [0.5, 0.2, 0.6])  # returns = advantages + values


def test_gae_with_gamma_lam_one_and_zero_values_is_reward_to_go():
    # V = 0, gamma = lam = 1: A_t = R_t = sum_{s >= t} r_s = [0.5+0+2, 0+2, 2]
    adv, ret = gae(torch.tensor([0.5, 0, 2]), torch.zeros(3), 1.0, 1.0)
    close(adv, [2.5, 2.0, 2.0])
    close(ret, [2.5, 2.0, 2.0])


def test_gae_with_lam_zero_is_one_step_td_error():
    # lam = 0: A_t = delta_t (the deltas of the hand example above)
    values = torch.tensor([0.5, 0.2, 0.6])
    adv, ret = gae(torch.tensor([0.0, 0, 1]), values, 0.9, 0.0)
    close(adv, [-0.32, 0.34, 0.4])
    close(ret, [0.18, 0.54, 1.0])  # r_t + gamma V_{t+1}


def test_gae_bad_shapes():
    with pytest.raises(ValueError, match="rewards, values"):
        gae(torch.zeros(3), torch.zeros(4), 1.0, 1.0)


def test_whiten():
    # [1, 2, 3, 4]: mean 10/4 = 2.5, var 30/4 - 2.5^2 = 1.25
    values = torch.tensor([1.0, 2, 3, 4], dtype=F64)
    out = whiten(values, 4, 10.0, 30.0)
    close(out, [v / math.sqrt(1.25) for v in (-1.5, -0.5, 0.5, 1.5)])
    close(out.mean(), 0.0)
    close(out.std(unbiased=False), 1.0)
    # one rank's half, whitened with the whole batch's sums, is the same slice of the whole
    close(whiten(values[2:], 4, 10.0, 30.0), out[2:])
    with pytest.raises(ValueError, match="count"):
        whiten(values, 0, 0.0, 0.0)


def test_overlong_penalty():
    # L_max 20, buffer 4: free up to 16, then -factor (L - 16) / 4, capped at -factor
    assert overlong_penalty(10, 20, 4, 1.0) == 0.0
    assert overlong_penalty(16, 20, 4, 1.0) == 0.0
    assert overlong_penalty(17, 20, 4, 1.0) == pytest.approx(-0.25)
    assert overlong_penalty(18, 20, 4, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(18, 20, 4, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 4, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(25, 20, 4, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(100, 20, 0, 1.0) == 0.0


# ---------------------------------------------------------------------------------------------
# losses.py: aggregation

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # 4 tokens, 2 sequences (lengths 3 and 1)
COUNTS = dict(batch_tokens=4, batch_sequences=2, max_new_tokens=4)


@pytest.mark.parametrize("mode, expected, total", [
    # 1 / #tokens = 1/4; sums to 1
    ("token-mean", [[1 / 4, 1 / 4, 1 / 4, 0], [1 / 4, 0, 0, 0]], 1.0),
    # 1 / (#seqs len_i): 1/(2*3) and 1/(2*1); sums to 3/6 + 1/2 = 1
    ("seq-mean-token-mean", [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]], 1.0),
    # 1 / #seqs = 1/2; sums to the mean length 4/2 = 2
    ("seq-mean-token-sum", [[1 / 2, 1 / 2, 1 / 2, 0], [1 / 2, 0, 0, 0]], 2.0),
    # 1 / (#seqs max_new_tokens) = 1/8; sums to 4/8
    ("seq-mean-token-sum-norm", [[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0]], 0.5),
])
def test_token_weights(mode, expected, total):
    w = token_weights(MASK, mode, **COUNTS)
    close(w, expected)
    close(w.sum(), total)
    # two micro-batches (one sequence each) with the mini-batch's counts add up to the same
    halves = [token_weights(MASK[i:i + 1], mode, **COUNTS) for i in range(2)]
    close(torch.cat(halves), expected)


def test_token_weights_bad_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        token_weights(MASK, "mean", **COUNTS)


# ---------------------------------------------------------------------------------------------
# losses.py: the clipped policy loss


def test_clip_higher_bounds_values_counts_and_gradients():
    # old_logp = 0, so ratio = exp(logp); epsilon_low 0.2, epsilon_high 0.28: range [0.8, 1.28]
    #   token  ratio  A   unclipped  clipped        min     clipped?  d loss / d logp
    #   0      1.25   2    2.5       1.25*2 = 2.5   2.5     no        -w r A = -0.25*1.25*2 = -0.625
    #   1      1.3    2    2.6       1.28*2 = 2.56  2.56    yes       0
    #   2      0.79  -2   -1.58      0.8*-2 = -1.6  -1.6    yes       0
    #   3      0.81  -2   -1.62      0.81*-2        -1.62   no        -0.25*0.81*-2 = 0.405
    # row 1: the same tokens with weight 0: counted nowhere
    # policy loss = -0.25 (2.5 + 2.56 - 1.6 - 1.62) = -0.46
    ratios = torch.tensor([[1.25, 1.3, 0.79, 0.81]] * 2, dtype=F64)
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([[2.0, 2, -2, -2]] * 2, dtype=F64)
    weights = torch.tensor([[0.25] * 4, [0.0] * 4], dtype=F64)
    parts = ppo_clip_loss(logp, torch.zeros_like(logp), adv, weights,
                          epsilon_low=0.2, epsilon_high=0.28)
    close(parts.loss, -0.46)
    assert parts.policy_loss == pytest.approx(-0.46)
    assert parts.clipped_tokens == 2 and parts.tokens == 4
    assert parts.kl_sum == 0.0
    parts.loss.backward()
    close(logp.grad, [[-0.625, 0, 0, 0.405], [0, 0, 0, 0]])


def test_symmetric_clip_does_clip_ratio_1_25():
    # with the default epsilon_high 0.2 the range is [0.8, 1.2]: ratio 1.25, A > 0 is clipped
    logp = torch.tensor([[math.log(1.25)]], dtype=F64, requires_grad=True)
    parts = ppo_clip_loss(logp, torch.zeros_like(logp), torch.tensor([2.0], dtype=F64),
                          torch.ones_like(logp))
    close(parts.loss, -2.4)  # -(1.2 * 2)
    assert parts.clipped_tokens == 1
    parts.loss.backward()
    close(logp.grad, [[0.0]])


def test_ratio_one_gradient_is_reinforce():
    # logp = old_logp: ratio 1, clipping inactive; loss = -sum w A, d loss / d logp = -w A
    # per-sequence advantages (B,): A = 3 for row 0, -1 for row 1
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64)
    logp = old.clone().requires_grad_(True)
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.0]], dtype=F64)
    parts = ppo_clip_loss(logp, old, torch.tensor([3.0, -1.0], dtype=F64), weights)
    close(parts.loss, -(0.5 * 3 + 0.5 * 3 + 0.25 * -1))
    assert parts.clipped_tokens == 0 and parts.tokens == 3
    parts.loss.backward()
    close(logp.grad, [[-1.5, -1.5], [0.25, 0.0]])


# ---------------------------------------------------------------------------------------------
# losses.py: KL

# d = ref - logp = -0.5 and 0.3
LOGP = torch.tensor([-1.0, -2.0], dtype=F64)
REF = torch.tensor([-1.5, -1.7], dtype=F64)
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(0.3) - 0.3 - 1]  # 0.10653066, 0.04985881


def test_kl_estimators_by_hand():
    close(kl_estimate(LOGP, REF, "k1"), [0.5, -0.3])  # -d
    close(kl_estimate(LOGP, REF, "k2"), [0.125, 0.045])  # d^2 / 2
    close(kl_estimate(LOGP, REF, "k3"), [0.10653066, 0.04985881], 1e-8)  # exp(d) - d - 1
    close(kl_estimate(LOGP, REF), K3)  # k3 is the default
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(LOGP, REF, "k4")


def test_kl_term_in_the_loss():
    # ratio 1 and A = 0: the policy part is 0, so loss = kl_coef sum w k3
    #   = 0.1 (0.5 * 0.10653066 + 0.25 * 0.04985881) ~= 0.0065730
    # a third token (d = 2) has weight 0: in neither the loss nor kl_sum
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.7, -1.0]], dtype=F64)
    weights = torch.tensor([[0.5, 0.25, 0.0]], dtype=F64)
    parts = ppo_clip_loss(logp, logp.detach(), torch.zeros(1, dtype=F64), weights,
                          ref_logp=ref, kl_coef=0.1, kl_estimator="k3")
    close(parts.loss, 0.1 * (0.5 * K3[0] + 0.25 * K3[1]))
    assert parts.policy_loss == 0.0
    assert parts.kl_sum == pytest.approx(K3[0] + K3[1])
    assert parts.tokens == 2
    # d k3 / d logp = 1 - exp(d): 0.1 * w * (1 - exp(d))
    parts.loss.backward()
    close(logp.grad, [[0.1 * 0.5 * (1 - math.exp(-0.5)), 0.1 * 0.25 * (1 - math.exp(0.3)), 0]])
    # no KL term without a coefficient
    off = ppo_clip_loss(logp, logp.detach(), torch.zeros(1, dtype=F64), weights, ref_logp=ref)
    assert off.kl_sum == 0.0 and float(off.loss.detach()) == 0.0


# ---------------------------------------------------------------------------------------------
# losses.py: value loss


def test_value_loss_by_hand():
    # cliprange 0.2, old values 0:
    #   token  V    R    clipped V  plain (V-R)^2  clipped (Vc-R)^2  max    clipped larger?
    #   a      0.5  1.0  0.2        0.25           0.64              0.64   yes
    #   b      0.5  0.0  0.2        0.25           0.04              0.25   no
    #   c      0.1  1.0  0.1        0.81           0.81              0.81   no (tie)
    #   d      0.5  1.0  0.2        0.25           0.64              -      weight 0
    # loss = 0.5 (0.5 * 0.64 + 0.25 * 0.25 + 0.25 * 0.81) = 0.5 * 0.585 = 0.2925
    values = torch.tensor([[0.5, 0.5, 0.1, 0.5]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64)
    weights = torch.tensor([[0.5, 0.25, 0.25, 0.0]], dtype=F64)
    loss, clipped = value_loss(values, torch.zeros_like(returns), returns, weights, 0.2)
    close(loss, 0.2925)
    assert clipped == 1
    # gradients: a follows the saturated clipped error (0); b: w (V - R) = 0.25 * 0.5;
    # c: w (V - R) = 0.25 * -0.9 (both branches agree); d: weight 0
    loss.backward()
    close(values.grad, [[0.0, 0.125, -0.225, 0.0]])


# ---------------------------------------------------------------------------------------------
# schedule.py


def test_lr_warmup_then_constant():
    # W = 4: (s + 1) / 4 for s < 4, then 1
    got = [lr_multiplier(s, steps=10, warmup_steps=4) for s in range(7)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])
    assert lr_multiplier(0, steps=10) == 1.0  # no warm-up


def test_lr_cosine():
    # S = 10, W = 2, m = 0.1: p = (s - 2) / 8
    kw = dict(steps=10, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(0.5)  # warm-up
    assert lr_multiplier(1, **kw) == pytest.approx(1.0)
    assert lr_multiplier(2, **kw) == pytest.approx(1.0)  # p = 0: the full rate
    # p = 1/4: 0.1 + 0.9 (1 + cos(pi/4)) / 2
    assert lr_multiplier(4, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert lr_multiplier(6, **kw) == pytest.approx((1 + 0.1) / 2)  # p = 1/2
    assert lr_multiplier(10, **kw) == pytest.approx(0.1)  # p = 1
    assert lr_multiplier(15, **kw) == pytest.approx(0.1)  # held past the end


def test_lr_bad_scheduler():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        lr_multiplier(0, steps=10, scheduler="linear")


# ---------------------------------------------------------------------------------------------
# evaluation.py


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # C(1, 2) = 0: any two hold a pass


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_matches_brute_force(n):
    # samples 0 .. c-1 pass; the fraction of k-subsets holding at least one of them
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            hits = sum(any(i < c for i in s) for s in subsets)
            assert pass_at_k(n, c, k) == pytest.approx(hits / len(subsets)), (n, c, k)


def test_pass_at_k_bad_inputs():
    for args in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*args)


def test_evaluation_metrics():
    # 3 prompts x 4 samples; 0.1 is a format bonus that does not pass at threshold 1
    # passes c = [1, 4, 0]; mean reward = (1 + 4 + 0.1) / 12 = 0.425
    # pass@1 = (1/4 + 1 + 0) / 3; pass@2 = (1/2 + 1 + 0) / 3 = 1/2; pass@4 = (1 + 1 + 0) / 3
    rewards = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0.1, 0, 0]]
    m = evaluation_metrics(rewards, pass_threshold=1.0)
    assert m["eval/reward"] == pytest.approx(0.425)
    assert m["eval/pass@1"] == pytest.approx(1.25 / 3)
    assert m["eval/pass@2"] == pytest.approx(0.5)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    for k in (8, 16, 32, 64):
        assert m[f"eval/pass@{k}"] is None
    # with threshold 0.1 the bonus passes: c = [1, 4, 1], pass@1 = (1/4 + 1 + 1/4) / 3 = 1/2
    assert evaluation_metrics(rewards, 0.1)["eval/pass@1"] == pytest.approx(0.5)


def test_evaluation_metrics_bad_groups():
    for bad in ([[1, 0], [1]], [], [[], []]):
        with pytest.raises(ValueError, match="rewards"):
            evaluation_metrics(bad)


# ---------------------------------------------------------------------------------------------
# critic.py

IDS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
POS = torch.arange(6).expand(2, 6)


def test_fresh_critic_predicts_zero():
    critic = ValueModel(tiny_target())
    assert len(critic.trunk.layers) == 2
    values = critic(IDS, POS)
    assert values.dtype == torch.float32 and values.shape == (2, 6)
    assert torch.equal(values, torch.zeros(2, 6))


def test_critic_trunk_is_the_policys():
    # with the full stack and the head set to lm_head's row 5, V is the policy's logit of token 5
    policy = tiny_target()
    critic = ValueModel(policy)
    with torch.no_grad():
        critic.value_head.weight.copy_(policy.lm_head.weight[5:6])
        expected = policy(IDS, POS).logits[..., 5]
    close(critic(IDS, POS).detach(), expected, 1e-4)


def test_critic_layers():
    policy = tiny_target()
    critic = ValueModel(policy, layers=1)
    assert len(critic.trunk.layers) == 1 and len(policy.model.layers) == 2
    assert torch.equal(critic(IDS, POS), torch.zeros(2, 6))
    for bad in (0, 3, 1.5, "1"):
        with pytest.raises(ValueError, match="critic_layers"):
            ValueModel(policy, layers=bad)


def test_critic_needs_a_transformer_policy():
    with pytest.raises(ValueError, match="policy"):
        ValueModel(nn.Linear(4, 4))


def test_critic_shares_no_tensor_with_the_policy():
    policy = tiny_target()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    critic = ValueModel(policy)
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    # the zero head passes no gradient to the trunk, so take two steps: the first moves the
    # head, the second the trunk too
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
    trunk_before = critic.trunk.embed_tokens.weight.detach().clone()
    for _ in range(2):
        optimizer.zero_grad()
        ((critic(IDS, POS) - 1.0) ** 2).mean().backward()
        optimizer.step()
    assert not torch.equal(critic.trunk.embed_tokens.weight, trunk_before)
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in policy.parameters())


class PositionCritic(nn.Module):
    """V at position j of row b is 10 b + j: shows which positions response_values gathers."""

    def forward(self, input_ids, positions):
        rows = torch.arange(input_ids.shape[0])[:, None]
        return (10 * rows + positions).float()


def test_response_values_gathers_prompt_len_minus_one_plus_t():
    # L = 5; row 0: prompt 2, positions 1, 2, 3, 4 (V_t is read where the logits predicting
    # response token t are); row 1: prompt 3, positions 2, 3, 4, (5 clamped to 4), of which
    # only two are response tokens: the rest is zeroed
    sequences = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    values = response_values(PositionCritic(), sequences, torch.tensor([2, 3]), mask)
    assert torch.equal(values, torch.tensor([[1.0, 2, 3, 4], [12, 13, 0, 0]]))


# ---------------------------------------------------------------------------------------------
# PPO (gamma = lam = 1, zero critic) is REINFORCE with the return as advantage


def test_ppo_with_zero_critic_and_unit_gamma_lam_is_reinforce():
    # a fresh critic gives V = 0; token rewards [0.5, 0, 1] -> A_t = R_t = [1.5, 1, 1]
    policy = tiny_target()
    sequences = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.ones(1, 3)
    values = response_values(ValueModel(policy), sequences, torch.tensor([3]), mask)[0]
    assert torch.equal(values, torch.zeros(3))
    adv, ret = gae(torch.tensor([0.5, 0.0, 1.0]), values, 1.0, 1.0)
    close(adv, [1.5, 1.0, 1.0])
    close(ret, adv)
    # at ratio 1, with seq-mean-token-mean weights 1/3: d loss / d logp_t = -w_t R_t
    logp = torch.tensor([[-0.7, -1.2, -0.1]], requires_grad=True)
    weights = token_weights(mask, "seq-mean-token-mean", batch_tokens=3, batch_sequences=1,
                            max_new_tokens=3)
    parts = ppo_clip_loss(logp, logp.detach(), adv[None], weights)
    parts.loss.backward()
    close(logp.grad, [[-1.5 / 3, -1 / 3, -1 / 3]])
    close(parts.loss, -(1.5 + 1 + 1) / 3)
