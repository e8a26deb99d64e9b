"""The drafter's per-row state over the engine's cache rows: its KV cache, the backlog of pairs
committed without it, and each row's last output.

The contract (tlt_core.drafting.drafter, "position bookkeeping"): after `flush`, the drafter's
cache holds, for every running row, the pairs (f_t, x_{t+1}) of exactly the positions the
target's cache holds, and `last_hidden[row]` is the drafter's output at the last of them (its
guess of the root's feature, which seeds the next tree). The operations:

- `extend(first_row, ...)`: run the drafter over pairs the target just committed, now (after a
  prefill, and after a speculative step whose plan drafts with it again next);
- `follow(first_row, ...)`: pairs committed without the drafter (prompts, plain and
  suffix-match steps): extended now (`sync="eager"`) or queued in the backlog (`sync="lazy"`),
  which keeps the target's features of those positions and runs the drafter over them in one
  batched pass at the next `flush`, or when `backlog_capacity` positions are queued (a
  capacity of the row's whole length never flushes early: while a loop decodes without SD, the
  drafter does no work at all). The drafts are the same either way;
- `flush(batch)`: catch up on the backlog of rows [0, batch): call before drafting;
- `move_row(source, target)` / `free_row(row)`: follow the engine's row moves (a finished
  row's slot takes the last running row) and free a row.

`extend` writes every pair of its (B, T) input to the cache and commits counts[b] of them per
row: padding after a row's valid pairs lands in uncommitted slots that no valid pair sees.
Every count is given on the device and on the host (the engine knows both after its step's one
read), so no operation here reads the device.

Shapes: R cache rows, B rows of a step, T pairs per row, F feature layers, H hidden size.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tlt_core.drafting.learned import LearnedDrafter
from tlt_core.model.attention_plan import attention_plan
from tlt_core.model.kv_cache import KVCache

SYNCS = ("lazy", "eager")


class DrafterRows:
    def __init__(self, drafter: LearnedDrafter, rows: int, max_len: int, *, sync: str = "lazy",
                 backlog_capacity: int = 128):
        if sync not in SYNCS:
            raise ValueError(f"sync: must be one of {SYNCS}, got {sync!r}")
        self.drafter = drafter
        self.cache = drafter.new_cache(rows, max_len)
        self.sync, self.backlog_capacity = sync, backlog_capacity
        device, dtype = self.cache.device, drafter.fc.weight.dtype  # the features' dtype
        hidden = drafter.target.config.hidden_size
        self.last_hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)  # (R, H)
        self._num_features = len(drafter.config.feature_layers)
        # The backlog: per row, committed pairs (x_{t+1}, the target's features at t) that the
        # drafter has not run over, _backlog_len of them; allocated on first use.
        self._backlog_tokens: torch.Tensor | None = None  # (R, capacity) int64
        self._backlog_features: torch.Tensor | None = None  # (R, capacity, F, H)
        self._backlog_len = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,)
        self._backlog_len_host = np.zeros(rows, dtype=np.int64)  # (R,) the same, on the host

    def reset(self) -> None:
        """Every row empty: a new generate call."""
        self.cache.set_lengths(0)
        self._backlog_len.zero_()
        self._backlog_len_host[:] = 0

    def rows(self, batch: int) -> KVCache:
        """The drafter's cache over rows [0, batch)."""
        return self.cache.rows(0, batch)

    def extend(self, first_row: int, following: torch.Tensor,
               target_hidden: Sequence[torch.Tensor], counts: torch.Tensor,
               host_counts: Sequence[int] | np.ndarray) -> None:
        """Commits the pairs (f_t, x_{t+1}) of positions the target just committed, for rows
        [first_row, first_row + B): following (B, T) the tokens x_{t+1}, target_hidden the
        target's outputs at its feature layers (each (B, T, H); further layers are ignored),
        counts (B,) valid pairs per row (host_counts: the same on the host). Keeps each row's
        last output."""
        batch = following.shape[0]
        hidden = self.run(first_row, following, target_hidden)
        self.commit(first_row, hidden[:batch], counts, host_counts)

    def run(self, first_row: int, following: torch.Tensor, target_hidden: Sequence[torch.Tensor],
            read_len: int | None = None) -> torch.Tensor:
        """extend's drafter pass alone (nothing committed): the drafter's outputs (B, T, H) over
        the pairs, written to the rows' uncommitted slots; read_len: attend over exactly that
        many slots (a fixed shape, for a CUDA graph; tlt_core.engine.step_graphs)."""
        batch, width = following.shape
        view = self.cache.rows(first_row, batch)
        positions = view.lengths[:, None] + torch.arange(width, device=following.device)  # (B, T)
        features = self.drafter.features(target_hidden[:self._num_features])  # (B, T, H)
        plan = (None if read_len is None else
                attention_plan((batch, width), view, None, following.device, read_len=read_len))
        return self.drafter(following, features, positions, view, plan=plan)  # (B, T, H)

    def commit(self, first_row: int, hidden: torch.Tensor, counts: torch.Tensor,
               host_counts: Sequence[int] | np.ndarray) -> None:
        """Keeps counts[b] of the pairs `run` wrote for rows [first_row, first_row + B), and
        each row's last output of them (hidden (B, T, H))."""
        batch = hidden.shape[0]
        self.cache.rows(first_row, batch).commit(counts, host=host_counts)
        last = torch.arange(batch, device=hidden.device), (counts - 1).clamp(min=0)
        rows = slice(first_row, first_row + batch)
        self.last_hidden[rows] = torch.where((counts > 0)[:, None], hidden[last],
                                             self.last_hidden[rows])

    def follow(self, first_row: int, following: torch.Tensor,
               target_hidden: Sequence[torch.Tensor], counts: torch.Tensor,
               host_counts: Sequence[int] | np.ndarray) -> None:
        """Pairs committed without the drafter, for rows [first_row, first_row + B) (arguments
        as in extend): extended now or queued, by `sync`. Queued pairs cost no drafter pass
        until a flush, unless the backlog would overflow `backlog_capacity`."""
        batch, width = following.shape
        if self.sync == "eager":
            self.extend(first_row, following, target_hidden, counts, host_counts)
            return
        rows = slice(first_row, first_row + batch)
        if int(self._backlog_len_host[rows].max()) + width > self.backlog_capacity:
            self.flush(first_row + batch)
        features = torch.stack(tuple(target_hidden[:self._num_features]), dim=2)  # (B, T, F, H)
        if self._backlog_tokens is None:
            total, capacity = self.cache.shape.batch, self.backlog_capacity
            self._backlog_tokens = torch.zeros(total, capacity, dtype=torch.int64,
                                               device=following.device)
            self._backlog_features = features.new_zeros((total, capacity) + features.shape[2:])
        # row b's T columns go after its backlog; columns past counts[b] are padding that the
        # row's next pairs overwrite, and _backlog_len never counts
        columns = (self._backlog_len[rows, None]
                   + torch.arange(width, device=following.device)
                   ).clamp(max=self.backlog_capacity - 1)  # (B, T)
        row_index = torch.arange(first_row, first_row + batch,
                                 device=following.device)[:, None].expand(batch, width)
        self._backlog_tokens[row_index, columns] = following
        self._backlog_features[row_index, columns] = features
        self._backlog_len[rows] += counts
        self._backlog_len_host[rows] += np.asarray(host_counts, dtype=np.int64)

    def pending(self, batch: int) -> int:
        """The most queued pairs of any row in [0, batch): the width of the next flush."""
        return int(self._backlog_len_host[:batch].max()) if batch else 0

    def flush(self, batch: int) -> None:
        """The drafter catches up on the backlog of rows [0, batch): one pass over runs of
        consecutive rows, as few as fit. A pass writes its widest backlog's columns after
        every row's cached pairs, so rows whose cached pairs plus that width would overrun the
        cache (a row long caught up beside one whose whole prompt is queued) go in another."""
        queued = self._backlog_len_host[:batch]
        cached = self.cache.host_lengths[:batch]
        slots = self.cache.shape.max_len
        first = 0
        while first < batch:
            width, longest, last = 0, 0, first
            while last < batch and max(longest, cached[last]) + max(width, queued[last]) <= slots:
                width, longest = max(width, int(queued[last])), max(longest, int(cached[last]))
                last += 1
            last = max(last, first + 1)  # a row alone always fits: max_len bounds its pairs
            width = max(width, int(queued[first:last].max()))
            if width:
                rows = slice(first, last)
                features = self._backlog_features[rows, :width]  # (B, T, F, H)
                self.extend(first, self._backlog_tokens[rows, :width], features.unbind(dim=2),
                            self._backlog_len[rows], queued[rows].copy())
            first = last
        self._backlog_len[:batch] = 0
        self._backlog_len_host[:batch] = 0

    def move_row(self, source: int, target: int) -> None:
        """Row `source`'s state over row `target` (the engine moved its sample there)."""
        self.cache.move_row(source, target)
        if self._backlog_tokens is not None:
            self._backlog_tokens[target] = self._backlog_tokens[source]
            self._backlog_features[target] = self._backlog_features[source]
        self._backlog_len[target] = self._backlog_len[source]
        self._backlog_len_host[target] = self._backlog_len_host[source]
        self.last_hidden[target] = self.last_hidden[source]

    def free_row(self, row: int) -> None:
        self.cache.set_lengths(0, slice(row, row + 1))
        self._backlog_len[row] = 0
        self._backlog_len_host[row] = 0
