"""Prompt data a user already has — JSON Lines, Parquet, a `datasets` folder, CSV/JSON through
`datasets` — read into the same examples, with GSM8K answers and chat-message prompts
understood and every bad row reported by its number; and the generated arithmetic set:
deterministic, correct, and readable by load_prompts and math_reward."""

import json
import re
from pathlib import Path

import pytest

from tlt_core.tasks.arithmetic_problems import generate_problems, write_jsonl
from tlt_core.tasks.data import DataError, load_prompts
from tlt_core.tasks.rewards import math_reward

GSM8K_ROW = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold "
                         "half as many clips in May. How many clips did Natalia sell altogether "
                         "in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
                       "<<48+24=72>>72 clips altogether in April and May.\n#### 72"}
CHAT = [{"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "What is 2+2?"}]
COMMITTED = Path(__file__).parent / "data" / "arithmetic-32.jsonl"


def write_lines(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))
    return path


def summary(data):
    return [(e.prompt, e.answer, e.line) for e in data.examples]


def test_jsonl_bad_rows_are_reported_by_line(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [
        {"prompt": "2+2?", "answer": "4"},
        "{not json",
        {"prompt": "no answer"},
        {"prompt": ["not", "messages"], "answer": "1"},
        {"prompt": "nan answer", "answer": float("nan")},
        {"prompt": "3*3?", "answer": 9},
    ])
    data = load_prompts(path)
    assert summary(data) == [("2+2?", "4", 1), ("3*3?", "9", 6)]
    assert data.unit == "line" and (data.prompt_key, data.answer_key) == ("prompt", "answer")
    assert [line for line, _ in data.bad_rows] == [2, 3, 4, 5]
    assert "not JSON" in data.bad_rows[0][1] and "'answer'" in data.bad_rows[1][1]
    with pytest.raises(DataError, match="line 4"):
        load_prompts(path, on_bad_rows="error")


def test_explicit_field_names_override_the_defaults(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [
        {"prompt": "ignored", "instruction": "2+2?", "answer": "5", "target": "4"}])
    data = load_prompts(path, prompt_key="instruction", answer_key="target")
    assert summary(data) == [("2+2?", "4", 1)]
    with pytest.raises(DataError, match="'query'"):
        load_prompts(path, prompt_key="query")
    for bad in ({"prompt_key": ""}, {"answer_key": 3}, {"split": ""}, {"on_bad_rows": "drop"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            load_prompts(path, **bad)


@pytest.mark.parametrize("row, fields", [
    (GSM8K_ROW, ("question", "answer")),
    ({"problem": "Halve 1.", "solution": "So it is $\\boxed{\\frac{1}{2}}$."},
     ("problem", "solution")),
    ({"messages": CHAT, "reference": "4"}, ("messages", "reference")),
    ({"prompt": "p", "question": "q", "answer": "1", "solution": "2"}, ("prompt", "answer")),
])
def test_fields_are_found_by_the_documented_rule(tmp_path, row, fields):
    data = load_prompts(write_lines(tmp_path / "data.jsonl", [row]))
    assert (data.prompt_key, data.answer_key) == fields


def test_gsm8k_answers_give_the_final_answer_and_keep_the_solution(tmp_path):
    data = load_prompts(write_lines(tmp_path / "gsm8k.jsonl", [
        GSM8K_ROW, {"question": "1+1?", "answer": "2"}, {"question": "q", "answer": "#### "}]))
    first, second = data.examples
    assert (first.prompt, first.answer, first.solution) == (GSM8K_ROW["question"], "72",
                                                            GSM8K_ROW["answer"])
    assert (second.answer, second.solution) == ("2", None)
    assert [(row, "empty final answer" in why) for row, why in data.bad_rows] == [(3, True)]
    assert math_reward(first.prompt, "so the answer is 72", first.answer) == 1.0


def test_chat_message_prompts(tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", [
        {"prompt": CHAT, "answer": "4"},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}],
         "answer": "1"},
        {"prompt": [{"role": "system", "content": "only a system message"}], "answer": "1"},
        {"prompt": [{"role": "user", "content": ["a", "list"]}], "answer": "1"},
        {"prompt": [], "answer": "1"},
    ])
    data = load_prompts(path)
    (example,) = data.examples
    assert example.prompt == "What is 2+2?" and example.messages == tuple(CHAT)
    assert [line for line, _ in data.bad_rows] == [2, 3, 4, 5]
    assert "message 2" in data.bad_rows[0][1] and "wizard" in data.bad_rows[0][1]
    assert "user message" in data.bad_rows[1][1] and "message 1" in data.bad_rows[2][1]


def test_parquet_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW, {"question": None, "answer": "3"},
                                         {"question": "5-2?", "answer": "3"}]), path)
    data = load_prompts(path)
    assert summary(data) == [(GSM8K_ROW["question"], "72", 1), ("5-2?", "3", 3)]
    assert data.unit == "row" and [row for row, _ in data.bad_rows] == [2]
    with pytest.raises(DataError, match="row 2"):
        load_prompts(path, on_bad_rows="error")


