"""The embedded task: problems are deterministic in their seed; reference solutions are correct
step by step (checked here by redoing the arithmetic, not by asking the module); the checker
rewards exactly the right final answer; the tokenizer round-trips and rejects what it does not
know; response lengths are heavy-tailed (p99 >= 5x the median); warm-up batches put exactly the
response and its <eos> in the loss."""

import random
import re
from collections import Counter

import pytest
import torch

from tlt_core.embedded.task import CharTokenizer, Problem, TaskConfig, check_answer, count_correct_steps, generate_problems, length_stats, make_problem, parse_answer
from tlt_core.embedded.pretrain_data import make_batches

STEP = re.compile(r"([+-])([0-9]{2})=([0-9]{2})")


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="module")
def problems():
    return generate_problems(TaskConfig(seed=0, num_problems=5000))


# --- generator ----------------------------------------------------------------------------------

def test_same_seed_same_problems_different_seed_different_problems():
    first = generate_problems(TaskConfig(seed=3, num_problems=200))
    assert first == generate_problems(TaskConfig(seed=3, num_problems=200))
    other = generate_problems(TaskConfig(seed=4, num_problems=200))
    assert sum(a.prompt == b.prompt for a, b in zip(first, other)) < 5


def test_more_problems_extend_fewer():
    assert generate_problems(TaskConfig(seed=5, num_problems=300))[:40] == \
        generate_problems(TaskConfig(seed=5, num_problems=40))


def test_generator_leaves_global_rng_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_problems(TaskConfig(num_problems=50))
    assert random.random() == expected


def test_worked_example():
    assert make_problem(37, "+", 4) == Problem(
        prompt="37+04", solution="37;+04=41;+03=44;+02=46;+01=47;#47", answer="47", num_steps=4)
    assert make_problem(5, "-", 3) == Problem(
        prompt="05-03", solution="05;-03=02;-02=00;-01=99;#99", answer="99", num_steps=3)


def test_reference_solutions_are_correct_step_by_step(problems):
    prompt_format = re.compile(r"([0-9]{2})([+-])([0-9]{2})")
    for problem in problems:
        start, op, count = prompt_format.fullmatch(problem.prompt).groups()
        assert int(count) == problem.num_steps >= 1
        first, *steps, final = problem.solution.split(";")
        assert first == start and len(steps) == problem.num_steps
        value = int(start)
        for index, line in enumerate(steps):
            match = STEP.fullmatch(line)
            assert match, line
            line_op, term, result = match.groups()
            assert line_op == op  # the prompt's operator on every line
            assert int(term) == problem.num_steps - index  # counting down to 01
            value = (value + int(term) if op == "+" else value - int(term)) % 100
            assert int(result) == value
        assert final == f"#{value:02d}" and problem.answer == f"{value:02d}"
        assert check_answer(problem, problem.solution) == 1.0
        assert count_correct_steps(problem, problem.solution) == problem.num_steps


def test_make_problem_errors_name_the_argument():
    for args, name in [((100, "+", 3), "start"), ((-1, "+", 3), "start"),
                       ((5, "*", 3), "operator_symbol"), ((5, "+", 0), "num_steps"),
                       ((5, "+", 100), "num_steps")]:
        with pytest.raises(ValueError, match=name):
            make_problem(*args)


def test_config_errors_name_the_field():
    for kwargs, field in [({"num_problems": 0}, "num_problems"),
                          ({"median_steps": 0.0}, "median_steps"),
                          ({"median_steps": float("nan")}, "median_steps"),
                          ({"length_sigma": -1.0}, "length_sigma"), ({"min_steps": 0}, "min_steps"),
                          ({"max_steps": 100}, "max_steps"),
                          ({"min_steps": 5, "max_steps": 4}, "max_steps"),
                          ({"operators": "*"}, "operators"), ({"operators": ""}, "operators"),
                          ({"operators": "++"}, "operators")]:
        with pytest.raises(ValueError, match=field):
            TaskConfig(**kwargs)
    with pytest.raises(TypeError, match="seed"):
        TaskConfig(seed=1.5)


def test_operators_subset_and_step_bounds():
    config = TaskConfig(num_problems=100, operators="+", min_steps=2, max_steps=5)
    only_plus = generate_problems(config)
    assert all("-" not in p.prompt and 2 <= p.num_steps <= 5 for p in only_plus)


# --- checker ------------------------------------------------------------------------------------

def test_checker_rewards_only_the_right_final_answer():
    problem = make_problem(37, "+", 4)
    work = "37;+04=41;+03=44;+02=46;+01=47;"
    assert check_answer(problem, work + "#47") == 1.0
    assert check_answer(problem, "#47") == 1.0  # only the final answer is rewarded
    for malformed in [work + "#48", work + "#46",  # wrong number
                      work + "#47;", work + "#47#47", work + "#47+", work + "#047",  # junk
                      work, work + "#", "", "47",  # no marker, no answer, empty
                      work[:-5], "37;+04=41;+03=44;+02=46;+01=4", work + "#4",  # truncated
                      "#<eos>", "#47<eos>", "#4 7", "# 47",  # garbage
                      "#\u0664\u0667"]:  # non-ASCII digits
        assert check_answer(problem, malformed) == 0.0, malformed
    assert parse_answer(work + "#47") == "47"
    assert parse_answer(work) is None and parse_answer("#") is None and parse_answer("#1#2") is None


def test_count_correct_steps_stops_at_the_first_mistake():
    problem = make_problem(37, "+", 4)
    assert count_correct_steps(problem, "37;+04=41;+03=45;+02=47;+01=48;#48") == 1
    assert count_correct_steps(problem, "37;+04=41;+03=44;+02") == 2
    assert count_correct_steps(problem, "38;+04=42;") == 0
    assert count_correct_steps(problem, "") == 0


