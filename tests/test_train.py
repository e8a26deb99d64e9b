"""The RL driver (GRPO by default): resume = uninterrupted, 2 ranks = 1 rank (also with PPO and
the options that reduce over ranks), a real learning signal, TLT's log-probs, bad data / config /
rewards reported clearly."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target, train_drafter
import tlt_core.adaptive.policy as policy_module
from tlt_core.adaptive.policy import AdaptivePolicy
from tlt_core.drafting.tree import Strategy
from tlt_core.persistence.checkpoint_io import latest_checkpoint
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.data import DataError, load_prompts
from tlt_core.tasks.inputs import Prompt
from tlt_core.tasks.rewards import math_answer, math_reward, normalize_answer, score_all

GOOD = 7  # the toy task: reward = share of response tokens equal to GOOD


def toy_reward(prompt: str, response: str, reference: str) -> float:
    tokens = response.split()
    return sum(t == reference for t in tokens) / max(len(tokens), 1)


def toy_prompts():
    return [Prompt(str(p), tuple(p), str(GOOD)) for p in PROMPTS[:6]]


def detokenize(ids):
    return " ".join(map(str, ids))


def make(config, drafter=None, seed=0):
    torch.manual_seed(seed)
    target = tiny_target(sharpen=2.0)
    return RLDriver(target, toy_prompts(), toy_reward, detokenize, (), config, drafter=drafter)


def small(**overrides):
    base = dict(steps=4, prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
                lr=1e-2, minibatch_size=8, tlt=False, max_batch=16)
    return TrainConfig(**{**base, **overrides})


def test_reward_rises_with_a_real_learning_signal():
    trainer = make(small(steps=12))
    rewards = [trainer.step()["train/reward"] for _ in range(12)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_resume_equals_uninterrupted(tmp_path):
    """2 steps, a checkpoint folder, a resumed third step = 3 uninterrupted steps (SD off):
    policy, optimizer, RNG and history all come back."""
    whole = make(small(steps=3))
    for _ in range(3):
        whole.step()
    first = make(small(steps=3))
    for _ in range(2):
        first.step()
    saved = first.save(tmp_path / "checkpoints")
    assert saved == tmp_path / "checkpoints" / "step-000002" == latest_checkpoint(saved.parent)
    resumed = make(small(steps=3), seed=123)  # other initial weights: the checkpoint restores all
    resumed.resume(saved)
    assert resumed.state.step == 2
    resumed.step()
    keys = ("train/reward", "train/loss", "train/clip_fraction", "response_lengths")
    assert [[m[k] for k in keys] for m in resumed.state.history] == \
        [[m[k] for k in keys] for m in whole.state.history]
    for a, b in zip(whole.policy.parameters(), resumed.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="lr"):
        make(small(lr=0.5)).resume(saved)
    other = RLDriver(tiny_target(vocab=VOCAB + 1), toy_prompts(), toy_reward, detokenize, (),
                     small(steps=3))
    with pytest.raises(ValueError, match="another architecture .*vocab_size"):
        other.resume(saved)
    with pytest.raises(FileNotFoundError, match="resume"):
        resumed.resume(tmp_path / "missing")


def test_micro_batches_give_the_same_update():
    """Splitting a mini-batch into micro-batches (gradients accumulated) changes the padding,
    not the update."""
    whole = make(small(steps=2, micro_batch_tokens=10**6))
    split = make(small(steps=2, micro_batch_tokens=16))  # a sequence or two per micro-batch
    for _ in range(2):
        a, b = whole.step(), split.step()
        assert a["response_lengths"] == b["response_lengths"]
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-5
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-4
    for x, y in zip(whole.policy.parameters(), split.policy.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_tlt_rollout_logprobs_match_and_drafter_state_is_checkpointed(tmp_path, monkeypatch):
    target = tiny_target()  # sharp: the drafter is good, the watchdog keeps SD on
    drafter = train_drafter(target)
    trainer = RLDriver(target, toy_prompts(), toy_reward, detokenize, (),
                        small(tlt=True, steps=2, lr=1e-4), drafter=drafter)
    # One plan, SD on at every step (plain predicted at no speed, and never measured as the
    # mode's baseline): the calibration and the loop choose by measured step times, which on
    # a loaded machine can settle on plain decoding; what this test checks does not depend on
    # that choice.
    monkeypatch.setattr(policy_module, "BASELINE_STEPS", 0)
    trainer.adaptive = AdaptivePolicy((Strategy(6, 1, 7),), predict=lambda batch, context,
                                      plan: 1.0 if plan is not None else 1e-9)
    for _ in range(2):
        metrics = trainer.step()
        assert metrics["train/logprob_gap"] < 1e-4
        assert metrics["spec/sd_step_share"] > 0 and metrics["spec/acceptance_length"] > 1.5
        assert metrics["drafter_event"] == "ok"
    state = trainer.state_dict()
    assert {"drafter", "adaptive", "optimizer", "rng"} <= set(state)
    assert trainer.harvest is None and "spot" not in state  # one rank: nobody idles to train


# Options whose numbers come from every rank's share: reductions of the KL in the reward, the
# batch's reward std, PPO's whitening and explained variance, refills judged on gathered scores.
RANKED_OPTIONS = {
    "grpo": {},
    "grpo_options": dict(dynamic_sampling=True, mask_truncated_completions=True,
                         overlong_buffer_len=2, scale_rewards="batch", kl_coef=0.05,
                         kl_placement="reward", kl_estimator="k1",
                         loss_agg_mode="seq-mean-token-mean", epsilon_high=0.28,
                         lr_scheduler_type="cosine", eval_every=1),
    "ppo": dict(algorithm="ppo", samples_per_prompt=2, critic_lr=3e-2, kl_coef=0.05,
                loss_agg_mode="seq-mean-token-sum-norm", eval_every=1),
    # mini-batches of 3 of the 16 sequences: the last has 1, so rank 1 holds none of it
    "ppo_short_last_batch": dict(algorithm="ppo", minibatch_size=3, critic_lr=3e-2),
}


def make_ranked(options: dict):
    """The 2-rank test's trainer: stop id 5 ends some responses (masking has something to
    keep), held-out prompts for the evaluation."""
    torch.manual_seed(0)
    return RLDriver(tiny_target(sharpen=2.0), toy_prompts(), toy_reward, detokenize, (5,),
                    small(**{**dict(steps=2, micro_batch_tokens=16), **options}),
                    evaluation=[Prompt(str(p), tuple(p), str(GOOD)) for p in PROMPTS[6:8]])


def _rank_main(rank, world, rendezvous, out, options):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    trainer = make_ranked(options)  # ranks run unequal micro-batch counts
    for _ in range(2):
        trainer.step()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"history": [{k: m[k] for k in RANKED_METRICS}
                                   for m in trainer.state.history],
                       "weights": [p.detach().flatten()[:50].tolist()
                                   for p in trainer.policy.parameters()]}, handle)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see test_workers: leave without C++ static teardown


def _bf16_rank_main(rank, world, rendezvous, out):
    """One GRPO step of a bf16 policy over gloo; writes this rank's weights."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = RLDriver(tiny_target(sharpen=2.0).to(torch.bfloat16), toy_prompts(),
                       toy_reward, detokenize, (), small(steps=1))
    metrics = trainer.step()
    torch.save({"weights": [p.detach().float().clone() for p in trainer.policy.parameters()],
                "reward": metrics["train/reward"]}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see test_workers: leave without C++ static teardown


@pytest.mark.slow
def test_two_ranks_train_a_bf16_policy_in_lockstep(tmp_path):
    """bf16 gradients all-reduce over gloo (the CPU's multi-rank backend), and the float32
    master weights leave both ranks with the same bf16 weights, changed by the step."""
    out = str(tmp_path / "weights")
    mp.spawn(_bf16_rank_main, args=(2, str(tmp_path / "rendezvous"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    assert ranks[0]["reward"] == ranks[1]["reward"]
    initial = tiny_target(sharpen=2.0).to(torch.bfloat16)
    moved = False
    for first, second, start in zip(ranks[0]["weights"], ranks[1]["weights"],
                                    initial.parameters()):
        assert torch.equal(first, second)
        moved |= not torch.equal(first, start.detach().float())
    assert moved


RANKED_METRICS = ("train/reward", "rollout/groups_dropped", "rollout/refill_rounds",
                  "rollout/truncated_fraction", "eval/reward")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RANKED_OPTIONS))
def test_two_ranks_equal_one_rank(tmp_path, name):
    out = tmp_path / "rank0.json"
    mp.spawn(_rank_main, args=(2, str(tmp_path / "rendezvous"), str(out), RANKED_OPTIONS[name]),
             nprocs=2, join=True)
    got = json.loads(out.read_text())
    single = make_ranked(RANKED_OPTIONS[name])
    for _ in range(2):
        single.step()
    assert got["history"] == [{k: m[k] for k in RANKED_METRICS} for m in single.state.history]
    for theirs, mine in zip(got["weights"], single.policy.parameters()):
        torch.testing.assert_close(torch.tensor(theirs), mine.detach().flatten()[:50],
                                   rtol=1e-4, atol=1e-5)


def test_bad_config_is_named():
    for bad, name in ((dict(steps=0), "steps"), (dict(lr=-1.0), "lr"),
                      (dict(epsilon_low=1.5), "epsilon_low"),
                      (dict(micro_batch_tokens=0), "micro_batch_tokens"),
                      (dict(samples_per_prompt=1), "samples"),
                      (dict(kl_coef=float("nan")), "kl_coef")):
        with pytest.raises(ValueError, match=name):
            small(**bad)
    with pytest.raises(ValueError, match="prompts"):
        RLDriver(tiny_target(), [], toy_reward, detokenize, (), small())


def test_bad_data_rows_are_reported_with_line_numbers(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "2+2?", "answer": "4"}),
        "{not json",
        json.dumps({"prompt": "no answer"}),
        json.dumps(["a list"]),
        "",
        json.dumps({"prompt": "", "answer": "1"}),
        json.dumps({"prompt": "3*3?", "answer": 9}),
    ]) + "\n")
    data = load_prompts(path)
    assert [(e.prompt, e.answer, e.line) for e in data.examples] == [("2+2?", "4", 1),
                                                                      ("3*3?", "9", 7)]
    assert [line for line, _ in data.bad_rows] == [2, 3, 4, 6]
    assert "not JSON" in data.bad_rows[0][1] and "answer" in data.bad_rows[1][1]
    with pytest.raises(DataError, match="line 2"):
        load_prompts(path, on_bad_rows="error")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{}\n")
    with pytest.raises(DataError, match="no usable rows"):
        load_prompts(empty)
    with pytest.raises(FileNotFoundError, match="data"):
        load_prompts(tmp_path / "missing.jsonl")


