"""The adaptive loop's draft plans from a `tlt bench speculative --json` file: at each batch size
the bench measured, the plan with the highest speedup over plain decoding, and the bench's
rates as a prediction.

A file is a JSON list of the bench's rows (`tlt_core.bench.speculative.SpeculativeCase`), one
per (batch, plan). A row needs `batch`, `plan` (a plan key, tlt_core.drafting.plan_keys),
`temperature`, `speedup_vs_plain` (SD tokens per second over plain decoding's) and `plain_tok_s`;
`acceptance_length` breaks ties, `model` must be the same in every row. Only the rows at the
run's temperature count: at T = 0 (greedy) a draft token is accepted when it is the target's
argmax, at T > 0 (sampled) with the target's probability of it, or 1 - TV(target, drafter) for
a sampled chain, so the plan that wins differs between the two (on SmolLM2, chain (6,1,7) at
T = 0, sampled(4) at T = 1).

`measured_plans(rows, temperature)` returns `MeasuredPlans`: `best`, each measured batch's
plan with the highest speedup (ties: the higher acceptance length, then the earlier row);
`plans`, the distinct best plans in order of the smallest batch each wins (the adaptive loop's
plans); and `cost_model(plans)`, the bench's rates as a `CostModel` (module docstring of
tlt_core.adaptive.cost_model): at every measured batch, plain decoding at the median of the
rows' `plain_tok_s` and each plan at that times its speedup. A batch holds every plan the bench
ran with a row at the temperature; a plan it ran at other batches only takes its speedup
interpolated in log2(batch) between them (held at the nearest outside), and a plan it never
ran (suffix-match drafts, whose drafts come from sibling responses that the bench's requests do
not have) is predicted at plain decoding's rate, for the loop to measure.

How the loop uses the prediction (`AdaptivePolicy.from_cost_model(..., fallback_model=)`):
calibration stays the prediction wherever it timed a batch, and the bench's rates stand in only
where calibration timed none (otherwise every arm starts alike, unpredicted). Calibration
times this engine on this machine with the run's drafter and prompts, where the file may come
from another machine, drafter or response length; what the bench knows better, acceptance over
whole responses rather than calibration's 16-token runs, is what the loop's own steps correct
within a few steps (the table's prior counts as `prior_weight` = 2 steps). The plans are the
file's either way, so calibrating them costs a few plans' time instead of the built-in set's.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tlt_core.adaptive.cost_model import PLAIN_KEY, CostModel
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.plan_keys import plan_from_key

REQUIRED = ("batch", "plan", "temperature", "speedup_vs_plain", "plain_tok_s")
ROW = ("a row of `tlt bench speculative --json FILE` (an object with batch, plan, "
       "temperature, speedup_vs_plain, plain_tok_s)")


@dataclass(frozen=True)
class MeasuredPlans:
    source: str  # the file, or "rows"
    temperature: float
    best: dict[int, DraftPlan]  # batch -> its plan with the highest speedup, by batch
    speedups: dict[tuple[int, str], float]  # (batch, plan key) -> speedup, every row at T
    plain_tok_s: dict[int, float]  # batch -> plain decoding's tokens per second (median)

    @property
    def plans(self) -> tuple[DraftPlan, ...]:
        """The distinct best plans, in order of the smallest batch each wins."""
        return tuple({plan.key: plan for plan in self.best.values()}.values())

    def speedup(self, batch: int, plan: DraftPlan) -> float | None:
        """The plan's measured speedup at batch: its row's, else interpolated in log2(batch)
        between the batches it ran at (held at the nearest outside them); None if it ran at
        none."""
        own = {(b, key): s for (b, key), s in self.speedups.items() if key == plan.key}
        return CostModel(own).rate(batch, plan) if own else None

    def cost_model(self, plans: Sequence[DraftPlan]) -> CostModel:
        """The bench's rates for plain decoding and each of plans at every measured batch
        (module docstring); a plan the bench never ran is predicted at plain decoding's."""
        rates = {}
        for batch, plain in self.plain_tok_s.items():
            rates[(batch, PLAIN_KEY)] = plain
            for plan in plans:
                speedup = self.speedup(batch, plan)
                rates[(batch, plan.key)] = plain * (1.0 if speedup is None else speedup)
        return CostModel(rates)


