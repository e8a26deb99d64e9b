"""A small GSM8K-style set of arithmetic word problems, generated here (no downloads).

`generate_problems(n, seed)` gives n rows shaped like GSM8K's: {"question": ..., "answer": ...}
where the answer is a worked solution, one line per step with the step's arithmetic annotated
GSM8K's way (`48/2 = <<48/2=24>>24`), and a last line `#### N` with the final answer. A problem
takes one to three steps of +, -, * or exact division on small integers, in one of a dozen
templates (shopping, sharing, travel, savings, ...) with varied names, items and units: easy
enough that a small instruct model gets some right, which is what an RL smoke run needs.

Deterministic: problem i of a seed is drawn from its own `random.Random`, seeded by the string
"tlt_core.arithmetic/{seed}/{i}" (seeded by SHA-512, stable across machines and Python
versions), so the rows for (n, seed) are always the same and a longer list for the same seed
extends a shorter one. `write_jsonl(path, rows)` writes rows as JSON Lines, which
`tlt_core.tasks.data.load_prompts` reads back ("question" is the prompt, "answer" the reference).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence


@dataclass(frozen=True)
class _Person:
    name: str
    subject: str  # "she" / "he"
    possessive: str  # "her" / "his"


_PEOPLE = tuple(_Person(name, *pronouns) for name, pronouns in (
    ("Ava", ("she", "her")), ("Liam", ("he", "his")), ("Maya", ("she", "her")),
    ("Noah", ("he", "his")), ("Priya", ("she", "her")), ("Diego", ("he", "his")),
    ("Sofia", ("she", "her")), ("Kenji", ("he", "his")), ("Amara", ("she", "her")),
    ("Omar", ("he", "his")), ("Lena", ("she", "her")), ("Mateo", ("he", "his")),
    ("Zoe", ("she", "her")), ("Ravi", ("he", "his")), ("Chloe", ("she", "her")),
    ("Tariq", ("he", "his"))))
_FRIENDS = ("a friend", "a neighbor", "a classmate", "a cousin", "the teacher", "a coworker")
_ITEMS = ("apples", "stickers", "marbles", "cookies", "pencils", "books", "trading cards",
          "seashells", "eggs", "beads", "cupcakes", "toy cars")
_CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"),
               ("basket", "baskets"))
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_TRAVELERS = (("train", "kilometers"), ("bus", "miles"), ("car", "miles"), ("boat", "kilometers"),
              ("truck", "miles"))


def _step(a: int, op: str, b: int, prefix: str = "") -> tuple[str, int]:
    """GSM8K's annotated step `a op b = <<a op b=c>>c` and its value c; `prefix` (a "$") goes
    before the annotation, as GSM8K writes money."""
    # templates divide only where the quotient is exact; tests re-check every step
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return f"{a}{op}{b} = {prefix}<<{a}{op}{b}={value}>>{value}", value


class _Worked(NamedTuple):
    question: str
    steps: list[str]  # solution lines, one annotated step each
    answer: int


_Template = Callable[[random.Random, _Person], _Worked]


def _gets_more(rng: random.Random, who: _Person) -> _Worked:
    items, a, b = rng.choice(_ITEMS), rng.randint(5, 60), rng.randint(2, 40)
    work, total = _step(a, "+", b)
    question = (f"{who.name} has {a} {items}. {who.subject.capitalize()} gets {b} more {items} "
                f"from {rng.choice(_FRIENDS)}. How many {items} does {who.name} have now?")
    return _Worked(question, [f"{who.name} has {work} {items} now."], total)


def _gives_away(rng: random.Random, who: _Person) -> _Worked:
    items, a = rng.choice(_ITEMS), rng.randint(12, 90)
    b = rng.randint(2, a - 1)
    work, left = _step(a, "-", b)
    question = (f"{who.name} had {a} {items}. {who.subject.capitalize()} gave {b} of them to "
                f"{rng.choice(_FRIENDS)}. How many {items} does {who.name} have left?")
    return _Worked(question, [f"{who.name} has {work} {items} left."], left)


def _buys_packs(rng: random.Random, who: _Person) -> _Worked:
    items, (one, many) = rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    work, total = _step(a, "*", b)
    question = (f"{who.name} buys {a} {many} of {items}. Each {one} holds {b} {items}. How many "
                f"{items} does {who.name} buy?")
    return _Worked(question, [f"{who.name} buys {work} {items}."], total)


def _shares_equally(rng: random.Random, who: _Person) -> _Worked:
    items, friends, each = rng.choice(_ITEMS), rng.randint(2, 8), rng.randint(2, 12)
    work, share = _step(friends * each, "/", friends)
    question = (f"{who.name} shares {friends * each} {items} equally among {friends} friends. "
                f"How many {items} does each friend get?")
    return _Worked(question, [f"Each friend gets {work} {items}."], share)


def _half_as_many(rng: random.Random, who: _Person) -> _Worked:
    items, month = rng.choice(_ITEMS), rng.randrange(len(_MONTHS) - 1)
    first, second = _MONTHS[month], _MONTHS[month + 1]
    a = 2 * rng.randint(4, 40)
    half_work, half = _step(a, "/", 2)
    total_work, total = _step(a, "+", half)
    question = (f"{who.name} sold {a} {items} in {first}, and then {who.subject} sold half as "
                f"many {items} in {second}. How many {items} did {who.name} sell altogether in "
                f"{first} and {second}?")
    return _Worked(question, [
        f"{who.name} sold {half_work} {items} in {second}.",
        f"{who.name} sold {total_work} {items} altogether in {first} and {second}."], total)


def _change_from_a_bill(rng: random.Random, who: _Person) -> _Worked:
    items, count, price = rng.choice(_ITEMS), rng.randint(2, 8), rng.randint(1, 9)
    cost_work, cost = _step(count, "*", price, "$")
    bill = next(b for b in (10, 20, 50, 100) if b > cost)
    change_work, change = _step(bill, "-", cost, "$")
    question = (f"{who.name} buys {count} {items} for ${price} each and pays with a ${bill} "
                f"bill. How many dollars of change does {who.subject} get?")
    return _Worked(question, [f"The {items} cost {cost_work}.",
                              f"{who.name} gets {change_work} in change."], change)


def _reads_pages(rng: random.Random, who: _Person) -> _Worked:
    per_day, days, extra = rng.randint(5, 30), rng.randint(2, 7), rng.randint(3, 40)
    week_work, week = _step(per_day, "*", days)
    total_work, total = _step(week, "+", extra)
    question = (f"{who.name} reads {per_day} pages every day for {days} days. Then "
                f"{who.subject} reads {extra} more pages on the weekend. How many pages does "
                f"{who.subject} read in total?")
    return _Worked(question, [f"On the {days} days {who.subject} reads {week_work} pages.",
                              f"In total {who.subject} reads {total_work} pages."], total)


def _bakes_and_eats(rng: random.Random, who: _Person) -> _Worked:
    items = rng.choice(("cookies", "muffins", "cupcakes", "rolls"))
    trays, per_tray = rng.randint(2, 6), rng.randint(4, 12)
    baked_work, baked = _step(trays, "*", per_tray)
    eaten = rng.randint(1, baked - 1)
    left_work, left = _step(baked, "-", eaten)
    question = (f"{who.name} bakes {trays} trays of {items} with {per_tray} {items} on each "
                f"tray. {who.possessive.capitalize()} family eats {eaten} of them. How many "
                f"{items} are left?")
    return _Worked(question, [f"{who.name} bakes {baked_work} {items}.",
                              f"There are {left_work} {items} left."], left)


def _teams(rng: random.Random, who: _Person) -> _Worked:
    items, size, teams, per_team = (rng.choice(_ITEMS), rng.randint(2, 6), rng.randint(3, 8),
                                    rng.randint(2, 9))
    teams_work, _ = _step(size * teams, "/", size)
    total_work, total = _step(teams, "*", per_team)
    question = (f"{who.name}'s class has {size * teams} students. They form teams of {size}, "
                f"and each team gets {per_team} {items}. How many {items} are handed out?")
    return _Worked(question, [f"There are {teams_work} teams.",
                              f"The teams get {total_work} {items}."], total)


def _packs_into_bags(rng: random.Random, who: _Person) -> _Worked:
    items, (_, many) = rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    boxes, per_box, bags = rng.randint(2, 6), rng.randint(4, 12), rng.randint(2, 6)
    have_work, have = _step(boxes, "*", per_box)
    per_bag = rng.randint(1, (have - 1) // bags)
    given = have - bags * per_bag  # chosen so the rest splits evenly into the bags
    rest_work, rest = _step(have, "-", given)
    bag_work, in_each = _step(rest, "/", bags)
    question = (f"{who.name} has {boxes} {many} with {per_box} {items} in each. "
                f"{who.subject.capitalize()} gives {given} {items} to {rng.choice(_FRIENDS)} "
                f"and puts the rest equally into {bags} bags. How many {items} are in each bag?")
    return _Worked(question, [f"{who.name} has {have_work} {items}.",
                              f"After giving some away, {rest_work} {items} are left.",
                              f"Each bag gets {bag_work} {items}."], in_each)


def _two_legs(rng: random.Random, who: _Person) -> _Worked:
    vehicle, unit = rng.choice(_TRAVELERS)
    speed, hours = rng.randint(2, 9) * 10, rng.randint(2, 5)
    speed2, hours2 = rng.randint(2, 9) * 10, rng.randint(1, 4)
    first_work, first = _step(speed, "*", hours)
    second_work, second = _step(speed2, "*", hours2)
    total_work, total = _step(first, "+", second)
    question = (f"{who.name} rides a {vehicle} that travels at {speed} {unit} per hour for "
                f"{hours} hours, then at {speed2} {unit} per hour for {hours2} hours. How many "
                f"{unit} does {who.name} travel in all?")
    return _Worked(question, [f"First the {vehicle} travels {first_work} {unit}.",
                              f"Then it travels {second_work} {unit}.",
                              f"In all {who.name} travels {total_work} {unit}."], total)


def _saves_weekly(rng: random.Random, who: _Person) -> _Worked:
    wage, hours, weeks = rng.randint(8, 15), rng.randint(3, 10), rng.randint(2, 6)
    pay_work, pay = _step(wage, "*", hours, "$")
    spent = rng.randint(1, pay - 1)
    saved_work, saved = _step(pay, "-", spent, "$")
    total_work, total = _step(saved, "*", weeks, "$")
    question = (f"{who.name} earns ${wage} an hour and works {hours} hours each week. "
                f"{who.subject.capitalize()} spends ${spent} of {who.possessive} pay every week. "
                f"How many dollars does {who.subject} save in {weeks} weeks?")
    return _Worked(question, [f"Each week {who.subject} earns {pay_work}.",
                              f"Each week {who.subject} saves {saved_work}.",
                              f"In {weeks} weeks {who.subject} saves {total_work}."], total)


_TEMPLATES: tuple[_Template, ...] = (
    _gets_more, _gives_away, _buys_packs, _shares_equally, _half_as_many, _change_from_a_bill,
    _reads_pages, _bakes_and_eats, _teams, _packs_into_bags, _two_legs, _saves_weekly)


def _generate_problem(seed: int, index: int) -> dict[str, str]:
    """Problem `index` of the set `seed` names, as a GSM8K row."""
    # the string is the set's identity: changing it changes every problem
    rng = random.Random(f"tlt_core.arithmetic/{seed}/{index}")
    template = rng.choice(_TEMPLATES)
    worked = template(rng, rng.choice(_PEOPLE))
    return {"question": worked.question,
            "answer": "\n".join(worked.steps + [f"#### {worked.answer}"])}


def generate_problems(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n GSM8K-style rows, the same for the same (n, seed) on every machine."""
    for name, value in (("n", n), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    return [_generate_problem(seed, index) for index in range(n)]


def write_jsonl(path: str | Path, rows: Sequence[dict]) -> None:
    """Rows as JSON Lines (ASCII, one object a line, keys in their order), replacing `path`."""
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"rows: row {index} must be a dict, got {type(row).__name__}")
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
