"""Rewards: the math-answer verifier, a format reward, and running user reward functions safely.

A reward function is `fn(prompt: str, response: str, reference: str) -> float`, or one written
for TRL (`f(prompts, completions, **kwargs) -> list[float]`) or veRL
(`compute_score(data_source, solution_str, ground_truth, extra_info=None)`), told apart by its
parameters (tlt_core.tasks.reward_signatures).

`math_reward` is 1.0 when a response's final answer equals the reference answer, else 0.0. It
reads one final answer per response, never "any of its numbers", so listing candidates earns
nothing. `math_answer(response)` finds it, by the first rule that applies:
1. the content of the last `\\boxed{...}`;
2. the number after the last `####` ending its line (GSM8K), or after a shorter `#` run ending
   the response (`37;+04=41;#41`) — a markdown heading such as `### Step 1` is not a marker;
3. what follows the last "answer is" / "answer:" up to the end of its sentence;
4. the whole response, when it is one expression with no words (`\\dfrac{3}{4}`, `(1,2)`);
5. the last latex environment (`$...$`, `\\(...\\)`, `\\[...\\]`), when the response ends with it;
6. the equation of numbers its last line ends with (`... she sold 48+24 = 72.`, `72 = 48+24.`);
7. the last number (`1,000`, `-2.5`, `3/4`, `1e3`).
`reference_answer(reference)` reads a reference: the text after its last `####` (a GSM8K
solution), else its last `\\boxed{}` (a MATH solution), else all of it. Both are then put in one
form by `normalize_answer` (plain numbers as exact fractions: "1,000.0", "+01000" and "1e3" are
"1000"; "72 dollars" is "72"; `$`, `\\$` and a whole `\\text{}` dropped) and compared:
equal forms agree; answers made of words compare as case-folded text; anything else is parsed
as latex and compared by Hugging Face's math-verify (`math_verify.parse` and `verify`: `1/2` =
`\\frac{1}{2}` = `0.5`, `x=3` = `3`, `12\\text{ apples}` = `12`, `(1, 2)` = `(1,2)`). A
malformed answer gets 0.0; math_reward never raises on what a response contains.

An answer that is an equation (`48+24 = 72`, `... 48/2 = 24, 48+24 = 72.`, `#### 48+24 = 72`)
is graded by the right-hand side of its last `=`, since a worked response's last step states the
result there; the reference itself is no equation (a reference with `=` is compared whole). It
stays strict: only the last right-hand side counts (`48+24 = 72 = 71` is 71), and a plain number
just left of that `=` must agree too (`71 = 48+24` states 71, so it gets 0.0, while
`72 = 48+24` gets 1.0). `<=`, `>=`, `!=`, `==`, `:=` and answers with `<`, `>`, `\\le`, `\\ge`,
`\\ne` are comparisons, not equations, and are compared whole.

math-verify bounds its parsing and comparison time with SIGALRM, which only the main thread may
set (elsewhere it raises). math_reward passes a timeout of `TIMEOUT_S` seconds in the main thread
and none in other threads: there it works, but a pathological answer (a power tower such as
`9^{9^{9^9}}`) can run until it is done.

`format_reward` is 1.0 when the response's last non-empty line holds a final answer in an
explicit form (rules 1-3), else 0.0; `RewardMix(math=1.0, format=0.1)` is their weighted sum,
itself a reward function.

`score_all` runs a reward function over a batch: an exception or a non-finite value in one sample
is recorded against that sample (reward 0.0 and the error's text, which names the function),
never fatal to the run. A batched (TRL) function that raises, or returns the wrong number of
values, is called again one sample at a time, so only the samples it fails on lose their reward.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from tlt_core.tasks.reward_signatures import (TRL, RewardBatch, RewardCountError, call_batched,
                                              call_per_sample, reward_name, reward_signature)

RewardFn = Callable[[str, str, str], float]

# Numbers with more digits, or a larger exponent, compare as written text: Python refuses to
# turn more than 4300 digits into an int, and "1e999999999" would take 10**999999999 to build.
MAX_EXACT_DIGITS = 1000
TIMEOUT_S = 2  # seconds for each math-verify parse and comparison (an int: signal.alarm's unit)

_INTEGER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # commas only as thousands separators
_UNSIGNED = rf"(?:{_INTEGER}(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:/{_INTEGER})?"
# In prose a sign counts only where it cannot be an operator: "5+7" ends with 7, not +7.
_NUMBER_IN_TEXT = re.compile(rf"(?:(?<![\w)\]}}])[-+])?(?<![\d.]){_UNSIGNED}")
_PLAIN_NUMBER = re.compile(rf"[-+]?{_UNSIGNED}")
_NUMBER_THEN_WORDS = re.compile(rf"({_PLAIN_NUMBER.pattern})\s+[^\W\d_][^\W\d]*(?:\s+[^\W\d]+)*")
_NUMBER_THEN_PROSE = re.compile(rf"\$?({_PLAIN_NUMBER.pattern})(?=\s+[A-Za-z]{{2}})")
_WORDS = re.compile(r"[^\W\d_]+(?:[ '-][^\W\d_]+)*")
_GSM8K_MARKER = re.compile(rf"(?m)####[ \t]*\$?[ \t]*({_PLAIN_NUMBER.pattern})[ \t]*\.?[ \t]*$")
_SHORT_MARKER = re.compile(rf"#+[ \t]*({_PLAIN_NUMBER.pattern})\s*\.?\s*$")
_ANSWER_IS = re.compile(r"(?i)\banswers?\s*(?:is\b(?!')\s*:?|:|=)")  # not "isn't"
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
_LATEX_AT_END = re.compile(r"(?s)(?:\$\$([^$]+)\$\$|\$([^$]+)\$"
                           r"|\\\[((?:(?!\\\]).)+)\\\]|\\\(((?:(?!\\\)).)+)\\\))[\s.!]*$")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_EQUALS = re.compile(r"(?<![<>!=:])=(?!=)")  # an equation's "=", not <=, >=, !=, ==, :=
_COMPARISON = re.compile(r"[<>≤≥≠]|!=|==|\\(?:le|ge|ne|leq|geq|neq|lt|gt)(?![A-Za-z])")
_CLAUSE_BREAK = re.compile(r"[,;:\n]")  # what ends the text left of an equation's last "="
_ARITHMETIC_CHARS = frozenset("0123456789.,+-*/×÷()^$= \t")  # on the last line


class _Found(NamedTuple):
    answer: str
    end: int  # where the form that holds the answer ends in the response
    explicit: bool  # a boxed, '####' or 'the answer is' form (rules 1-3), not a guess


def _boxed(text: str) -> tuple[str, int] | None:
    """The content of the last `\\boxed{...}` and where it ends, or None (none, or unbalanced)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j], j + 1
    return None


