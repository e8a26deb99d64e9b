"""Which draft plan for this step: BEG-MAB, a bandit per batch-size bucket (C++ in
csrc/bandit.cpp, so other engines can embed it; this wrapper names the arms).

Arms are draft plans (tlt_core.drafting.DraftPlan), identified by their `key`:
`Strategy(depth, topk, num_verify_tokens)` for the learned drafter, or `SuffixMatch(depth)`
for drafts copied from sibling responses. The reward of one step is what it
produced per second (the rollout loop uses emitted tokens / step seconds). Per bucket the bandit
is epsilon-greedy over a sliding window of each arm's last `window` rewards, with each arm's
prior (the cost model's predicted reward) counting as `prior_weight` observations, so it starts
at the predicted optimum and moves off it only on evidence. Its state, random stream included,
goes into checkpoints (`state_dict`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from tlt_core import _C
from tlt_core.drafting.plan import DraftPlan

DEFAULT_BUCKET_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class PlanBandit:
    def __init__(self, arms: Sequence[DraftPlan], *,
                 bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
                 epsilon: float = 0.1, window: int = 32, prior_weight: float = 2.0,
                 seed: int = 0):
        self.arms = tuple(arms)
        if not self.arms:
            raise ValueError("arms: need at least one plan")
        keys = [arm.key for arm in self.arms]
        if len(set(keys)) != len(keys):
            raise ValueError(f"arms: duplicate keys in {keys}")
        self._bandit = _C.BucketBandit(list(bucket_edges), len(self.arms), float(epsilon),
                                       int(window), float(prior_weight), int(seed) % 2**64)

    @property
    def bucket_edges(self) -> tuple[int, ...]:
        return tuple(self._bandit.bucket_edges)

    @property
    def explorations(self) -> int:
        return self._bandit.explorations

    def bucket(self, batch: int) -> int:
        return self._bandit.bucket(batch)

    def seed_priors(self, predict: Callable[[int, DraftPlan], float]) -> None:
        """Prior of every (bucket, arm): predict(bucket's upper edge, arm), a reward."""
        for bucket, edge in enumerate(self.bucket_edges):
            for index, arm in enumerate(self.arms):
                self._bandit.set_prior(bucket, index, float(predict(edge, arm)))

    def select(self, batch: int) -> int:
        """The arm for a step at this running batch size (may explore)."""
        return self._bandit.select(batch)

    def best(self, batch: int) -> DraftPlan:
        """The arm the bandit currently believes best at this batch size (no exploration)."""
        return self.arms[self._bandit.best(batch)]

    def update(self, batch: int, arm: int, reward: float) -> None:
        self._bandit.update(batch, arm, float(reward))

    def estimate(self, batch: int, arm: int) -> float:
        return self._bandit.estimate(self._bandit.bucket(batch), arm)

    def observations(self, batch: int, arm: int) -> int:
        return self._bandit.observations(self._bandit.bucket(batch), arm)

    def state_dict(self) -> dict:
        return {"arms": [arm.key for arm in self.arms], "state": self._bandit.save_state()}

    def load_state_dict(self, state: dict) -> None:
        arms = [arm.key for arm in self.arms]
        if list(state.get("arms", [])) != arms:
            raise ValueError(f"state: saved for arms {state.get('arms')}, this bandit has {arms}")
        self._bandit.load_state(bytes(state["state"]))
