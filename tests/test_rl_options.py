"""The RL driver's options at work: dynamic sampling drops exactly the all-equal groups and
refills; overlong masking zeroes exactly the truncated responses' loss; the schedule reaches the
optimizers; reward rises on the embedded task with PPO and with GRPO + each option; PPO's
critic trains and leaves the policy to the policy loss; resume = uninterrupted with every option
on; evaluation runs on held-out prompts; the CLI and config files take every option. (The math
of each option, against hand numbers: tests/test_rl_math.py.)"""

import itertools

import pytest
import torch

import tlt_core.rl.driver as driver_module
from tests.speculative_fixtures import VOCAB, tiny_target
from tlt_core.cli import main
from tlt_core.optim.schedule import lr_multiplier
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.inputs import Prompt

GOOD = 7  # the toy task: reward = share of response tokens equal to GOOD


def toy_reward(prompt: str, response: str, reference: str) -> float:
    tokens = response.split()
    return sum(t == reference for t in tokens) / max(len(tokens), 1)


def constant_for_odd_prompts(prompt: str, response: str, reference: str) -> float:
    """All samples of an odd-numbered prompt score the same: groups with no learning signal."""
    return 0.5 if int(prompt.split()[0]) % 2 else toy_reward(prompt, response, reference)


def prompts(count: int = 24) -> list[Prompt]:
    # the first token names the prompt, so the reward can tell prompts apart
    return [Prompt(" ".join(map(str, (i, 3 + i % 5, 9))), (i % VOCAB, 3 + i % 5, 9), str(GOOD))
            for i in range(count)]


def detokenize(ids):
    return " ".join(map(str, ids))


def small(**overrides) -> TrainConfig:
    base = dict(steps=3, prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, lr=1e-2,
                minibatch_size=8, tlt=False, max_batch=16)
    return TrainConfig(**{**base, **overrides})


def make(config, reward=toy_reward, stop_ids=(), seed=0, evaluation=()):
    torch.manual_seed(seed)
    return RLDriver(tiny_target(sharpen=2.0), prompts(), reward, detokenize, stop_ids, config,
                    evaluation=evaluation)


def spy_updates(monkeypatch, driver):
    """The rollouts each step's update was given."""
    seen = []
    update = driver._update

    def spy(rollouts, scores):
        seen.append(list(rollouts))
        return update(rollouts, scores)

    monkeypatch.setattr(driver, "_update", spy)
    return seen


def test_dynamic_sampling_drops_exactly_the_all_equal_groups_and_refills(monkeypatch):
    scores = {}  # prompt text -> its samples' rewards (no prompt repeats within the step)

    def reward(prompt, response, reference):
        scores.setdefault(prompt, []).append(constant_for_odd_prompts(prompt, response,
                                                                       reference))
        return scores[prompt][-1]

    driver = make(small(dynamic_sampling=True, max_refill_rounds=4), reward)
    seen = spy_updates(monkeypatch, driver)
    metrics = driver.step()
    equal = {p for p, r in scores.items() if len(set(r)) == 1}
    assert len(scores) == driver.state.prompts_used  # the data cursor counts refills
    assert {p for p in scores if int(p.split()[0]) % 2} <= equal  # the constant ones, at least
    assert metrics["rollout/groups_dropped"] == len(equal) < len(scores)  # the all-equal ones
    assert metrics["rollout/refill_rounds"] >= 1
    [kept] = seen
    kept_prompts = {detokenize(r.prompt_ids) for r in kept}
    assert len(kept) == 4 * 4 and len(kept_prompts) == 4  # refilled to prompts_per_step
    assert not kept_prompts & equal  # none from a group without a learning signal
    varied_in_order = [p for p in scores if p not in equal]
    assert kept_prompts == set(varied_in_order[:4])  # the first varied groups, surplus unused


def test_a_step_that_never_fills_trains_on_what_it_kept(monkeypatch):
    driver = make(small(dynamic_sampling=True, max_refill_rounds=2),
                  lambda prompt, response, reference: 1.0)  # every group constant
    before = [p.detach().clone() for p in driver.policy.parameters()]
    metrics = driver.step()
    assert metrics["rollout/refill_rounds"] == 2 and metrics["rollout/groups_dropped"] == \
        driver.state.prompts_used
    assert metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0
    for a, b in zip(before, driver.policy.parameters()):
        assert torch.equal(a, b)  # nothing to learn from: no update