def _after_answer_is(text: str) -> tuple[str, int] | None:
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    cut = _SENTENCE_END.search(text, start)
    end = cut.start() if cut else len(text)
    answer = text[start:end].strip().strip("*").strip()
    # "is 12 because 5+7=12": a number followed by prose is the answer, the prose is not
    number_first = _NUMBER_THEN_PROSE.match(answer)
    answer = number_first.group(1) if number_first else answer
    return (answer, end) if answer else None


def _is_bare_expression(text: str) -> bool:
    """One line of math with no word of two letters or more outside latex commands."""
    return ("\n" not in text and len(text) <= 100 and _WORDS.fullmatch(text) is None
            and re.search(r"[A-Za-z]{2}", _LATEX_COMMAND.sub(" ", text)) is None)


def _arithmetic_equation_at_end(text: str) -> str | None:
    """The numbers, operators and `=` signs ending text's last line (a final period dropped),
    when they hold an equation with digits on both sides of its last `=`; else None. Scanned backwards
    character by character: a regular expression anchored at the end would retry from every
    start position of a long run of digits."""
    text = text.rstrip()
    start = len(text)
    while start > 0 and text[start - 1] in _ARITHMETIC_CHARS:
        start -= 1
    tail = text[start:].strip().rstrip(".").strip()
    left, equals, right = tail.rpartition("=")
    if not equals or not any(c.isdigit() for c in left) or not any(c.isdigit() for c in right):
        return None
    return tail


