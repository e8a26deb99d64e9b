"""The math verifier: one final answer per response, compared with math-verify. The same answer
written another way scores 1.0, a wrong one 0.0, a malformed one 0.0 without raising, from any
thread; the format reward and the mix of the two."""

import threading
import time

import pytest

from tlt_core.tasks.rewards import (RewardMix, format_reward, math_answer, math_reward,
                                    normalize_answer, reference_answer)

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
                  "#### 72")

RIGHT = [  # (response, reference): the same answer, so each scores 1.0
    ("### Step 1: add 5+7\nSo the total is 12.", "12"),
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("\\dfrac{3}{4}", "\\frac{3}{4}"),
    ("\\boxed{12\\text{ apples}}", "12"),
    ("\\boxed{x=3}", "3"),
    ("(1,2)", "(1, 2)"),
    ("1e3", "1000"),
    ("The answer is 1,000.", "1000"),
    ("In May she sold 24, and 48+24=72, so the answer is 72", GSM8K_SOLUTION),
    ("answer: \\boxed{12}", "12.0"),
    ("The final answer is 72 dollars.", "72"),
    ("**Answer:** $\\frac{\\sqrt{2}}{2}$", "\\frac{1}{\\sqrt{2}}"),
    ("So we get $x = 0.5$.", "\\frac{1}{2}"),
    ("She pays 3 * 4 = $12.\n#### 12", "12"),
    ("37;+04=41;#41", "41"),
    ("The answer is Monday.", "monday"),
    ("Step 1: 5 - 7 = -2", "-2"),
]

WRONG = [  # (response, reference): a different answer, so each scores 0.0
    ("### Step 1: add 5+7\nSo the total is 13.", "12"),
    ("\\boxed{\\frac{1}{3}}", "1/2"),
    ("\\boxed{x=4}", "3"),
    ("(2,1)", "(1, 2)"),
    ("1e4", "1000"),
    ("The answer is 1,001.", "1000"),
    ("In May she sold 24, so the answer is 71", GSM8K_SOLUTION),
    ("#13", "12"),
    ("The answer is Mondya.", "Monday"),  # math-verify alone: M*o*n*d*y*a == M*o*n*d*a*y
    ("Maybe 12, maybe 13", "12"),  # only the last number counts: listing candidates earns 0
    ("\\boxed{12}, or maybe 13", "13"),  # an explicit answer beats a later number
    ("no digits at all", "12"),
    ("", "12"),
]


@pytest.mark.parametrize("response, reference", RIGHT)
def test_the_same_answer_written_differently_scores_one(response, reference):
    assert math_reward("", response, reference) == 1.0


@pytest.mark.parametrize("response, reference", WRONG)
def test_a_different_answer_scores_zero(response, reference):
    assert math_reward("", response, reference) == 0.0


@pytest.mark.parametrize("response, answer", [
    ("### Step 1: add 5+7\nSo the total is 12.", "12"),  # a heading's number is not the answer
    ("### 3.\nSo the total is 12.", "12"),
    ("so the total is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{1} first, then \\boxed{2}", "2"),
    ("#### 72\n", "72"),
    ("The answer is 3. Check: 3+0=3", "3"),
    ("The answer is 12 because 5+7=12", "12"),
    ("We get $x = \\frac{1}{2}$.", "x = \\frac{1}{2}"),
    ("5+7", "5+7"),
    ("It is 1,234.", "1,234"),
    ("Points 1,2 and 3", "3"),
    ("no digits", None),
])
def test_the_final_answer_is_the_last_one_stated(response, answer):
    assert math_answer(response) == answer


@pytest.mark.parametrize("response, reward", [
    # a worked response ends with its last step's equation: its right-hand side is the answer
    ("Natalia sold 48/2 = 24 clips in May. Altogether she sold 48+24 = 72.", 1.0),
    ("... 48+24 = 72.", 1.0),
    ("48/2=24, 48+24 = 72.", 1.0),
    ("#### 48+24 = 72", 1.0),
    ("The answer is 48 + 24 = 72 clips.", 1.0),
    ("\\boxed{48+24=72}", 1.0),
    ("Total: 72 = 48+24.", 1.0),  # the result on the left, its value on the right
    ("48+24 = 70+2", 1.0),
    ("In April 48.\nTotal: 72 = 48+24.\n", 1.0),
    ("We check 5 = 5\n72", 1.0),  # an equation on an earlier line is not the last line's
    # strict: the last right-hand side, and a plain number just left of it, must be right
    ("Natalia sold 48/2 = 24 clips in May. Altogether she sold 48+24 = 71.", 0.0),
    ("... 48+24 = 71.", 0.0),
    ("48+24 = 72 = 71", 0.0),
    ("Total: 71 = 48+24.", 0.0),
    ("72 = 48+23", 0.0),
    ("48+24 =", 0.0),
    ("x <= 72", 0.0),  # a comparison, not an equation
])
def test_a_final_equation_is_graded_by_its_right_hand_side(response, reward):
    assert math_reward("", response, GSM8K_SOLUTION) == reward


