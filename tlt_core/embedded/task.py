"""The embedded default task: a countdown sum mod 100, worked step by step.

Contract: problems and reference solutions as text, a tokenizer, and a checker; knows nothing
about models. A problem is a deterministic function of (seed, index); the checker's reward is
1.0 exactly when the response's final answer is right.

Format. The prompt `37+04` asks for 37 + 04 + 03 + 02 + 01 mod 100 (`37-04` for
37 - 04 - 03 - 02 - 01): a start value, an operator and a count n. The response restates the
start, then takes one term per line, counting down from n to 01 and writing the running value
as two digits mod 100 (`;` ends a line), then gives the final answer after the marker `#`:

    prompt    37+04
    response  37;+04=41;+03=44;+02=46;+01=47;#47

Model input is `<bos>` + prompt + `?` (the prompt separator); the model writes the response and
ends it with `<eos>`. A problem of n steps has a response of `7 * n + 6` characters, one token
each.

Why this shape (learnability). The model meant to learn this is tiny (about 8 layers, width
128-192) and is pre-trained for minutes on a CPU: about 1000 steps of 32 sequences, ~2M tokens. So
each line depends only on the line before it, at fixed offsets: the operator is copied, the
counter decremented, the value updated by one two-digit addition or subtraction with one carry
or borrow; the start line has the layout of a result, so the first step looks like every other;
the prompt has a fixed length, so the first line reads it at fixed offsets too.

Measured with a throwaway probe (not in the repo): a pre-norm transformer, 8 layers, width 128
(1.6M parameters), RoPE, AdamW at 3e-3, batches from tlt_core.embedded.pretrain_data, sampled at
temperature 1.0 on 400 problems. After 1000 steps (1.9M tokens): 57% and 67% correct (two
seeds) -- 92-98% of 1-2 step problems, 43-56% of 5-8, at most 8% of 9-32; 64% at width 192; 47%
with learned instead of rotary positions. After 500 steps 15%, after 2000 steps 77%. Pre-training
on `median_steps=8` (same 1000 steps) gives 73%, and 24% on 17-32 steps instead of ~0%. A
response is right only if every step is, so long problems are harder, as in reasoning RL.

Why the operands are not copied from the prompt: a design where each step copies its operand
from a prompt listing k distinct numbers (`12+07-30+45` -> `12;+07=19;-30=89;+45=34;#34`) was
not learnt by the same probe: after 1000 and 2000 steps (3M and 6M tokens) its loss on result
digits was still ln 10 = 2.30 (uniform) and on copied operand digits 1.9-2.3, also at width 192,
with a letter index on each term, or with result digits reversed; at most 2% correct. Finding
the i-th term of a long prompt is a lookup a model this small does not learn in this budget.

Length distribution. n = round(LogNormal(ln(median_steps), length_sigma)), clipped to
[min_steps, max_steps]. Defaults: median 4 steps, sigma 1.0, cap 63. Response lengths (tokens,
with `<eos>`) are `7 * n + 7`: median 35; the p99 step count is about 4 * exp(2.326) = 41, i.e.
~294 tokens, so p99 / median is about 8.4 -- the 5-10x tail of reasoning RL. p99 >= 5x the
median needs sigma >= ln(6) / 2.326 = 0.77; 1.0 leaves margin for the pre-trained model's own
samples, whose tail is shorter than the references' (it gets long problems wrong and sometimes
ends them early): at sigma 0.9 its p99 / median was only 5.0 on 512 samples. The cap keeps the
longest response at 448 tokens + `<eos>`; the counter's two digits allow at most 99. Measured on
the 5000 problems of seed 0: median 35 tokens, p90 105, p99 308, max 448, mean 52.6; p99 /
median = 8.8. (The probe numbers above used sigma 0.9.)
"""

from __future__ import annotations

import math
import operator
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MODULUS = 100  # every value is written as two digits
OPERATORS = "+-"
STEP_END = ";"  # ends every line of a response
ANSWER_MARKER = "#"  # the final answer follows it
PROMPT_END = "?"  # separates the prompt from the response in the model's input