# --- tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_round_trips(tokenizer, problems):
    assert tokenizer.vocab_size == len(tokenizer.pieces) == 19
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert len(set(tokenizer.pieces)) == tokenizer.vocab_size
    for problem in problems[:200]:
        for text in (problem.prompt, problem.solution):
            ids = tokenizer.encode(text)
            assert len(ids) == len(text)
            assert tokenizer.decode(ids) == text
    assert tokenizer.decode(range(tokenizer.vocab_size)) == "".join(tokenizer.pieces)
    prompt = tokenizer.prompt_ids("37+04")
    assert prompt[0] == tokenizer.bos_id and tokenizer.decode(prompt[1:]) == "37+04?"
    response = tokenizer.response_ids("37;+01=38;#38")
    assert response[-1] == tokenizer.eos_id
    assert tokenizer.decode_response(response + [tokenizer.pad_id, 5]) == "37;+01=38;#38"
    assert tokenizer.decode_response(torch.tensor(response[:-1])) == "37;+01=38;#38"


def test_tokenizer_rejects_unknown_characters_and_ids(tokenizer):
    with pytest.raises(ValueError, match="'x'"):
        tokenizer.encode("12+x3")
    with pytest.raises(ValueError, match="' '"):
        tokenizer.encode("12 ")
    with pytest.raises(ValueError, match="19"):
        tokenizer.decode([3, 19])
    with pytest.raises(ValueError, match="-1"):
        tokenizer.decode([-1])
    with pytest.raises(TypeError, match="ids"):
        tokenizer.decode([3.0])
    with pytest.raises(TypeError, match="text"):
        tokenizer.encode(b"12")


# --- length distribution ------------------------------------------------------------------------

def test_response_lengths_are_heavy_tailed(tokenizer, problems):
    """The tail that speculative decoding is for: p99 response length >= 5x the median, in
    tokens the model generates (response + <eos>), over 5000 reference solutions."""
    lengths = [len(tokenizer.response_ids(p.solution)) for p in problems]
    stats = length_stats(lengths)
    assert stats["p99_over_median"] >= 5.0, stats
    assert stats["p99"] >= 5 * stats["median"], stats
    assert stats["max"] <= 512, stats
    assert stats["count"] == 5000


def test_length_stats_by_hand():
    stats = length_stats([1, 2, 3, 4, 100])
    assert stats["median"] == 3 and stats["max"] == 100 and stats["mean"] == 22
    assert stats["p90"] == pytest.approx(4 + 0.6 * 96)  # linear interpolation
    assert stats["p99"] == pytest.approx(4 + 0.96 * 96)
    assert stats["p99_over_median"] == pytest.approx(stats["p99"] / 3)
    with pytest.raises(ValueError, match="lengths"):
        length_stats([])


# --- warm-up batches ----------------------------------------------------------------------------

def test_warmup_mask_covers_exactly_the_response_and_eos(tokenizer, problems):
    subset = problems[:300]
    by_prompt = {tokenizer.decode(tokenizer.prompt_ids(p.prompt)): p for p in subset}
    seen = Counter()
    for input_ids, loss_mask in make_batches(subset, tokenizer, 16, seed=1):
        assert input_ids.dtype == torch.int64 and loss_mask.dtype == torch.bool
        assert input_ids.shape == loss_mask.shape and input_ids.shape[0] <= 16
        for ids, mask in zip(input_ids.tolist(), loss_mask.tolist()):
            length = ids.index(tokenizer.eos_id) + 1
            prompt_length = ids.index(tokenizer.prompt_end_id) + 1
            problem = by_prompt[tokenizer.decode(ids[:prompt_length])]
            response = tokenizer.response_ids(problem.solution)
            assert ids[:length] == tokenizer.prompt_ids(problem.prompt) + response
            assert mask == [False] * prompt_length + [True] * (length - prompt_length) + \
                [False] * (len(ids) - length)
            assert all(token == tokenizer.pad_id for token in ids[length:])  # right padding
            seen[problem.prompt] += 1
        assert bool((input_ids[loss_mask] != tokenizer.pad_id).all())  # padding never in the loss
        assert input_ids[:, -1].ne(tokenizer.pad_id).any()  # padded to the batch's longest only
    assert seen == Counter(p.prompt for p in subset)  # every problem once


def test_warmup_batches_are_deterministic_and_seeded(tokenizer, problems):
    def flat(seed, bucket_batches=64):
        return [(ids.tolist(), mask.tolist())
                for ids, mask in make_batches(problems[:200], tokenizer, 8, seed=seed,
                                              bucket_batches=bucket_batches)]

    assert flat(0) == flat(0)
    assert flat(0) != flat(1)
    assert flat(0, bucket_batches=1) != flat(0)


def test_warmup_bucketing_cuts_padding(tokenizer, problems):
    def padding(bucket_batches):
        total = real = 0
        for ids, _ in make_batches(problems, tokenizer, 32, seed=0,
                                   bucket_batches=bucket_batches):
            total += ids.numel()
            real += int((ids != tokenizer.pad_id).sum())
        return total / real

    assert padding(64) < 1.15 < 2.0 < padding(1)


def test_warmup_bad_arguments(tokenizer, problems):
    with pytest.raises(ValueError, match="batch_size"):
        make_batches(problems[:4], tokenizer, 0, seed=0)
    with pytest.raises(ValueError, match="problems"):
        make_batches([], tokenizer, 4, seed=0)
    with pytest.raises(TypeError, match="problems"):
        make_batches(["37+04"], tokenizer, 4, seed=0)
    with pytest.raises(TypeError, match="seed"):
        make_batches(problems[:4], tokenizer, 4, seed=None)