def test_mask_truncated_completions_zeroes_exactly_the_truncated_responses(monkeypatch):
    calls = []
    pack, loss = driver_module.pack_micro_batch, driver_module.ppo_clip_loss

    def spy_pack(rollouts, rows, device):
        calls.append(("pack", [rollouts[j].finish_reason for j in rows]))
        return pack(rollouts, rows, device)

    def spy_loss(logp, old, advantages, weights, **options):
        calls.append(("loss", weights))
        return loss(logp, old, advantages, weights, **options)

    monkeypatch.setattr(driver_module, "pack_micro_batch", spy_pack)
    monkeypatch.setattr(driver_module, "ppo_clip_loss", spy_loss)
    # stop at token 5: some responses end, the rest run into max_new_tokens; a reward that
    # tells every sample apart, so no sequence is inert (skipped by the update)
    distinct = itertools.count()
    driver = make(small(mask_truncated_completions=True, minibatch_size=16), stop_ids=(5,),
                  reward=lambda prompt, response, reference: float(next(distinct)))
    metrics = driver.step()
    reasons, weights = None, []
    for kind, value in calls:
        if kind == "pack":
            reasons = value
        else:
            weights.append((reasons, value))
    assert 0 < metrics["rollout/truncated_fraction"] < 1, "the test needs both kinds"
    total = 0.0
    for finish, w in weights:
        for reason, row in zip(finish, w):
            if reason == "length":
                assert row.abs().sum() == 0  # a truncated response has no loss at all
            else:
                assert (row > 0).any()
        total += float(w.sum())
    assert total == pytest.approx(1.0)  # token-mean over the counted tokens only


def test_the_schedule_reaches_the_optimizers():
    config = small(steps=4, algorithm="ppo", critic_lr=2e-2, lr_scheduler_type="cosine",
                   warmup_steps=1, min_lr_ratio=0.1)
    driver = make(config)
    for step in range(4):
        metrics = driver.step()
        scale = lr_multiplier(step, steps=4, warmup_steps=1, scheduler="cosine",
                              min_lr_ratio=0.1)
        assert metrics["train/lr"] == pytest.approx(1e-2 * scale)
        assert driver.optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * scale)
        assert driver.critic_optimizer.optimizer.param_groups[0]["lr"] == \
            pytest.approx(2e-2 * scale)


def test_ppo_trains_its_critic_and_logs_its_metrics():
    driver = make(small(steps=4, algorithm="ppo", samples_per_prompt=2, critic_lr=5e-2))
    head = driver.critic.value_head.weight
    assert head.abs().sum() == 0  # V = 0 before training
    history = [driver.step() for _ in range(4)]
    assert head.abs().sum() > 0
    assert all(m["train/value_loss"] is not None and m["train/value_loss"] >= 0
               for m in history)
    assert history[-1]["train/explained_variance"] is not None
    assert not any(p is q for p in driver.critic.parameters() for q in driver.policy.parameters())


def test_grpo_steps_carry_no_critic_metrics():
    metrics = make(small(steps=1)).step()
    assert metrics["train/value_loss"] is None and metrics["train/explained_variance"] is None
    assert metrics["eval/reward"] is None  # no evaluation in this step


EVERY_GRPO_OPTION = dict(epsilon_high=0.28, dynamic_sampling=True, max_refill_rounds=2,
                         mask_truncated_completions=True, overlong_buffer_len=3,
                         scale_rewards="batch", loss_agg_mode="seq-mean-token-mean",
                         kl_coef=0.05, kl_placement="reward", kl_estimator="k1",
                         lr_scheduler_type="cosine", warmup_steps=1, eval_every=1,
                         eval_samples=2, ppo_epochs=2)
EVERY_PPO_OPTION = dict(algorithm="ppo", samples_per_prompt=2, gamma=0.99, lam=0.9,
                        critic_lr=3e-2, critic_layers=1, cliprange_value=0.5, epsilon_high=0.3,
                        dynamic_sampling=True, mask_truncated_completions=True,
                        overlong_buffer_len=2, loss_agg_mode="seq-mean-token-sum-norm",
                        kl_coef=0.1, kl_placement="loss", kl_estimator="k2",
                        lr_scheduler_type="cosine", eval_every=2, eval_samples=3)