_APPLY = {"+": operator.add, "-": operator.sub}
_ANSWER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class TaskConfig:
    seed: int = 0
    num_problems: int = 1000
    median_steps: float = 4.0  # exp(mu) of the log-normal step count
    length_sigma: float = 1.0  # sigma of log(num_steps): the tail's weight (see module doc)
    min_steps: int = 1
    max_steps: int = 63  # cap: the longest response is 7 * max_steps + 6 characters
    operators: str = OPERATORS  # a subset of "+-"

    def __post_init__(self):
        for name in ("seed", "num_problems", "min_steps", "max_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
        if self.num_problems < 1:
            raise ValueError(f"num_problems: must be >= 1, got {self.num_problems}")
        for name in ("median_steps", "length_sigma"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name}: must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"{name}: must be finite, got {value}")
        if self.median_steps <= 0:
            raise ValueError(f"median_steps: must be > 0, got {self.median_steps}")
        if self.length_sigma < 0:
            raise ValueError(f"length_sigma: must be >= 0, got {self.length_sigma}")
        if self.min_steps < 1:
            raise ValueError(f"min_steps: must be >= 1, got {self.min_steps}")
        if not self.min_steps <= self.max_steps <= MODULUS - 1:
            raise ValueError(
                f"max_steps: must be in [min_steps={self.min_steps}, {MODULUS - 1}] (the "
                f"step counter has two digits), got {self.max_steps}")
        if (not isinstance(self.operators, str) or not self.operators
                or set(self.operators) - set(OPERATORS)
                or len(set(self.operators)) != len(self.operators)):
            raise ValueError(
                f"operators: must be a non-empty string of distinct characters from "
                f"{OPERATORS!r}, got {self.operators!r}")


@dataclass(frozen=True)
class Problem:
    prompt: str  # "37+04"
    solution: str  # "37;+04=41;+03=44;+02=46;+01=47;#47": the reference response
    answer: str  # "47"
    num_steps: int  # n: response lines between the start line and the answer


def _format(value: int) -> str:
    return f"{value:02d}"


def make_problem(start: int, operator_symbol: str, num_steps: int) -> Problem:
    """The problem start `operator_symbol` num_steps (e.g. 37 + 04 + 03 + 02 + 01 mod 100) and its
    reference solution."""
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < MODULUS:
        raise ValueError(f"start: must be an int in [0, {MODULUS}), got {start!r}")
    if operator_symbol not in _APPLY:
        raise ValueError(f"operator_symbol: must be one of {OPERATORS!r}, got {operator_symbol!r}")
    if (not isinstance(num_steps, int) or isinstance(num_steps, bool)
            or not 1 <= num_steps < MODULUS):
        raise ValueError(f"num_steps: must be an int in [1, {MODULUS}), got {num_steps!r}")
    apply = _APPLY[operator_symbol]
    value = start
    lines = [_format(start)]
    for term in range(num_steps, 0, -1):
        value = apply(value, term) % MODULUS
        lines.append(f"{operator_symbol}{_format(term)}={_format(value)}")
    answer = _format(value)
    return Problem(prompt=_format(start) + operator_symbol + _format(num_steps),
                   solution=STEP_END.join(lines) + STEP_END + ANSWER_MARKER + answer,
                   answer=answer, num_steps=num_steps)


def sample_num_steps(config: TaskConfig, rng: random.Random) -> int:
    """One draw of the clipped, rounded log-normal step count (see the module docstring)."""
    steps = round(rng.lognormvariate(math.log(config.median_steps), config.length_sigma))
    return min(max(steps, config.min_steps), config.max_steps)


def generate_problem(config: TaskConfig, index: int) -> Problem:
    """Problem `index` of the family `config.seed` names. Each problem has its own
    random.Random, seeded from (seed, index) by string (SHA-512, stable across runs and Python
    versions), so a problem does not depend on how many others are generated."""
    # the string is the problem family's seed: a different one would change every problem
    rng = random.Random(f"tlt_core.task/{config.seed}/{index}")
    num_steps = sample_num_steps(config, rng)
    start = rng.randrange(MODULUS)
    return make_problem(start, rng.choice(config.operators), num_steps)


def generate_problems(config: TaskConfig) -> list[Problem]:
    """config.num_problems problems, deterministic for config.seed; a longer list for the same
    seed extends a shorter one."""
    return [generate_problem(config, index) for index in range(config.num_problems)]


