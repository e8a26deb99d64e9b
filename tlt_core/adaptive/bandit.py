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

`window` is at most MAX_WINDOW: every (bucket, arm) keeps that many rewards, and a window of
thousands of steps would average over drafters long since retrained. A loaded state is checked
field by field before the C++ bandit takes it, so a corrupt or hand-edited checkpoint cannot set
an epsilon outside [0, 1] or a non-finite reward.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Callable, Sequence

from tlt_core import _C
from tlt_core.drafting.plan import DraftPlan

DEFAULT_BUCKET_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_WINDOW = 4096  # rewards kept per (bucket, arm)
STATE_MAGIC = b"TLTBAND1"  # csrc/bandit.cpp's save_state layout, native byte order


def _integer(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__} {value!r}")
    return float(value)


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
        edges = [_integer("bucket_edges", edge, 1) for edge in bucket_edges]
        window = _integer("window", window, 1)
        if window > MAX_WINDOW:
            raise ValueError(f"window: at most {MAX_WINDOW} rewards per (bucket, arm), "
                             f"got {window}")
        self._bandit = _C.BucketBandit(edges, len(self.arms), _number("epsilon", epsilon),
                                       window, _number("prior_weight", prior_weight),
                                       _integer("seed", seed, 0) % 2**64)
        self._window = window

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
        if not isinstance(state.get("state"), (bytes, bytearray)):
            raise TypeError(f"state: 'state' must be the bytes state_dict() wrote, got "
                            f"{type(state.get('state')).__name__}")
        data = bytes(state["state"])
        _check_state(data, self._window)
        self._bandit.load_state(data)

    def update(self, batch: int, arm: int, reward: float) -> None:
        self._bandit.update(_integer("batch", batch, 1), _integer("arm", arm, 0),
                            _number("reward", reward))


def _check_state(data: bytes, window: int) -> None:
    """Raises naming the field when a saved state's values are out of range; the layout (sizes,
    edges, arm count) the C++ loader checks itself."""
    if not data.startswith(STATE_MAGIC):
        raise ValueError("state: not a tlt bandit state")
    try:
        offset = len(STATE_MAGIC)
        (buckets,) = struct.unpack_from("=i", data, offset)
        offset += 4 + 4 * max(buckets, 0)
        arms, saved_window, epsilon, prior_weight, _stream, explorations = struct.unpack_from(
            "=iiddQq", data, offset)
        offset += struct.calcsize("=iiddQq")
        if saved_window != window or buckets < 1 or arms < 1:
            return  # a state of another shape: the C++ loader says which
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"state: epsilon must be in [0, 1], got {epsilon}")
        if not (math.isfinite(prior_weight) and prior_weight >= 0):
            raise ValueError(f"state: prior_weight must be finite and >= 0, got {prior_weight}")
        if explorations < 0:
            raise ValueError(f"state: explorations must be >= 0, got {explorations}")
        cell = struct.Struct(f"=Bdii{window}d")
        for index in range(buckets * arms):
            has_prior, prior, _next, _count, *rewards = cell.unpack_from(data, offset)
            offset += cell.size
            if has_prior not in (0, 1):
                raise ValueError(f"state: cell {index} has_prior must be 0 or 1, got {has_prior}")
            if not math.isfinite(prior):
                raise ValueError(f"state: cell {index} prior must be finite, got {prior}")
            if not all(map(math.isfinite, rewards)):
                raise ValueError(f"state: cell {index} rewards must be finite")
    except struct.error:
        return  # truncated: the C++ loader reports it
