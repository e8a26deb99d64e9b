"""What the tlt rollout takes from veRL's config beyond veRL's own rollout fields:
`actor_rollout_ref.rollout.engine_kwargs.tlt`, the place veRL gives each backend's own options
(as engine_kwargs.vllm and engine_kwargs.sglang).

    actor_rollout_ref:
      rollout:
        name: tlt
        tensor_model_parallel_size: 1
        engine_kwargs:
          tlt:
            drafter: /path/to/drafter     # a Drafter.save / `tlt` drafter folder; none: no
                                          # learned drafter (suffix matching only)
            strategy: adaptive            # "adaptive", "plain", or a plan key: "(6,1,7)",
                                          # "sampled(4)", "suffix(8)"
            plans: ["(6,1,7)", "suffix(8)"]   # what "adaptive" chooses among (default: the
                                              # shipped plans and suffix(8))
            max_batch: 64                 # cache rows (default: the largest batch's rows)
            device: auto                  # "auto" (cuda when there is one), "cpu", "cuda:0"
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.plan_keys import plan_from_key

ADAPTIVE, PLAIN = "adaptive", "plain"


@dataclass(frozen=True)
class TLTRolloutOptions:
    drafter: str | None = None
    strategy: str = ADAPTIVE
    plans: tuple[str, ...] = ()
    max_batch: int | None = None
    device: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "plans", tuple(self.plans))
        if self.strategy not in (ADAPTIVE, PLAIN):
            try:
                plan_from_key(self.strategy)
            except ValueError as error:
                raise ValueError(f"strategy: expected {ADAPTIVE!r}, {PLAIN!r} or a plan key, "
                                 f"got {self.strategy!r}") from error
        for key in self.plans:
            try:
                plan_from_key(key)
            except ValueError as error:
                raise ValueError(f"plans: {error}") from error
        if self.plans and self.strategy != ADAPTIVE:
            raise ValueError(f"plans: are what strategy {ADAPTIVE!r} chooses among; strategy is "
                             f"{self.strategy!r}")
        if self.max_batch is not None and (not isinstance(self.max_batch, int)
                                           or self.max_batch < 1):
            raise ValueError(f"max_batch: must be an int >= 1 or None, got {self.max_batch!r}")

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: Mapping[str, Any] | None) -> TLTRolloutOptions:
        """The options under engine_kwargs["tlt"] (none: the defaults); ValueError naming a key
        this backend does not know."""
        given = dict((engine_kwargs or {}).get("tlt") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"engine_kwargs.tlt: unknown option(s) {unknown}; known: "
                             f"{sorted(known)}")
        if given.get("plans") is not None:
            given["plans"] = tuple(given["plans"])
        return cls(**given)

    def fixed_plan(self) -> DraftPlan | None:
        """The plan of every step for a plan-key strategy; None for plain (and adaptive)."""
        return None if self.strategy in (ADAPTIVE, PLAIN) else plan_from_key(self.strategy)

    def adaptive_plans(self) -> tuple[DraftPlan, ...]:
        """The plans "adaptive" chooses among; empty: the defaults."""
        return tuple(plan_from_key(key) for key in self.plans)