def parse_answer(text: str) -> str | None:
    """The final answer of a response: the digits after its one answer marker, or None when the
    response is malformed (no marker, several, nothing or anything but digits after it)."""
    if not isinstance(text, str):
        raise TypeError(f"text: must be a str, got {type(text).__name__}")
    if text.count(ANSWER_MARKER) != 1:
        return None
    answer = text.split(ANSWER_MARKER)[1]
    return answer if _ANSWER.fullmatch(answer) else None


def check_answer(problem: Problem, response_text: str) -> float:
    """The reward: 1.0 if the response's final answer equals the problem's answer, else 0.0.
    Only the final answer counts (as in reasoning RL); malformed responses get 0.0."""
    return 1.0 if parse_answer(response_text) == problem.answer else 0.0


def count_correct_steps(problem: Problem, response_text: str) -> int:
    """How many of the problem's steps the response gets right before its first mistake (the
    start line must be right for any step to count): a diagnostic of where a model fails, not a
    reward. The reference solution scores problem.num_steps."""
    if not isinstance(response_text, str):
        raise TypeError(f"response_text: must be a str, got {type(response_text).__name__}")
    reference = problem.solution.split(STEP_END)
    lines = response_text.split(STEP_END)
    if lines[0] != reference[0]:
        return 0
    correct = 0
    for line, expected in zip(lines[1:], reference[1:1 + problem.num_steps]):
        if line != expected:
            break
        correct += 1
    return correct


class CharTokenizer:
    """One token per character of the task's alphabet, plus three special tokens.

    Ids: <pad> = 0, <bos> = 1, <eos> = 2, then the characters "0123456789+-=;#?" (V = 19).
    `encode` maps text (characters only) to ids; `decode` maps any ids of the vocabulary back,
    special tokens written as their names, so decode(encode(text)) == text."""

    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
    CHARACTERS = "0123456789" + OPERATORS + "=" + STEP_END + ANSWER_MARKER + PROMPT_END

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._pieces = self.SPECIAL_TOKENS + tuple(self.CHARACTERS)
        self._char_to_id = {c: i + len(self.SPECIAL_TOKENS) for i, c in enumerate(self.CHARACTERS)}
        self.prompt_end_id = self._char_to_id[PROMPT_END]

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def pieces(self) -> tuple[str, ...]:
        """The token of each id, in id order."""
        return self._pieces

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: must be a str, got {type(text).__name__}")
        try:
            return [self._char_to_id[c] for c in text]
        except KeyError as error:
            position = text.index(error.args[0])
            raise ValueError(f"text: character {error.args[0]!r} at position {position} is not "
                             f"in the vocabulary {self.CHARACTERS!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        pieces = []
        for position, token in enumerate(ids):
            try:
                token = operator.index(token)
            except TypeError:
                raise TypeError(f"ids: element {position} is not an integer: {token!r}") from None
            if not 0 <= token < len(self._pieces):
                raise ValueError(f"ids: id {token} at position {position} is not in the "
                                 f"vocabulary [0, {len(self._pieces)})")
            pieces.append(self._pieces[token])
        return "".join(pieces)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The model's input for a prompt: <bos> + prompt + the prompt separator."""
        return [self.bos_id] + self.encode(prompt) + [self.prompt_end_id]

    def response_ids(self, response: str) -> list[int]:
        """What the model should generate for a response: its characters, then <eos>."""
        return self.encode(response) + [self.eos_id]

    def decode_response(self, ids: Iterable[int]) -> str:
        """The text of generated ids up to (not including) the first <eos>; all of them when
        there is none (a truncated response, which the checker then usually rejects)."""
        ids = list(ids)
        self.decode(ids)  # validates every id
        ids = [operator.index(token) for token in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.decode(ids)


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """Summary of a length distribution: count, mean, median, p90, p99, max and p99_over_median
    (percentiles by linear interpolation, numpy's default)."""
    values = np.asarray(lengths, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"lengths: must be a non-empty 1-D sequence, got shape {values.shape}")
    median, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"count": float(values.size), "mean": float(values.mean()), "median": float(median),
            "p90": float(p90), "p99": float(p99), "max": float(values.max()),
            "p99_over_median": float(p99 / median) if median > 0 else math.inf}
