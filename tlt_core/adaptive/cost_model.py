"""A step-cost model of one engine on this machine, calibrated at engine start.

For every calibrated running batch size B and draft plan (None: plain decoding), the model
holds the tokens per second that real engine steps produced: calibration runs `generate` on B
copies of a few workload prompts with that plan on every step, and times each step through the
engine's observe hook (so drafting, verification, the accept phase and the Python around them
are all in the number), keeping the steps at which all B rows were still running. Emitted
tokens include the acceptance each plan achieved on those prompts. Measured, not modelled from
components: on a small model the per-op overhead around the components (the accept phase, the
Python between kernels) is a large share of a step, and a sum of component timings leaves it
out.

`rate(B, plan, context)` is the adaptive loop's prediction (interpolated between calibrated
batches), whose level the loop's own steps correct; `threshold(plans)` the largest calibrated
batch at which some plan beats plain decoding by `margin` (the simulator's switch point).

Two kinds of plain step: `None`, a plain step of a loop that may speculate later (the adaptive
loop's SD-off phase: the target also returns the drafter's features, which the drafter's
backlog queues without running the drafter), and `SD_OFF`, plain decoding with speculation off for the whole call (no
drafter in the loop: what a rollout without SD costs). The second is cheaper; it is measured
when `calibrate(..., sd_off=True)`, and a model without it uses the first for both.

Tables are keyed by (batch, plan key): `DraftPlan.key` for a plan, "plain" for None, "off"
for SD_OFF. Calibration runs on its own state: copies of the requests, and a fresh suffix
index per measurement, so it neither reads nor adds to the engine's history.

Calibration needs steps, not text, so it runs every request as one sample of exactly
`max_tokens` tokens, its stop ids masked throughout (tlt_core.engine.records.exact_length): a
model whose first token ends its turn still decodes, and goes on with its response rather than
past its end of turn (a text no workload has). The text is still not quite the workload's, so a
plan's acceptance can differ there; the adaptive loop corrects the prediction with the
workload's own steps. A prompt that would leave fewer than `max_tokens` slots in `EngineConfig.max_len` keeps
its last tokens only (the end of a chat prompt is what a response follows).

What it still cannot time it leaves out, with one warning, and never raises for: a batch size
at which some plan (or plain decoding) never ran a step with all its rows (prompts too long for
`EngineConfig.prefill_tokens` to admit them together, so the first rows finish before the last
arrive; a max_len that leaves a row one token) is dropped from every table. Its rates are then
interpolated between, or held at, the nearest timed batch sizes, and `threshold` chooses among
timed batch sizes only. With no batch size timed the model is empty: `threshold` is 0 and
`rate` raises LookupError (the adaptive loop then has no prediction and measures every arm).

What a shared machine does to a sweep it repairs, with one warning: other work can only slow a
measurement, never speed it, and an arm's tokens per second barely fall as the batch grows (B
rows could run as two steps of B / 2; a step that turns bound by the arithmetic loses a few
percent), so a rate under SLOWED_SWEEP of the same arm's at a smaller batch is held at that
rate (a burst of other work can time plain decoding at 32 rows at a third of its rate at 16;
the arm table keeps calibration's shape within a batch bucket, so the adaptive loop would then
run SD where it is half as fast: docs/results.md, "GRPO end to end"); and attention reads
more with every token of context, so a fitted context slope below 0 is 0.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Sequence

from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.suffix_index import SuffixIndex
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.hooks import StepOutcome
from tlt_core.engine.records import Request, exact_length

PLAIN_KEY, SD_OFF_KEY = "plain", "off"
# a context fit whose longest context is at least this many times the mean the rates were
# measured at is extrapolated past it (CostModel.context_max)
EXTRAPOLATE_SPAN = 2.0
# a rate under this share of the same arm's at a smaller batch was slowed by other work (module
# docstring); SD's steps at 64 rows, bound by the arithmetic, run a few percent under 16 rows'
SLOWED_SWEEP = 0.8


class _SdOff:
    """Plain decoding with speculation off for a whole generate call: a cost-model key, not a
    plan the engine runs."""

    key = SD_OFF_KEY

    def __repr__(self) -> str:
        return "SD_OFF"


SD_OFF = _SdOff()


@dataclass
class CostModel:
    # (batch, plan key) -> tokens per second; "plain" for None, "off" for SD_OFF
    rates: dict[tuple[int, str], float]
    calibration_s: float = 0.0  # what calibrating took
    # plan key -> tokens a row emitted per step in calibration (the simulator's default)
    acceptance: dict[str, float] = field(default_factory=dict)
    # How a step's time grows with the rows' context (attention reads it all): per (batch,
    # key), seconds per step per context token, fitted over the calibration's steps (or
    # through its short and long-context runs: calibrate's long_context), and the mean context
    # at which `rates` were measured. Empty: context-independent.
    context_slope: dict[tuple[int, str], float] = field(default_factory=dict)
    context_mean: dict[tuple[int, str], float] = field(default_factory=dict)
    # the longest context the fit saw. A line that spans little (its longest context under
    # EXTRAPOLATE_SPAN x the mean the rates were measured at: one short run's tens of tokens)
    # is held at it; a wider one (a stretched run's) is extrapolated, as attention's cost grows
    # linearly with the context it reads
    context_max: dict[tuple[int, str], float] = field(default_factory=dict)
    # What a generate call of `batch` fresh rows costs outside its decode steps (prefill of the
    # target's and the drafter's caches, scheduling, collecting the results), per (batch, key):
    # its wall time minus the steps the observe hook timed. Empty: none.
    admission_s: dict[tuple[int, str], float] = field(default_factory=dict)
    # the CalibrationCache entry this model was read from (tlt_core.adaptive.calibration_cache);
    # None: measured by this process
    cached_from: str | None = None

    @property
    def batches(self) -> list[int]:
        return sorted({b for b, _ in self.rates})

    def key(self, plan: DraftPlan | _SdOff | None) -> str:
        """The tables' key of plan: plan.key; "plain" for None, and for SD_OFF when it was not
        measured."""
        if plan is None or (plan is SD_OFF and not any(k == SD_OFF_KEY for _, k in self.rates)):
            return PLAIN_KEY
        return plan.key

    def rate(self, batch: int, plan, context: float | None = None) -> float:
        """Measured tokens per second of a step with plan, interpolated linearly in log2(batch)
        between calibrated batches (held flat outside them); at a mean row context (tokens)
        when given and the calibration fitted the context dependence."""
        key = self.key(plan)
        batches = self.batches
        if not batches:
            raise LookupError("rate: calibration timed no batch size, so this cost model has no "
                              "rates (its threshold keeps SD off)")
        if batch <= batches[0] or batch >= batches[-1]:
            edge = batches[0] if batch <= batches[0] else batches[-1]
            return self._at(edge, key, context)
        high = next(b for b in batches if b >= batch)
        low = max(b for b in batches if b <= batch)
        if high == low:
            return self._at(low, key, context)
        t = (math.log2(batch) - math.log2(low)) / (math.log2(high) - math.log2(low))
        return (1 - t) * self._at(low, key, context) + t * self._at(high, key, context)

    def _at(self, batch: int, key: str, context: float | None) -> float:
        rate = self.rates[(batch, key)]
        if context is None or (batch, key) not in self.context_slope:
            return rate
        emitted = batch * self.acceptance.get(key, 1.0)
        longest = self.context_max.get((batch, key), context)
        if longest < EXTRAPOLATE_SPAN * self.context_mean[(batch, key)]:
            context = min(context, longest)
        seconds = emitted / rate + self.context_slope[(batch, key)] * (
            context - self.context_mean[(batch, key)])
        return emitted / max(seconds, 0.1 * emitted / rate)  # a steep fit never goes below 10%

    def admission(self, rows: int, plan) -> float:
        """Seconds to admit `rows` fresh rows under plan, outside the decode steps: at the
        nearest calibrated batch at or below rows (the smallest one below them all)."""
        key = self.key(plan)
        calibrated = [b for b, k in self.admission_s if k == key]
        if not calibrated:
            return 0.0
        below = [b for b in calibrated if b <= rows]
        return self.admission_s[(max(below) if below else min(calibrated), key)]

    def threshold(self, plans: Sequence[object], margin: float = 0.05) -> int:
        """The largest calibrated batch at which the best plan beats plain decoding by margin,
        over a run of such batches from the smallest (0 if it does not pay even there)."""
        best = 0
        for batch in self.batches:
            if max(self.rate(batch, p) for p in plans) <= (1 + margin) * self.rate(batch, None):
                break
            best = batch
        return best


def calibrate(engine: RolloutEngine, plans: Sequence[DraftPlan], batches: Sequence[int],
              calibration_requests: Sequence[Request], *, max_tokens: int = 24,
              sd_off: bool = False, reps: int = 1, long_context: int = 0) -> CostModel:
    """Measures engine's tokens per second for every batch in batches (at most
    engine.config.max_batch) and every plan and plain decoding (and, with sd_off, plain
    decoding with speculation off: SD_OFF), on copies of calibration_requests (a few prompts
    like the workload's) run to max_tokens each, stop ids masked (see the module docstring,
    also for what it leaves out when a batch size cannot be timed). reps > 1 sweeps every
    measurement that many times and keeps medians: a sweep is seconds long, and on a shared
    machine a burst of someone else's work can slow one sweep by 10%; the median ignores it.

    long_context > 0 times every measurement a second time with each prompt stretched to that
    many tokens (fewer where `EngineConfig.prefill_tokens` would not admit the batch's rows at
    once, or `max_len` would not hold them), and fits each (batch, plan)'s context slope between
    the two runs: the rows of a rollout reach contexts of a thousand tokens and more, where a
    step costs more than the tens of tokens one short run spans can say."""
    start = time.perf_counter()
    batches = sorted({int(b) for b in batches if 1 <= b <= engine.config.max_batch})
    if not batches:
        raise ValueError(f"batches: need sizes in [1, max_batch={engine.config.max_batch}]")
    if not calibration_requests:
        raise ValueError("calibration_requests: need at least one request to calibrate on")
    if reps < 1:
        raise ValueError(f"reps: must be >= 1, got {reps}")
    if long_context < 0:
        raise ValueError(f"long_context: must be >= 0 tokens (0: no long-context runs), got "
                         f"{long_context}")
    if max_tokens < 2:
        raise ValueError(f"max_tokens: must be >= 2 (a row's first token comes from prefill, "
                         f"only the later ones from the steps calibration times), got {max_tokens}")
    tokens = min(max_tokens, engine.config.max_len - 1)  # a prompt keeps at least one token
    requests = [_timing_request(r, tokens, engine.config.max_len) for r in calibration_requests]
    # untimed: a process's first generate call pays one-time costs (thread pools, packed
    # weights) that would land in the first measurement's admission time
    first = requests[0]
    engine.generate([replace(first, params=exact_length(first.params, min(2, tokens)))],
                    _Recorder(None, 1), suffix_index=SuffixIndex())
    measured = (SD_OFF,) * sd_off + (None,) + tuple(plans)
    # per (batch, key), one entry per sweep that timed a step: seconds per full-batch step,
    # admission seconds, context fit (slope, mean context, longest context)
    step_s, admission, fits = {}, {}, {}
    emitted = {}  # (batch, key) -> (tokens, row steps), summed over sweeps
    for _ in range(reps):
        for batch in batches:
            rows = (requests * batch)[:batch]
            prompt = sum(len(r.prompt_ids) for r in rows) / len(rows)
            stretched = _stretched(rows, long_context, tokens, engine.config)
            for plan in measured:
                recorder = _measure(engine, rows, plan, batch)
                if not recorder.steps:  # no step with all rows: this sweep times nothing
                    continue
                key = (batch, _table_key(plan))
                step_s.setdefault(key, []).append(recorder.seconds / len(recorder.steps))
                admission.setdefault(key, []).append(
                    max(0.0, recorder.wall_s - recorder.all_steps_s))
                long = (_measure(engine, stretched, plan, batch) if stretched is not None
                        else None)
                fit = (recorder.context_fit(prompt) if long is None or not long.steps
                       else _two_run_fit(recorder, prompt, long, len(stretched[0].prompt_ids)))
                if fit is not None:
                    fits.setdefault(key, []).append(fit)
                tokens_so_far, rows_so_far = emitted.get(key, (0, 0))
                emitted[key] = (tokens_so_far + recorder.tokens, rows_so_far + recorder.row_steps)
    missing = {batch: [_table_key(p) for p in measured if (batch, _table_key(p)) not in step_s]
               for batch in batches}
    timed = [batch for batch in batches if not missing[batch]]
    if len(timed) < len(batches):
        warnings.warn(_untimed_warning(missing, timed, len(measured)), RuntimeWarning,
                      stacklevel=2)
    kept = [key for key in step_s if key[0] in timed]  # every table covers the same batches
    acceptance = {}  # a plan's tokens per row step, pooled over timed batch sizes and sweeps
    for plan in plans:
        pooled = [emitted[(batch, plan.key)] for batch in timed]
        if pooled:
            acceptance[plan.key] = sum(t for t, _ in pooled) / sum(r for _, r in pooled)
    # a step's duration is what was measured; the tokens it emits, the pooled acceptance
    rates = _unslowed(
        {key: key[0] * acceptance.get(key[1], 1.0) / median(step_s[key]) for key in kept})
    fitted = {key: tuple(median(column) for column in zip(*fits[key]))
              for key in kept if key in fits}
    return CostModel(rates, time.perf_counter() - start, acceptance,
                     {key: max(fit[0], 0.0) for key, fit in fitted.items()},
                     {key: fit[1] for key, fit in fitted.items()},
                     {key: fit[2] for key, fit in fitted.items()},
                     {key: median(admission[key]) for key in kept})


def _unslowed(rates: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
    """rates with each under SLOWED_SWEEP of the same key's best at a smaller batch held at that
    one (the module docstring: a sweep that other work slowed), warning once with what it
    held."""
    held, repaired = [], dict(rates)
    for key in sorted({k for _, k in rates}):
        best = 0.0, 0
        for batch in sorted(b for b, k in rates if k == key):
            rate = rates[(batch, key)]
            if rate < SLOWED_SWEEP * best[0]:
                repaired[(batch, key)] = best[0]
                held.append(f"{key} at batch {batch} timed {rate:.0f} tokens/s, held at batch "
                            f"{best[1]}'s {best[0]:.0f}")
            elif rate > best[0]:
                best = rate, batch
    if held:
        warnings.warn("calibration: " + "; ".join(held) + " (other work on the machine slowed "
                      "those sweeps: a larger batch is not that much slower per token)",
                      RuntimeWarning, stacklevel=3)
    return repaired


def _table_key(plan: DraftPlan | _SdOff | None) -> str:
    return PLAIN_KEY if plan is None else plan.key


def _timing_request(request: Request, tokens: int, max_len: int) -> Request:
    """request as calibration runs it: one sample of exactly `tokens` tokens (exact_length),
    its prompt cut to its last max_len - tokens tokens."""
    return replace(request, prompt_ids=request.prompt_ids[-(max_len - tokens):],
                   params=replace(exact_length(request.params, tokens), n=1))


def _stretched(rows: list[Request], long_context: int, tokens: int, config: EngineConfig
               ) -> list[Request] | None:
    """rows with each prompt repeated up to one length (the original prompt last, as a
    response follows it): long_context tokens, or the most that `prefill_tokens` admits for all
    rows at once and `max_len` holds with `tokens` more; None when that is no longer than the
    prompts are."""
    length = min(long_context, config.prefill_tokens // len(rows), config.max_len - tokens)
    if long_context == 0 or length <= max(len(r.prompt_ids) for r in rows):
        return None
    return [replace(r, prompt_ids=(tuple(r.prompt_ids) * -(-length // len(r.prompt_ids)))
                    [-length:]) for r in rows]


def _two_run_fit(short: _Recorder, short_prompt: float, long: _Recorder, long_prompt: int
                 ) -> tuple[float, float, float]:
    """(slope, mean context, longest context) of step seconds against the rows' context,
    through the short run's and the stretched run's mean step: a line over hundreds of tokens of
    context, where one run's own steps span tens."""
    short_context, long_context = short.mean_context(short_prompt), long.mean_context(long_prompt)
    slope = ((long.seconds / len(long.steps) - short.seconds / len(short.steps))
             / (long_context - short_context))
    return slope, short_context, max(long_prompt + done for done, _ in long.steps)


