"""A step-cost model of one engine on this machine, calibrated at engine start.

For every calibrated running batch size B and draft plan (None: plain decoding), the model
holds the tokens per second that real engine steps produced: calibration runs `generate` on B
copies of a few workload prompts with that plan on every step, and times each step through the
engine's observe hook (so drafting, verification, the accept phase and the Python around them
are all in the number), keeping the steps at which all B rows were still running. Emitted
tokens include the acceptance each plan achieved on those prompts. Measured, not modelled from
components: on a small model per-op overhead dominates and a component sum underestimates a
speculative step by up to 2x (we tried).

`rate(B, plan)` is the bandit's prior (interpolated between calibrated batches);
`threshold(plans)` the largest calibrated batch at which some plan beats plain decoding by
`margin`: the SD switch's default.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tlt_core.model_free import SuffixDrafts


@dataclass
class CostModel:
    rates: dict[tuple[int, str], float]  # (batch, str(plan) or "plain") -> tokens per second
    calibration_s: float = 0.0  # what calibrating took

    @property
    def batches(self) -> list[int]:
        return sorted({b for b, _ in self.rates})

    def rate(self, batch: int, plan) -> float:
        """Measured tokens per second of a step with plan, interpolated linearly in log2(batch)
        between calibrated batches (held flat outside them)."""
        key = "plain" if plan is None else str(plan)
        batches = self.batches
        if batch <= batches[0] or batch >= batches[-1]:
            return self.rates[(batches[0] if batch <= batches[0] else batches[-1], key)]
        high = next(b for b in batches if b >= batch)
        low = max(b for b in batches if b <= batch)
        if high == low:
            return self.rates[(low, key)]
        t = (math.log2(batch) - math.log2(low)) / (math.log2(high) - math.log2(low))
        return (1 - t) * self.rates[(low, key)] + t * self.rates[(high, key)]

    def threshold(self, plans: Sequence[object], margin: float = 0.05) -> int:
        """The largest calibrated batch at which the best plan beats plain decoding by margin,
        over a run of such batches from the smallest (0 if it does not pay even there)."""
        best = 0
        for batch in self.batches:
            if max(self.rate(batch, p) for p in plans) <= (1 + margin) * self.rate(batch, None):
                break
            best = batch
        return best


def calibrate(engine, plans: Sequence[object], batches: Sequence[int],
              calibration_requests: Sequence, *, max_tokens: int = 24) -> CostModel:
    """Measures engine's tokens per second for every batch in batches (at most
    engine.config.max_batch) and every plan and plain decoding, on copies of
    calibration_requests (a few prompts like the workload's) cut to max_tokens."""
    from dataclasses import replace

    start = time.perf_counter()
    batches = sorted({int(b) for b in batches if 1 <= b <= engine.config.max_batch})
    if not batches:
        raise ValueError(f"batches: need sizes in [1, max_batch={engine.config.max_batch}]")
    if not calibration_requests:
        raise ValueError("calibration_requests: need at least one request to calibrate on")
    rates = {}
    kept = engine.model_free  # the workload's history: calibration neither reads nor adds to it
    try:
        for batch in batches:
            requests = [replace(r, params=replace(
                r.params, n=1,
                max_tokens=max(1, min(max_tokens, engine.config.max_len - len(r.prompt_ids)))))
                for r in (list(calibration_requests) * batch)[:batch]]
            for plan in (None,) + tuple(plans):
                # model-free drafts see this run's siblings only, not earlier calibration runs
                engine.model_free = SuffixDrafts()
                rates[(batch, "plain" if plan is None else str(plan))] = _measure(
                    engine, requests, plan, batch)
    finally:
        engine.model_free = kept
    return CostModel(rates, time.perf_counter() - start)


class _Recorder:
    """A fixed-plan policy (None: plain steps, still under a policy, so the engine keeps the
    drafter's backlog as in the adaptive loop's SD-off phase) that adds up the full-batch
    steps' tokens and seconds."""

    def __init__(self, plan, batch: int):
        self.plan, self.batch = plan, batch
        self.tokens, self.seconds = 0, 0.0

    def __call__(self, batch: int):
        return self.plan

    def observe(self, batch: int, plan, emitted: int, seconds: float) -> None:
        if batch == self.batch:
            self.tokens += emitted
            self.seconds += seconds


@torch.inference_mode()
def _measure(engine, requests, plan, batch: int) -> float:
    recorder = _Recorder(plan, batch)
    engine.generate(requests, recorder)
    if recorder.seconds == 0:
        raise RuntimeError(f"calibration: no step ran with all {batch} rows; raise max_tokens")
    return recorder.tokens / recorder.seconds