def _final_answer(text: str) -> _Found | None:
    """The module docstring's rules 1-7, in order."""
    boxed = _boxed(text)
    if boxed is not None:
        return _Found(boxed[0], boxed[1], True)
    markers = list(_GSM8K_MARKER.finditer(text))
    marker = markers[-1] if markers else _SHORT_MARKER.search(text)
    if marker is not None:
        return _Found(marker.group(1), marker.end(1), True)
    answer_is = _after_answer_is(text)
    if answer_is is not None:
        return _Found(answer_is[0], answer_is[1], True)
    whole = text.strip().strip("$").strip()
    if whole and _is_bare_expression(whole):
        return _Found(whole, len(text), False)
    latex = _LATEX_AT_END.search(text)
    content = next(g for g in latex.groups() if g).strip() if latex else ""
    if content:
        return _Found(content, len(text), False)
    equation = _arithmetic_equation_at_end(text)
    if equation is not None:
        return _Found(equation, len(text), False)
    numbers = list(_NUMBER_IN_TEXT.finditer(text))
    return _Found(numbers[-1].group(), numbers[-1].end(), False) if numbers else None


def math_answer(text: str) -> str | None:
    """The final answer in a response (as written), or None when it has none."""
    found = _final_answer(text)
    return found.answer if found else None


def reference_answer(text: str) -> str:
    """The final answer in a reference: after its last '####', else its last `\\boxed{}`, else
    the whole text; stripped."""
    marker = text.rfind("####")
    if marker >= 0:
        return text[marker + len("####"):].strip()
    boxed = _boxed(text)
    return (boxed[0] if boxed else text).strip()


def _exact_number(text: str) -> Fraction | None:
    if not _PLAIN_NUMBER.fullmatch(text) or sum(c.isdigit() for c in text) > MAX_EXACT_DIGITS:
        return None
    exponent = re.search(r"[eE]([-+]?\d+)", text)
    if exponent and abs(int(exponent.group(1))) > MAX_EXACT_DIGITS:
        return None
    numerator, _, denominator = text.replace(",", "").partition("/")
    try:
        return Fraction(numerator) / Fraction(denominator or 1)
    except ZeroDivisionError:
        return None


def normalize_answer(answer: str) -> str:
    """One written form per answer: exact numbers as reduced fractions, else the answer with
    `$`, `\\$`, a whole `\\text{}` and a trailing period dropped and spaces collapsed."""
    text = answer.strip().removeprefix("\\$").strip("$").strip().removesuffix(".").strip()
    text = re.sub(r"^\\text\{([^{}]*)\}$", r"\1", text)
    words_after = _NUMBER_THEN_WORDS.fullmatch(text)
    value = _exact_number(words_after.group(1) if words_after else text)
    return str(value) if value is not None else " ".join(text.split())


def _timeout_s() -> int | None:
    # SIGALRM can only be set from the main thread; math-verify raises ValueError elsewhere
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@cache
def _math_verify():
    """math-verify and its latex extraction config, imported when an answer first needs it:
    what imports tlt_core (the kernels, the engine) does not need math-verify's grammar."""
    import math_verify

    return math_verify, (math_verify.LatexExtractionConfig(),)


def _parse(answer: str, timeout_s: int | None) -> list:
    # The answer is already cut out of the response: parse all of it as one latex expression.
    # no_fallback: an unparsable answer yields nothing rather than its raw string.
    math_verify, latex = _math_verify()
    return math_verify.parse(f"${answer}$", latex, fallback_mode="no_fallback",
                             parsing_timeout=timeout_s)