def test_math_verifier_and_failing_reward_functions():
    assert math_answer("so the total is \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert math_answer("37;+04=41;#41") == "41"
    assert math_answer("It is 1,234.") == "1,234"
    assert math_answer("no digits") is None
    assert normalize_answer("1,000.0") == normalize_answer("+01000") == "1000"
    assert normalize_answer("3/6") == "1/2"
    assert math_reward("", "answer: \\boxed{12}", "12.0") == 1.0
    assert math_reward("", "#13", "12") == 0.0

    def flaky(prompt, response, reference):
        if response == "boom":
            raise RuntimeError("parser crashed")
        return float("nan") if response == "nan" else 1.0

    scored = score_all(flaky, ["p"] * 3, ["ok", "boom", "nan"], ["r"] * 3)
    assert [s.reward for s in scored] == [1.0, 0.0, 0.0]
    assert scored[0].error is None and "parser crashed" in scored[1].error
    assert "nan" in scored[2].error


def test_nothing_loaded_runs_code(tmp_path):
    """A checkpoint is safetensors and JSON: a state holding an arbitrary object is refused when
    saved, naming where it is; an older version's pickled checkpoint.pt is refused unread, by
    resume and by `tlt export --run` alike."""
    driver = make(small(steps=1))
    driver.step()
    make(small(steps=1)).resume(driver.save(tmp_path / "run" / "checkpoints"))
    driver.state.history[0]["payload"] = object()
    with pytest.raises(TypeError, match="state: history/0/payload is a builtins.object"):
        driver.save(tmp_path / "bad" / "checkpoints")
    assert not (tmp_path / "bad" / "checkpoints").exists()
    torch.save({"step": 1}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="older tlt_core.*start a new run"):
        make(small(steps=1)).resume(tmp_path / "checkpoint.pt")
    from tests.test_export import _cli

    for run in (tmp_path, tmp_path / "checkpoint.pt"):
        with pytest.raises(SystemExit, match="--run: .*older tlt_core.*start a new run"):
            _cli(["drafter", "--to", "eagle", str(tmp_path / "out"), "--run", str(run)])
