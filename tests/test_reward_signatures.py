"""Reward functions written for TRL (`f(prompts, completions, **kwargs)`, batched) and veRL
(`compute_score(data_source, solution_str, ground_truth, extra_info)`) score as they would
there, told apart from ours by their parameters; a function that raises or returns no number
costs only the samples it fails on, each recorded with the function's name; nothing else is
lost."""

import json

import pytest
import torch

from tests.speculative_fixtures import VOCAB, tiny_target
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.data import load_prompts
from tlt_core.tasks.inputs import Prompt, load_reward
from tlt_core.tasks.reward_signatures import TLT, TRL, VERL, reward_signature
from tlt_core.tasks.rewards import math_reward, score_all

CHAT = ({"role": "user", "content": "What is 2+2?"},)
ROWS = [{"question": "2+2?", "answer": "4", "data_source": "toy", "extra_info": {"index": 0}},
        {"question": "What is 2+2?", "answer": "4", "data_source": "toy",
         "extra_info": {"index": 1}}]


def trl_reward(prompts, completions, answer, **kwargs):
    """TRL's documented shape: completions are strings, or message lists for chat prompts."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(text.strip() == a) for text, a in zip(texts, answer)]


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "source": data_source}


def test_each_signature_is_told_apart_by_its_parameters():
    assert reward_signature(math_reward) == TLT
    assert reward_signature(lambda prompt, response, reference: 1.0) == TLT
    assert reward_signature(trl_reward) == TRL
    assert reward_signature(lambda completions, **kwargs: [1.0] * len(completions)) == TRL
    assert reward_signature(verl_compute_score) == VERL
    assert reward_signature(lambda data_source, solution_str, ground_truth: 1.0) == VERL


def test_bad_input_gets_a_clear_error_a_reward_of_another_shape_names_the_forms():
    def two_args(response, reference):
        return 1.0

    with pytest.raises(ValueError, match=r"two_args\(response, reference\).*TRL's.*veRL's"):
        reward_signature(two_args)
    with pytest.raises(ValueError, match="not callable"):
        reward_signature(3)


def test_trl_reward_gets_the_batch_the_data_columns_and_chat_completions():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return trl_reward(prompts, completions, **kwargs)

    scored = score_all(spy, ["2+2?", "What is 2+2?"], ["4", "5"], ["4", "4"],
                       messages=[None, CHAT], rows=ROWS)
    assert [s.reward for s in scored] == [1.0, 0.0] and all(s.error is None for s in scored)
    assert seen["prompts"] == ["2+2?", list(CHAT)]  # as TRL: the messages of a chat prompt
    assert seen["completions"] == ["4", [{"role": "assistant", "content": "5"}]]
    assert seen["answer"] == ["4", "4"] and seen["extra_info"] == [{"index": 0}, {"index": 1}]

    def named_only(completions, answer):  # no **kwargs: only the fields it names
        return [float(c == a) for c, a in zip(completions, answer)]

    assert [s.reward for s in score_all(named_only, ["p"] * 2, ["4", "3"], ["4", "4"],
                                        rows=ROWS)] == [1.0, 0.0]


def test_verl_compute_score_gets_its_keywords_and_its_dict_score_is_read():
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return verl_compute_score(data_source, solution_str, ground_truth, extra_info)

    scored = score_all(compute_score, ["p"] * 2, ["4", "5"], ["4", "4"], rows=ROWS)
    assert [s.reward for s in scored] == [1.0, 0.0]
    assert calls[0] == ("toy", "4", "4", {"index": 0})
    # a compute_score without extra_info is not given it; a row without the fields gives None
    bare = score_all(lambda data_source, solution_str, ground_truth: float(data_source is None),
                     ["p"], ["4"], ["4"])
    assert bare[0].reward == 1.0


def test_a_reward_that_raises_costs_only_its_samples_and_is_named():
    def trl_flaky(prompts, completions, **kwargs):
        if "boom" in completions:
            raise RuntimeError("parser crashed")
        return [1.0] * len(completions)

    scored = score_all(trl_flaky, ["p"] * 3, ["ok", "boom", "ok"], ["r"] * 3)
    assert [s.reward for s in scored] == [1.0, 0.0, 1.0]  # retried one sample at a time
    assert scored[0].error is None and scored[2].error is None
    assert "trl_flaky: RuntimeError: parser crashed" in scored[1].error

    def trl_one_value(prompts, completions, **kwargs):
        return [1.0]

    # values that cannot be matched to samples score none of them, and say why
    short = score_all(trl_one_value, ["p"] * 2, ["a", "b"], ["r"] * 2)
    assert [s.reward for s in short] == [0.0, 0.0]
    assert all("trl_one_value: RewardCountError: returned 1 values for 2 completions" in s.error
               for s in short)

    def verl_no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0} if solution_str == "x" else None

    scored = score_all(verl_no_score, ["p"] * 2, ["x", "y"], ["r"] * 2)
    assert [s.reward for s in scored] == [0.0, 0.0]
    assert "verl_no_score: ValueError: returned a dict without a 'score'" in scored[0].error
    assert "returned None" in scored[1].error


def test_bad_input_gets_a_clear_error_mismatched_columns():
    with pytest.raises(ValueError, match="rows: 1 entries for 2 responses"):
        score_all(trl_reward, ["p"] * 2, ["a", "b"], ["r"] * 2, rows=[{}])


def test_verl_data_and_a_verl_reward_loaded_by_name(tmp_path, monkeypatch):
    """The seam end to end without a model: veRL's row layout read by load_prompts, its
    compute_score loaded as `tlt train --reward module:compute_score` would, scored with the
    rows the driver passes."""
    (tmp_path / "verl_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(data_source == 'openai/gsm8k' and\n"
        "                           solution_str.endswith(ground_truth))}\n"
        "def unusable(text):\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps({
        "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "48+24?"}],
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"index": 0}}) + "\n")
    examples = load_prompts(path).examples
    reward = load_reward("verl_rewards:compute_score")
    scored = score_all(reward, [e.prompt for e in examples] * 2, ["so 72", "so 71"],
                       [e.answer for e in examples] * 2,
                       messages=[e.messages for e in examples] * 2,
                       rows=[e.row for e in examples] * 2)
    assert [s.reward for s in scored] == [1.0, 0.0]
    with pytest.raises(ValueError, match="unusable"):
        load_reward("verl_rewards:unusable")


def test_the_driver_gives_trl_and_verl_rewards_the_data_rows():
    """An RL step scores with the prompts' rows (what load_prompts keeps as Example.row); a
    reward that raises is counted and named in the step's metrics."""
    row = {"good": "7", "data_source": "toy"}
    prompts = [Prompt(f"{i} 3 9", (i % VOCAB, 3, 9), "7", None, row) for i in range(4)]
    seen = []

    def trl_share(prompts, completions, good, **kwargs):
        seen.append(good)
        return [sum(t == g for t in c.split()) / max(len(c.split()), 1)
                for c, g in zip(completions, good)]

    def verl_raises(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError(data_source)

    config = TrainConfig(steps=1, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4,
                         lr=1e-2, minibatch_size=4, tlt=False, max_batch=8)
    for reward in (trl_share, verl_raises):
        torch.manual_seed(0)
        metrics = RLDriver(tiny_target(sharpen=2.0), prompts, reward,
                           lambda ids: " ".join(map(str, ids)), (), config).step()
        if reward is trl_share:
            assert seen and seen[0] == ["7"] * 4 and metrics["train/reward_errors"] == 0
        else:
            assert metrics["train/reward_errors"] == 4
            assert "verl_raises: KeyError: 'toy'" in metrics["first_reward_error"]
