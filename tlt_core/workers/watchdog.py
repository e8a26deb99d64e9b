"""The drafter watchdog: roll back a refresh that made drafting worse, turn SD off when no
drafter version is healthy.

Acceptance length (tokens a row emits per speculative step) is tracked per drafter version.
After a refresh publishes version v, the first rollout with it decides: if its acceptance is
below `worse_ratio` times the previous healthy version's, or below `collapse_below` (drafting
barely helps), v is rejected: the verdict carries the previous healthy weights, which the caller
loads into its drafter (the watchdog only reads the drafter, to snapshot what it publishes). If
no healthy version is left, speculation is disabled until the next refresh offers a new version.
Speculation is lossless whatever the drafter does, so a bad drafter costs speed, never
correctness; the watchdog bounds that cost to one round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt_core.drafting.drafter import Drafter

VERDICTS = ("ok", "rolled_back", "sd_disabled")


@dataclass
class _Version:
    number: int
    weights: dict[str, torch.Tensor]
    acceptance: list[float] = field(default_factory=list)

    @property
    def mean_acceptance(self) -> float | None:
        return sum(self.acceptance) / len(self.acceptance) if self.acceptance else None


@dataclass(frozen=True)
class Verdict:
    """The watchdog's judgement of one rollout's drafter version."""

    event: str  # one of VERDICTS
    # rolled_back: the weights of the healthy version to run again (load them into the drafter)
    restore: dict[str, torch.Tensor] | None = None


class DrafterWatchdog:
    def __init__(self, drafter: Drafter, *, worse_ratio: float = 0.8,
                 collapse_below: float = 1.5):
        if not 0 < worse_ratio <= 1:
            raise ValueError(f"worse_ratio: must be in (0, 1], got {worse_ratio}")
        if not collapse_below >= 1:
            raise ValueError(f"collapse_below: must be >= 1, got {collapse_below}")
        self.drafter, self.worse_ratio, self.collapse_below = drafter, worse_ratio, collapse_below
        self.healthy: _Version | None = None  # the last version judged good
        self.candidate: _Version | None = _Version(0, _snapshot(drafter))  # on probation
        self.version = 0  # the version the engines run now
        self.sd_enabled = True
        self.events: list[dict] = []  # what the watchdog did, for the metrics

    def publish(self) -> int:
        """The drafter's weights just changed (a refresh): a new version on probation."""
        self.version += 1
        self.candidate = _Version(self.version, _snapshot(self.drafter))
        self.sd_enabled = True
        self.events.append({"version": self.version, "event": "published"})
        return self.version

    def observe(self, acceptance_length: float | None) -> Verdict:
        """The acceptance a rollout measured with the current version: "ok", "rolled_back" (to
        the previous healthy version, whose weights the verdict carries) or "sd_disabled"."""
        if acceptance_length is None or not self.sd_enabled:
            return Verdict("ok" if self.sd_enabled else "sd_disabled")
        if self.candidate is None:  # the healthy version keeps running
            self.healthy.acceptance.append(acceptance_length)
            return Verdict("ok")
        candidate, previous = self.candidate, self.healthy
        candidate.acceptance.append(acceptance_length)
        floor = self.collapse_below
        if previous is not None and previous.mean_acceptance is not None:
            floor = max(floor, self.worse_ratio * previous.mean_acceptance)
        self.candidate = None
        if acceptance_length >= floor:
            self.healthy = candidate
            self.events.append({"version": candidate.number, "event": "accepted",
                                "acceptance": acceptance_length})
            return Verdict("ok")
        if previous is not None and (previous.mean_acceptance or 0) >= self.collapse_below:
            self.version = previous.number
            self.events.append({"version": candidate.number, "event": "rolled_back",
                                "to": previous.number, "acceptance": acceptance_length})
            return Verdict("rolled_back", previous.weights)
        self.sd_enabled = False
        self.events.append({"version": candidate.number, "event": "sd_disabled",
                            "acceptance": acceptance_length})
        return Verdict("sd_disabled")


def _snapshot(drafter: Drafter) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}
