"""Harvest: drafter training data from the target passes a rollout already makes.

While a worker decodes, every position the target commits to its cache went through a target
pass (prefill, a plain step, or a speculative verification) that computed its hidden states.
The engine hands those to a `HarvestBuffer` (its `tlt_core.engine.HarvestSink`) — the feature
layers the drafter reads and the last layer it regresses onto — with the token at that
position, in position order, so a finished sequence becomes a `DraftRecord` without any extra
target forward.

Alignment: position t of a record holds x_t and the target's outputs after x_t; `eagle_loss`
pairs (f_t, x_{t+1}) and scores against t + 1. A sequence's final token (sampled, never fed to
the target) is not a position, so its last pair (f_{T-1}, x_T) is not harvested.

Bounded: records are kept newest first up to `max_bytes` (the oldest are evicted: the target
moves, so recent data is the relevant data); training batches are packed by length. Cheap on
the critical path: the engine's per-step cost is a stack, a copy of the token ids and a tuple
per row; finished sequences become records only when `collect()` is called, which the spot
trainer does in idle time.

Shapes: T positions, F feature layers, H hidden size.
"""

from __future__ import annotations

import random
from collections import deque

import torch

from tlt_core.drafting.training import DraftBatch, DraftRecord, make_batch


class HarvestBuffer:
    def __init__(self, max_bytes: int = 256 << 20, min_length: int = 4):
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.max_bytes, self.min_length = max_bytes, min_length
        self.records: deque[DraftRecord] = deque()  # collected, oldest first
        self._complete: list[list[tuple[int, int, int]]] = []  # finished, not yet assembled
        self.bytes = 0
        self.evicted = 0
        self.version = 0  # bumped whenever the records change
        # A step's tensors stay on their device, whole, until every sequence in them finished:
        # per step the engine pays one dict entry and a tuple per row, not a copy per row.
        self._steps: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._step_users: dict[int, int] = {}
        self._pieces: dict[object, list[tuple[int, int, int]]] = {}  # key -> (step, row, count)
        self._next_step = 0

    def add_step(self, keys: list, tokens: torch.Tensor, features: torch.Tensor,
                 last_hidden: torch.Tensor, counts: list[int]) -> None:
        """Positions one target pass committed: row b of tokens (B, W), features (B, W, F, H)
        and last_hidden (B, W, H) holds counts[b] positions of sequence keys[b], in order."""
        step = self._next_step
        self._next_step += 1
        self._steps[step] = (tokens, features, last_hidden)
        self._step_users[step] = len(keys)
        for row, (key, count) in enumerate(zip(keys, counts)):
            self._pieces.setdefault(key, []).append((step, row, count))

    def finish(self, key: object) -> None:
        """Sequence `key` is complete. Only bookkeeping here, on the rollout's critical path:
        its record is assembled (slices gathered, copied to the CPU) by the next collect(),
        which the spot trainer calls in idle time."""
        pieces = self._pieces.pop(key, None)
        if pieces is not None:
            self._complete.append(pieces)

    def collect(self) -> int:
        """Turns the sequences finished since the last call into DraftRecords (appended to
        `records`, oldest first), then evicts the oldest records beyond max_bytes. Returns how
        many records there are."""
        for pieces in self._complete:
            if sum(count for _, _, count in pieces) >= self.min_length:
                parts = [tuple(t[row, :count] for t in self._steps[step])
                         for step, row, count in pieces]
                record = DraftRecord(*(torch.cat(column).detach().to("cpu")
                                       for column in zip(*parts)))
                self.records.append(record)
                self.version += 1
                self.bytes += _record_bytes(record)
            self._drop(pieces)
        self._complete.clear()
        while self.bytes > self.max_bytes and len(self.records) > 1:
            self.bytes -= _record_bytes(self.records.popleft())
            self.evicted += 1
        return len(self.records)

    def _drop(self, pieces: list[tuple[int, int, int]]) -> None:
        for step, _, _ in pieces:
            self._step_users[step] -= 1
            if self._step_users[step] == 0:
                del self._steps[step], self._step_users[step]

    def __len__(self) -> int:
        """Records collected so far (finished sequences count once collect() ran)."""
        return len(self.records)

    def batches(self, max_tokens: int, rng: random.Random | None = None) -> list[DraftBatch]:
        """The collected records packed into batches of at most max_tokens padded positions (a
        longer record gets a batch of its own): sorted by length so each batch pads little; in
        that order, or shuffled with rng."""
        ordered = sorted(self.records, key=lambda r: r.tokens.shape[0])
        batches, current = [], []
        for record in ordered:
            width = max([r.tokens.shape[0] for r in current] + [record.tokens.shape[0]])
            if current and width * (len(current) + 1) > max_tokens:
                batches.append(make_batch(current))
                current = []
            current.append(record)
        if current:
            batches.append(make_batch(current))
        if rng is not None:
            rng.shuffle(batches)
        return batches


def _record_bytes(record: DraftRecord) -> int:
    return sum(t.numel() * t.element_size()
               for t in (record.tokens, record.features, record.last_hidden))