def _untimed_warning(missing: dict[int, list[str]], timed: list[int], keys_per_batch: int
                     ) -> str:
    """The one warning of a calibration that could not time every batch size: what it missed,
    why that happens, and what the cost model does instead."""
    gaps = "; ".join(f"batch {batch} for " + ("every plan and plain decoding"
                                               if len(keys) == keys_per_batch else ", ".join(keys))
                     for batch, keys in missing.items() if keys)
    fallback = (f"those batch sizes are left out: their rates are interpolated between, or held "
                f"at, the timed sizes {timed}"
                if timed else "nothing was timed: the cost model is empty, and the adaptive loop "
                "starts from plain decoding with no prediction, measuring every arm itself")
    return (f"calibration: no step ran with all rows at {gaps}; rows finished before all were "
            f"admitted (prompts too long for EngineConfig.prefill_tokens to admit together, or "
            f"a max_len that leaves a row one token); {fallback}")


class _Recorder:
    """A fixed-plan PlanPolicy (None: plain steps, still under a policy, so the engine keeps the
    drafter's backlog as in the adaptive loop's SD-off phase) that adds up the full-batch
    steps' tokens and seconds. SD_OFF: no policy at all, the recorder only observes."""

    def __init__(self, plan: DraftPlan | None, batch: int):
        self.plan, self.batch = plan, batch
        self.tokens, self.seconds, self.row_steps = 0, 0.0, 0
        self.steps: list[tuple[float, float]] = []
        self.all_steps_s = 0.0  # every step's time, whatever its batch
        self.wall_s = 0.0  # the whole generate call

    def start_call(self) -> None:
        pass  # one recorder per call

    def choose(self, batch: int, context: int) -> DraftPlan | None:
        return self.plan

    def observe(self, outcome: StepOutcome) -> None:
        self.all_steps_s += outcome.seconds
        if outcome.batch == self.batch:
            # (tokens per row so far, step time)
            self.steps.append((self.tokens / outcome.batch, outcome.seconds))
            self.tokens += outcome.emitted
            self.seconds += outcome.seconds
            self.row_steps += outcome.batch

    def mean_context(self, prompt_length: float) -> float:
        """The rows' mean context over the full-batch steps."""
        return prompt_length + sum(done for done, _ in self.steps) / len(self.steps)

    def context_fit(self, prompt_length: float) -> tuple[float, float, float] | None:
        """Least-squares seconds-per-step against the rows' mean context: (slope, mean
        context, longest context), or None with too few steps to fit."""
        if len(self.steps) < 4:
            return None
        contexts = [prompt_length + done for done, _ in self.steps]
        times = [seconds for _, seconds in self.steps]
        mean_c, mean_t = sum(contexts) / len(contexts), sum(times) / len(times)
        spread = sum((c - mean_c) ** 2 for c in contexts)
        if spread == 0:
            return None
        slope = sum((c - mean_c) * (t - mean_t) for c, t in zip(contexts, times)) / spread
        return slope, mean_c, max(contexts)


def _measure(engine: RolloutEngine, requests: list[Request], plan, batch: int) -> _Recorder:
    """One calibration run; suffix-match drafts see this run's siblings only. Its recorder
    has no steps if no step ran with all `batch` rows."""
    recorder = _Recorder(None if plan is SD_OFF else plan, batch)
    start = time.perf_counter()
    if plan is SD_OFF:
        engine.generate(requests, None, observe=recorder.observe, suffix_index=SuffixIndex())
    else:
        engine.generate(requests, recorder, suffix_index=SuffixIndex())
    recorder.wall_s = time.perf_counter() - start
    return recorder