VERL_ROW = {  # veRL's GSM8K preprocessing: chat-message prompt, nested ground truth
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": GSM8K_ROW["question"]}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": GSM8K_ROW["answer"],
                   "question": GSM8K_ROW["question"]},
}


def _verl_files(tmp_path) -> dict[str, Path]:
    """The same veRL rows as JSON Lines, Parquet and a saved datasets folder."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    rows = [VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule", "ground_truth": "9"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "verl"))
    return {"jsonl": write_lines(tmp_path / "verl.jsonl", rows),
            "parquet": tmp_path / "verl.parquet", "datasets": tmp_path / "verl"}


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_dotted_field_paths_read_verl_data(tmp_path, kind):
    path = _verl_files(tmp_path)[kind]
    for answer_key in (None, "reward_model.ground_truth"):  # veRL's path is a default too
        data = load_prompts(path, answer_key=answer_key)
        assert (data.prompt_key, data.answer_key) == ("prompt", "reward_model.ground_truth")
        assert [(e.prompt, e.answer) for e in data.examples] == [
            (GSM8K_ROW["question"], "72"), (GSM8K_ROW["question"], "9")]
        assert data.examples[0].messages == tuple(VERL_ROW["prompt"])
        assert data.examples[0].row["data_source"] == "openai/gsm8k"  # kept for rewards
        assert data.examples[0].row["extra_info"]["index"] == 0
    other = load_prompts(path, prompt_key="extra_info.question", answer_key="extra_info.answer")
    assert [(e.prompt, e.answer) for e in other.examples][0] == (GSM8K_ROW["question"], "72")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_bad_input_gets_a_clear_error_a_missing_field_path_names_the_keys_there(tmp_path, kind):
    path = _verl_files(tmp_path)[kind]
    with pytest.raises(DataError, match=r"no 'reward_model\.answer' field \('reward_model' has "
                                        r"'style', 'ground_truth'\)"):
        load_prompts(path, answer_key="reward_model.answer")
    with pytest.raises(DataError, match=r"'reward_model\.ground_truth\.value'.*"
                                        r"'reward_model\.ground_truth' is a str"):
        load_prompts(path, answer_key="reward_model.ground_truth.value")
    with pytest.raises(DataError, match=r"no 'query' field \(the row's keys: 'data_source', "
                                        r"'prompt', 'ability', 'reward_model', 'extra_info'\)"):
        load_prompts(path, prompt_key="query")


def test_a_key_with_a_dot_in_its_name_is_read_as_that_key(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [
        {"prompt": "2+2?", "reward_model.ground_truth": "4", "reward_model": {"ground_truth": 5}}])
    assert load_prompts(path, answer_key="reward_model.ground_truth").examples[0].answer == "4"


def test_a_saved_dataset_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": CHAT, "answer": 4},
                                             {"prompt": CHAT, "answer": None}]),
        "test": datasets.Dataset.from_list([GSM8K_ROW])})
    splits.save_to_disk(str(tmp_path / "dict"))
    train = load_prompts(tmp_path / "dict")
    assert train.split == "train" and [(e.prompt, e.answer) for e in train.examples] == [
        ("What is 2+2?", "4")]
    assert train.examples[0].messages == tuple(CHAT) and train.bad_rows[0][0] == 2
    test = load_prompts(tmp_path / "dict", split="test")
    assert test.split == "test" and test.examples[0].answer == "72"
    with pytest.raises(ValueError, match="split.*'validation'.*test, train"):
        load_prompts(tmp_path / "dict", split="validation")
    datasets.Dataset.from_list([GSM8K_ROW]).save_to_disk(str(tmp_path / "one"))
    assert load_prompts(tmp_path / "one").examples[0].answer == "72"
    with pytest.raises(ValueError, match="split"):
        load_prompts(tmp_path / "one", split="train")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="save_to_disk"):
        load_prompts(tmp_path / "plain")


def test_csv_and_json_files_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    csv = tmp_path / "data.csv"
    csv.write_text('question,answer\n2+2?,4\n,5\n"Add 48 and 24.","48+24=72\n#### 72"\n')
    data = load_prompts(csv)
    assert summary(data) == [("2+2?", "4", 1), ("Add 48 and 24.", "72", 3)]
    assert [row for row, _ in data.bad_rows] == [2]
    array = tmp_path / "data.json"
    array.write_text(json.dumps([GSM8K_ROW, {"question": "1+1?", "answer": 2}]))
    assert [e.answer for e in load_prompts(array).examples] == ["72", "2"]
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(DataError, match="broken.json"):
        load_prompts(broken)
    with pytest.raises(ValueError, match="split"):
        load_prompts(csv, split="train")


def test_missing_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts(tmp_path / "missing.jsonl")
    empty = write_lines(tmp_path / "empty.jsonl", [{}])
    with pytest.raises(DataError, match="no usable rows.*'prompt', 'question'"):
        load_prompts(empty)


# The generated arithmetic set.

_STEP = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
          "/": lambda a, b: a / b}


def test_generated_problems_are_deterministic():
    rows = generate_problems(50, seed=7)
    assert rows == generate_problems(50, seed=7)
    assert generate_problems(20, seed=7) == rows[:20]  # a longer list extends a shorter one
    assert generate_problems(50, seed=8) != rows
    assert len({row["question"] for row in rows}) == 50
    assert generate_problems(0) == []
    with pytest.raises(ValueError, match="n"):
        generate_problems(-1)
    with pytest.raises(TypeError, match="seed"):
        generate_problems(3, seed="0")


def test_generated_arithmetic_is_right():
    """Every step re-evaluated: its operands come from the question or earlier steps, its result
    is the operation's exact integer value, and the final answer is the last step's."""
    step_counts = set()
    for row in generate_problems(300, seed=1):
        known = {int(n) for n in re.findall(r"\d+", row["question"])}
        known |= {2} if "half" in row["question"] else set()
        steps = _STEP.findall(row["answer"])
        assert 1 <= len(steps) <= 3, row
        step_counts.add(len(steps))
        for a, op, b, result in steps:
            a, b, result = int(a), int(b), int(result)
            assert {a, b} <= known, row
            assert _APPLY[op](a, b) == result >= 0, row
            known.add(result)
        assert row["answer"].splitlines()[-1] == f"#### {steps[-1][3]}", row
    assert step_counts == {1, 2, 3}


def test_a_written_set_is_read_back_and_its_solutions_score_one(tmp_path):
    rows = generate_problems(40, seed=3)
    write_jsonl(tmp_path / "arith.jsonl", rows)
    data = load_prompts(tmp_path / "arith.jsonl")
    assert not data.bad_rows and [e.prompt for e in data.examples] == [r["question"] for r in rows]
    for example, row in zip(data.examples, rows):
        assert example.solution == row["answer"]
        assert math_reward(example.prompt, row["answer"], example.answer) == 1.0
        assert math_reward(example.prompt, row["answer"], row["answer"]) == 1.0
    with pytest.raises(TypeError, match="rows"):
        write_jsonl(tmp_path / "bad.jsonl", [["not a dict"]])


def test_the_committed_set_is_the_generated_one(tmp_path):
    """Regenerate with: python -c "from tlt_core.tasks.arithmetic_problems import *;
    write_jsonl('tests/data/arithmetic-32.jsonl', generate_problems(32, seed=0))" """
    write_jsonl(tmp_path / "fresh.jsonl", generate_problems(32, seed=0))
    assert (tmp_path / "fresh.jsonl").read_bytes() == COMMITTED.read_bytes()