@pytest.mark.parametrize("options", [EVERY_GRPO_OPTION, EVERY_PPO_OPTION],
                         ids=["grpo", "ppo"])
def test_resume_equals_uninterrupted_with_every_option_on(tmp_path, options):
    config = small(**options)
    evaluation = prompts(30)[24:]
    whole = make(config, constant_for_odd_prompts, stop_ids=(5,), evaluation=evaluation)
    for _ in range(3):
        whole.step()
    first = make(config, constant_for_odd_prompts, stop_ids=(5,), evaluation=evaluation)
    for _ in range(2):
        first.step()
    saved = first.save(tmp_path / "checkpoints")
    resumed = make(config, constant_for_odd_prompts, stop_ids=(5,), evaluation=evaluation,
                   seed=123)  # other initial weights: the checkpoint restores all
    resumed.resume(saved)
    resumed.step()
    timing = {"train/step_s", "rollout/time_s", "train/update_s", "rollout/time_share",
              "rollout/tail_s", "trace_time_s", "eval/time_s", "step_trace"}

    def untimed(trace):
        return [{k: v for k, v in row.items() if k not in ("seconds", "catch_up_s")}
                for row in trace]
    for mine, theirs in zip(resumed.state.history, whole.state.history):
        assert {k: v for k, v in mine.items() if k not in timing} == \
            {k: v for k, v in theirs.items() if k not in timing}
        assert untimed(mine["step_trace"]) == untimed(theirs["step_trace"])
    for a, b in zip(whole.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
    if whole.critic is not None:
        for a, b in zip(whole.critic.parameters(), resumed.critic.parameters()):
            assert torch.equal(a, b)
    assert resumed.state.prompts_used == whole.state.prompts_used


def test_evaluation_needs_held_out_prompts():
    with pytest.raises(ValueError, match="eval_every"):
        make(small(eval_every=1))


@pytest.mark.parametrize("bad, name", [
    (dict(algorithm="a2c"), "algorithm"), (dict(epsilon_high=0.0), "epsilon_high"),
    (dict(scale_rewards="std"), "scale_rewards"), (dict(loss_agg_mode="sum"), "loss_agg_mode"),
    (dict(kl_placement="both"), "kl_placement"), (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(lam=1.5), "lam"), (dict(gamma=-0.1), "gamma"), (dict(critic_lr=0.0), "critic_lr"),
    (dict(critic_layers=0), "critic_layers"), (dict(overlong_buffer_len=8), "overlong_buffer"),
    (dict(max_refill_rounds=-1), "max_refill_rounds"), (dict(eval_samples=0), "eval_samples"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(min_lr_ratio=2.0), "min_lr_ratio"),
    (dict(lr_scheduler_type="linear"), "lr_scheduler_type"),
    (dict(dynamic_sampling=True, samples_per_prompt=1, algorithm="ppo"), "samples_per_prompt")])
def test_bad_options_are_named(bad, name):
    with pytest.raises(ValueError, match=name):
        small(**bad)


def test_ppo_accepts_one_sample_per_prompt_and_grpo_does_not():
    small(algorithm="ppo", samples_per_prompt=1)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        small(samples_per_prompt=1)


CONFIG_FILE = """
algorithm = "ppo"
steps = 2
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 24
lr = 1e-4
critic_lr = 1e-3
critic_layers = 2
gamma = 1.0
lam = 0.95
epsilon_low = 0.2
epsilon_high = 0.28
dynamic_sampling = true
max_refill_rounds = 1
mask_truncated_completions = true
overlong_buffer_len = 4
overlong_penalty_factor = 0.5
loss_agg_mode = "seq-mean-token-mean"
kl_coef = 0.01
kl_placement = "reward"
kl_estimator = "k1"
lr_scheduler_type = "cosine"
warmup_steps = 1
min_lr_ratio = 0.1
eval_every = 1
eval_samples = 2
tlt = false
"""


@pytest.mark.slow
def test_tlt_train_takes_every_option_from_a_config_file(tmp_path, capsys):
    """The embedded task with PPO and the options from a TOML file, evaluation included; the
    metrics carry the critic's and the evaluation's numbers."""
    import json

    config = tmp_path / "ppo.toml"
    config.write_text(CONFIG_FILE)
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(out), "--no-progress",
                 "--tensorboard", "off"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for m in lines:
        assert m["train/value_loss"] is not None and m["eval/reward"] is not None
        assert m["eval/pass@2"] is not None and m["eval/pass@4"] is None
    assert lines[0]["train/lr"] == pytest.approx(1e-4)  # warm-up step 0 of 1: the full rate
    assert (out / "report.md").is_file()


@pytest.mark.parametrize("name", ["grpo_dapo.toml", "ppo.toml"])
def test_the_example_configs_load_into_train_configs(name):
    """examples/configs/: every key is an option of `tlt train` and every value a valid one."""
    from pathlib import Path

    from tlt_core.cli.config_file import parse_args
    from tlt_core.cli.main import build_parser
    from tlt_core.cli.options import dataclass_from_args

    path = Path(__file__).resolve().parents[1] / "examples" / "configs" / name
    args = parse_args(build_parser(), ["train", "--config", str(path)])
    config = dataclass_from_args(TrainConfig, args, "tlt train")
    assert config.eval_every >= 1 and config.epsilon_high == pytest.approx(0.28)


def test_cli_option_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--algorithm", "a2c"])
    assert "--algorithm" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--eval-data"):
        main(["train", "--eval-data", "held-out.jsonl"])
    with pytest.raises(SystemExit, match="--epsilon-high"):
        main(["train", "--epsilon-high", "-1"])


# Each option on the embedded task: the pre-trained embedded model on 16 of its problems, the
# reward measured before and after 16 steps on the same problems with the same seeds (8 samples
# each), so that the difference is the policy's. Measured: every option rose by 0.05-0.14 from
# 0.633 (`python -m pytest tests/test_rl_options.py -k embedded -s` prints them).
EMBEDDED_OPTIONS = {
    "grpo": {},
    "ppo": dict(algorithm="ppo", critic_lr=1e-3),
    "clip_higher": dict(epsilon_high=0.28),
    "dynamic_sampling": dict(dynamic_sampling=True),
    "mask_truncated": dict(mask_truncated_completions=True),
    "overlong_penalty": dict(overlong_buffer_len=32, overlong_penalty_factor=0.5),
    "scale_batch": dict(scale_rewards="batch"),
    "scale_none": dict(scale_rewards="none"),
    "seq_mean_token_mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "seq_mean_token_sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "dr_grpo": dict(loss_agg_mode="seq-mean-token-sum-norm", scale_rewards="none"),
    "kl_loss_k3": dict(kl_coef=0.05),
    "kl_reward_k1": dict(kl_coef=0.01, kl_placement="reward", kl_estimator="k1"),
    "cosine_warmup": dict(lr_scheduler_type="cosine", warmup_steps=2),
}


@pytest.fixture(scope="module")
def embedded():
    from tlt_core.embedded.workload import train_inputs

    return train_inputs(progress=False)


@pytest.mark.slow
def test_reward_rises_on_the_embedded_task_with_ppo_and_each_grpo_option(embedded):
    import copy

    problems = embedded.prompts[:16]
    rises = {}
    for name, options in EMBEDDED_OPTIONS.items():
        config = TrainConfig(**{**dict(steps=16, prompts_per_step=8, samples_per_prompt=8,
                                       max_new_tokens=128, lr=1e-4, minibatch_size=16,
                                       tlt=False, eval_samples=8), **options})
        driver = RLDriver(copy.deepcopy(embedded.policy), problems, embedded.reward_fn,
                          embedded.detokenize, embedded.stop_ids, config, evaluation=problems)
        before = driver.evaluate()["eval/reward"]
        for _ in range(config.steps):
            driver.step()
        rises[name] = (before, driver.evaluate()["eval/reward"])
    print({name: f"{a:.3f} -> {b:.3f}" for name, (a, b) in rises.items()})
    assert all(after > before + 0.03 for before, after in rises.values()), rises
    assert sum(after - before for before, after in rises.values()) / len(rises) > 0.06, rises