def _equivalent(answer: str, reference: str) -> bool:
    ours, theirs = normalize_answer(answer), normalize_answer(reference)
    if ours == theirs:
        return True
    if _WORDS.fullmatch(ours) or _WORDS.fullmatch(theirs):
        # math-verify would read "Monday" as the product M*o*n*d*a*y, equal to any anagram
        return ours.casefold() == theirs.casefold()
    timeout_s = _timeout_s()
    try:
        gold, predicted = _parse(theirs, timeout_s), _parse(ours, timeout_s)
        return bool(gold and predicted
                    and _math_verify()[0].verify(gold, predicted, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a grammar this large can fail on one odd answer:
        return False  # that costs the answer its reward, never the batch


def _final_equation(answer: str) -> tuple[str, str] | None:
    """(the plain text just left of the last `=`, the text right of it) when answer is an
    equation; None when it has no `=` or is a comparison."""
    equals = list(_EQUALS.finditer(answer))
    if not equals or _COMPARISON.search(answer):
        return None
    last = equals[-1]
    left = answer[equals[-2].end() if len(equals) > 1 else 0:last.start()]
    return _CLAUSE_BREAK.split(left)[-1].strip(), answer[last.end():].strip()


def _answer_matches(answer: str, reference: str) -> bool:
    """The module docstring's comparison, equations graded by their last right-hand side."""
    equation = None if _EQUALS.search(reference) else _final_equation(answer)
    if equation is None:
        return _equivalent(answer, reference)
    left, right = equation
    if _exact_number(normalize_answer(left)) is not None and not _equivalent(left, reference):
        return False  # "71 = 48+24" states a wrong result, whatever its right side is worth
    return bool(right) and _equivalent(right, reference)


def math_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 if the response's final answer equals the reference's, else 0.0."""
    for name, value in (("response", response), ("reference", reference)):
        if not isinstance(value, str):
            raise TypeError(f"{name}: must be a str, got {type(value).__name__}")
    found = _final_answer(response)
    return float(found is not None and _answer_matches(found.answer, reference_answer(reference)))


def format_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 if the response ends with a final answer in an explicit form: `\\boxed{...}`,
    `#### N` or 'the answer is N' on its last non-empty line; else 0.0. Right or wrong."""
    if not isinstance(response, str):
        raise TypeError(f"response: must be a str, got {type(response).__name__}")
    found = _final_answer(response)
    return float(found is not None and found.explicit and "\n" not in response[found.end:].strip())


@dataclass(frozen=True)
class RewardMix:
    """`math * math_reward + format * format_reward`, a reward function itself: the format term
    rewards a parsable final answer before the model gets many answers right."""
    math: float = 1.0
    format: float = 0.1

    def __post_init__(self):
        for name in ("math", "format"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise ValueError(f"{name}: the weight must be a finite number, got {value!r}")

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        return (self.math * math_reward(prompt, response, reference)
                + self.format * format_reward(prompt, response, reference))


@dataclass(frozen=True)
class Scored:
    reward: float
    error: str | None = None  # why this sample's reward function failed, if it did


def score_all(fn: Callable, prompts: Sequence[str], responses: Sequence[str],
              references: Sequence[str], *,
              messages: Sequence[tuple[dict, ...] | None] | None = None,
              rows: Sequence[Mapping[str, Any]] | None = None) -> list[Scored]:
    """fn's reward for each sample, in any of the signatures reward_signatures knows; messages
    (the prompts as chat messages, None where a prompt was text) and rows (each sample's data
    row) are what TRL's and veRL's functions may read beyond the text."""
    count = len(responses)
    batch = RewardBatch(prompts, responses, references,
                        [None] * count if messages is None else messages,
                        [{}] * count if rows is None else rows)
    for name, values in (("prompts", prompts), ("references", references),
                         ("messages", batch.messages), ("rows", batch.rows)):
        if len(values) != count:
            raise ValueError(f"{name}: {len(values)} entries for {count} responses")
    return _score(fn, reward_signature(fn), reward_name(fn), batch)


def _score(fn: Callable, signature: str, name: str, batch: RewardBatch) -> list[Scored]:
    count = len(batch.responses)
    if signature == TRL:
        try:
            return [_scored(name, value) for value in call_batched(fn, batch)]
        except RewardCountError as error:  # values cannot be matched to samples: none scored
            return [_failed(name, error)] * count
        except Exception as error:  # noqa: BLE001 - find the samples it fails on, one at a time
            if count == 1:
                return [_failed(name, error)]
            return [_score(fn, signature, name, batch.sample(index))[0] for index in range(count)]
    out = []
    for index in range(count):
        try:
            out.append(_scored(name, call_per_sample(fn, signature, batch, index)))
        except Exception as error:  # noqa: BLE001 - a user's function may raise anything
            out.append(_failed(name, error))
    return out


def _scored(name: str, value) -> Scored:
    """A raw reward as a Scored: a finite number, else an error naming the function."""
    if value is None or isinstance(value, (str, bytes)):
        return Scored(0.0, f"{name}: returned {value!r}, not a number")
    try:
        reward = float(value)
    except (TypeError, ValueError) as error:
        return Scored(0.0, f"{name}: returned {value!r}, not a number ({error})")
    if not math.isfinite(reward):
        return Scored(0.0, f"{name}: ValueError: the reward is {reward}")
    return Scored(reward)


def _failed(name: str, error: Exception) -> Scored:
    return Scored(0.0, f"{name}: {type(error).__name__}: {error}")