# Bad input gets a clear error, and in skip mode no row aborts the load.

def test_bad_input_gets_a_clear_error_no_row_aborts_a_skipping_load(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [
        '{"prompt": "big", "answer": ' + "9" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
        {"prompt": "deep", "answer": "1", "meta": [[[[[[[[[[1]]]]]]]]]]},
        {"prompt": "2+2?", "answer": "4"},
    ])
    data = load_prompts(path, on_bad_rows="skip")
    assert summary(data) == [("deep", "1", 3), ("2+2?", "4", 4)]
    assert [line for line, _ in data.bad_rows] == [1, 2]
    with pytest.raises(DataError, match="line 1.*line 2"):
        load_prompts(path, on_bad_rows="error")


def test_bad_input_gets_a_clear_error_non_finite_answers_are_refused(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [
        '{"prompt": "a", "answer": NaN}', '{"prompt": "b", "answer": -Infinity}',
        '{"prompt": "c", "answer": 1e999}', {"prompt": "d", "answer": "nan"},
        {"prompt": "e", "answer": "Work.\n#### inf"}, {"prompt": "f", "answer": "1e999"},
        {"prompt": "g", "answer": "1e99"}, {"prompt": "h", "answer": "infinite"}])
    data = load_prompts(path)
    assert summary(data) == [("g", "1e99", 7), ("h", "infinite", 8)]
    assert [line for line, _ in data.bad_rows] == [1, 2, 3, 4, 5, 6]
    assert "non-finite" in data.bad_rows[3][1]


def test_nothing_a_user_gave_is_lost_bom_and_non_utf8_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9?", "answer": "1"}\n'
                     b'{"prompt": "caf\xe9?", "answer": "2"}\n'  # Latin-1
                     b'{"prompt": "ok", "answer": "3"}\n')
    data = load_prompts(path)
    assert summary(data) == [("café?", "1", 1), ("ok", "3", 3)]
    assert data.bad_rows == [(2, "not UTF-8 (byte 0xe9 at column 16); re-save the file as "
                                 "UTF-8")]
    with pytest.raises(DataError, match="line 2: not UTF-8"):
        load_prompts(path, on_bad_rows="error")


def test_bad_input_gets_a_clear_error_corrupt_parquet_names_the_file(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW]), path)
    data = path.read_bytes()
    for broken in (data[: len(data) // 2], b"not parquet at all", b""):
        path.write_bytes(broken)
        with pytest.raises(DataError, match="data.parquet"):
            load_prompts(path)