def test_an_equation_reference_is_compared_whole():
    assert math_reward("", "y = 2x+1", "y=2x+1") == 1.0
    assert math_reward("", "y = 2x+2", "y=2x+1") == 0.0


def test_reference_answers():
    assert reference_answer(GSM8K_SOLUTION) == "72"
    assert reference_answer("so $x$ is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert reference_answer(" 12 ") == "12"


@pytest.mark.parametrize("answer, form", [
    ("1,000.0", "1000"), ("+01000", "1000"), ("1e3", "1000"), ("3/6", "1/2"), ("0.5", "1/2"),
    ("\\$1,000", "1000"), ("72 dollars", "72"), ("\\text{Monday}", "Monday"), ("12.", "12"),
    ("x  =  3", "x = 3"), ("1/0", "1/0"),
])
def test_normalized_forms(answer, form):
    assert normalize_answer(answer) == form


@pytest.mark.parametrize("response", ["\\boxed{\\frac{1}{", "\\boxed{\\frac{}{}}", "$$",
                                      "\\boxed{}", "}{", "\\boxed{\\sqrt{}", "x^^2", "\x00",
                                      "\\boxed{1/0}", "\\left( 1"])
def test_malformed_answers_score_zero_without_raising(response):
    assert math_reward("", response, "1") == 0.0


def test_a_pathological_answer_times_out_in_the_main_thread():
    start = time.monotonic()
    assert math_reward("", "\\boxed{9^{9^{9^{9}}}}", "3") == 0.0  # verify times out (2 s)
    assert time.monotonic() - start < 20


def test_scores_are_the_same_off_the_main_thread():
    """math-verify's SIGALRM timeouts would raise there: math_reward turns them off instead."""
    cases = RIGHT + WRONG
    scores = []
    worker = threading.Thread(target=lambda: scores.extend(
        math_reward("", response, reference) for response, reference in cases))
    worker.start()
    worker.join(timeout=60)
    assert scores == [1.0] * len(RIGHT) + [0.0] * len(WRONG)


@pytest.mark.parametrize("response, score", [
    ("5+7=12, so \\boxed{12}", 1.0),
    ("5+7=12\n#### 12", 1.0),
    ("5+7=12, so the answer is 12.", 1.0),
    ("so the answer is 13.", 1.0),  # the format, right or wrong
    ("The answer is 12.\nHope this helps!", 0.0),  # the reasoning does not end with it
    ("So the total is 12.", 0.0),  # a bare number is a guess, not a stated answer
    ("### Step 1", 0.0),
    ("The answer isn't obvious", 0.0),
    ("", 0.0),
])
def test_the_format_reward_wants_an_explicit_final_answer_at_the_end(response, score):
    assert format_reward("", response, "12") == score


def test_reward_mix_weighs_answer_and_format():
    mix = RewardMix()
    assert mix("", "so \\boxed{12}", "12") == pytest.approx(1.1)
    assert mix("", "So the total is 12.", "12") == pytest.approx(1.0)
    assert mix("", "so \\boxed{13}", "12") == pytest.approx(0.1)
    assert RewardMix(math=2.0, format=0.0)("", "#### 12", "12") == pytest.approx(2.0)
    for field, bad in (("math", float("nan")), ("format", "0.1"), ("math", True)):
        with pytest.raises(ValueError, match=field):
            RewardMix(**{field: bad})


def test_a_non_string_argument_is_named():
    with pytest.raises(TypeError, match="response"):
        math_reward("", None, "1")
    with pytest.raises(TypeError, match="reference"):
        math_reward("", "1", 1)
    with pytest.raises(TypeError, match="response"):
        format_reward("", 12, "12")


def test_bad_input_gets_a_clear_error_huge_numbers_compare_as_text_without_crashing():
    """Python refuses int strings over 4300 digits and 10**999999999 never finishes; a response
    (or reference) holding such a number is scored, as written text, in well under a second."""
    huge = "9" * 5000
    assert normalize_answer(huge) == huge
    assert normalize_answer("1e999999999") == "1e999999999"
    assert normalize_answer("1/" + huge) == "1/" + huge
    assert math_reward("q", f"The answer is \\boxed{{{huge}}}", huge) == 1.0
    assert math_reward("q", "\\boxed{1e999999999}", "1") == 0.0
    assert normalize_answer("1.5e3") == "1500"  # ordinary numbers are still exact