def measured_plans(rows: str | Path | Sequence[Mapping], temperature: float) -> MeasuredPlans:
    """The best plan per batch among rows at `temperature` (module docstring); rows: a
    `tlt bench speculative --json` file or its list of rows. FileNotFoundError for a missing
    file, ValueError naming the file (or "rows") and the row for anything else amiss."""
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: must be a finite number >= 0, got {temperature!r}")
    source = "rows"
    if isinstance(rows, (str, Path)):
        rows, source = _read(Path(rows)), str(rows)
    if not isinstance(rows, (list, tuple)) or not rows:
        found = f"a {type(rows).__name__}" if rows else "no rows"
        raise ValueError(f"{source}: holds {found}; expected the list of rows that `tlt bench "
                         "speculative --json FILE` writes")
    checked = [_checked(row, f"{source}: rows[{index}]") for index, row in enumerate(rows)]
    models = sorted({str(row["model"]) for row in rows if row.get("model") is not None})
    if len(models) > 1:
        raise ValueError(f"{source}: has rows of several models ({', '.join(models)}); keep the "
                         "rows of the model this run decodes with")
    at = [(index, row) for index, row in enumerate(checked)
          if math.isclose(row.temperature, temperature, abs_tol=1e-9)]
    if not at:
        found = sorted({row.temperature for row in checked})
        raise ValueError(f"{source}: no rows at temperature {temperature}; it has rows at "
                         f"{', '.join(map(str, found))} (0: greedy); run `tlt bench "
                         f"speculative --temperature {temperature} --json FILE` for this run")
    speedups, seen, best = {}, {}, {}
    for index, row in at:
        key = (row.batch, row.plan.key)
        if key in seen:
            raise ValueError(f"{source}: rows[{seen[key]}] and rows[{index}] both measure "
                             f"{row.plan.key} at batch {row.batch}, temperature {temperature}; "
                             "keep one")
        seen[key], speedups[key] = index, row.speedup
        held = best.get(row.batch)
        if held is None or (row.speedup, row.acceptance) > (held.speedup, held.acceptance):
            best[row.batch] = row
    plain = {batch: statistics.median(row.plain_tok_s for _, row in at if row.batch == batch)
             for batch in best}
    return MeasuredPlans(source, float(temperature),
                         {batch: best[batch].plan for batch in sorted(best)}, speedups,
                         {batch: plain[batch] for batch in sorted(plain)})


@dataclass(frozen=True)
class _Row:
    batch: int
    plan: DraftPlan
    temperature: float
    speedup: float
    plain_tok_s: float
    acceptance: float  # 0 where the row has none


def _read(path: Path) -> object:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; write one with `tlt bench speculative "
                                "--json FILE`")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not a JSON file ({error}); expected the list of rows "
                         "`tlt bench speculative --json FILE` writes") from None


def _checked(row: object, where: str) -> _Row:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where} is a {type(row).__name__}, expected {ROW}")
    missing = [name for name in REQUIRED if name not in row]
    if missing:
        raise ValueError(f"{where} has no {', '.join(map(repr, missing))}; expected {ROW}")
    batch = row["batch"]
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"{where}: 'batch' must be an int >= 1, got {batch!r}")
    for name, least in (("temperature", 0.0), ("speedup_vs_plain", None), ("plain_tok_s", None)):
        value = row[name]
        if not (_is_number(value) and math.isfinite(value)
                and (value >= least if least is not None else value > 0)):
            bound = ">= 0" if least is not None else "> 0"
            raise ValueError(f"{where}: {name!r} must be a finite number {bound}, got {value!r}")
    acceptance = row.get("acceptance_length")
    if acceptance is not None and not (_is_number(acceptance) and math.isfinite(acceptance)):
        raise ValueError(f"{where}: 'acceptance_length' must be a finite number, got "
                         f"{acceptance!r}")
    try:
        plan = plan_from_key(row["plan"])
    except ValueError as error:  # "key: 'x' is no shipped plan's key (...)"
        raise ValueError(f"{where}: 'plan': {str(error).partition(': ')[2]}") from None
    return _Row(batch, plan, float(row["temperature"]), float(row["speedup_vs_plain"]),
                float(row["plain_tok_s"]), float(acceptance or 0.0))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
