"""The target's KV cache: one preallocated tensor, per-row committed lengths, a memory budget.

Layout: `data` is (L, 2, B, H_kv, T_max, head_dim) — layer, K/V, row, head, slot, channel — the
head-major layout `tlt_core.ops.compact_kv_` defaults to, so a layer's K (or V) is a contiguous
(B, H_kv, T_max, head_dim) view that attention reads directly.

Contract with the model: a forward pass over T new tokens of row b writes token i's K/V to slot
`lengths[b] + i` in every layer and never changes `lengths`. The engine decides what to keep and
commits it: `commit` after plain decoding, `compact` after a tree verification, `rollback` to
drop tokens, `set_lengths` to set rows outright. The cache knows nothing about tokens or models.

Host mirror: `host_lengths` holds the same lengths on the host (a NumPy array, SGLang's
`seq_lens_cpu`), so room checks and attention bounds never read the device. Every method here
keeps it; a caller that knows the counts it commits passes them (`host=`), else the method
reads them back once. Code that writes `lengths` directly must say so with `set_lengths`.

Its dtype (`cache_dtype`) is the weights' except for float16 weights on the CPU, whose cache is
float32 (the CPU's RoPE and attention kernels take float32 and bfloat16). A bf16 model's keys
and values are bf16 values (its projections and RoPE round to bf16), so a bf16 cache holds them
exactly, and the attention kernel (tlt_core.ops.attention) widens each element as it loads it:
the bits of a float32 cache, for half the memory and half the bytes each step reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

import tlt_core.ops as ops


# False: a float32 cache for bf16 weights on the CPU too (the same bits for twice the bytes: what
# bench/kv_cache_dtype.py compares)
BF16_CACHE_ON_CPU = True


def cache_dtype(weight_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache's dtype for weights of `weight_dtype` on `device` (module docstring)."""
    if torch.device(device).type == "cpu" and (
            weight_dtype == torch.float16
            or (weight_dtype == torch.bfloat16 and not BF16_CACHE_ON_CPU)):
        return torch.float32
    return weight_dtype


HostCounts = Union[int, Sequence[int], np.ndarray]  # per-row counts the caller knows on the host


def _host(values: HostCounts | torch.Tensor, count: int) -> np.ndarray:
    """(count,) int64 on the host; a tensor is read back (a host sync)."""
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    return np.broadcast_to(np.asarray(values, dtype=np.int64), (count,))


class CacheBudgetError(MemoryError):
    """The cache asked for more memory than the user's budget allows."""


@dataclass(frozen=True)
class CacheShape:
    num_layers: int  # L
    batch: int  # B rows (sequence slots)
    num_kv_heads: int  # H_kv
    max_len: int  # T_max token slots per row
    head_dim: int

    def __post_init__(self):
        for name in ("num_layers", "batch", "num_kv_heads", "max_len", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    def bytes(self, dtype: torch.dtype) -> int:
        elements = 2 * self.num_layers * self.batch * self.num_kv_heads * self.max_len * self.head_dim
        return elements * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Preallocated K/V for B rows of up to T_max tokens each."""

    def __init__(self, shape: CacheShape, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", budget_bytes: int | None = None):
        need = shape.bytes(dtype)
        if budget_bytes is not None and need > budget_bytes:
            raise CacheBudgetError(
                f"budget_bytes: a cache of {shape} in {dtype} needs {need:,} bytes, over the "
                f"budget of {budget_bytes:,} bytes; lower batch or max_len, or raise the budget")
        self.shape = shape
        self.data = torch.zeros(shape.num_layers, 2, shape.batch, shape.num_kv_heads,
                                shape.max_len, shape.head_dim, dtype=dtype, device=device)
        self.lengths = torch.zeros(shape.batch, dtype=torch.int64, device=device)  # (B,)
        self.host_lengths = np.zeros(shape.batch, dtype=np.int64)  # (B,) lengths' host mirror
        self._parent: KVCache | None = None  # set on rows() views
        self._start = 0

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each a (B, H_kv, T_max, head_dim) view."""
        return self.data[index, 0], self.data[index, 1]

    def longest(self) -> int:
        """The longest row's committed length (from the host mirror: no sync)."""
        return int(self.host_lengths.max())

    def check_room(self, new_tokens: HostCounts | torch.Tensor) -> None:
        """Raises ValueError if writing new_tokens[b] tokens (or that many each) after each
        row's prefix would overflow T_max. Host counts cost no device read."""
        end = self.host_lengths + _host(new_tokens, self.shape.batch)
        if (end > self.shape.max_len).any():
            row = int(np.flatnonzero(end > self.shape.max_len)[0])
            raise ValueError(
                f"max_len: row {row} would need {int(end[row])} cache slots, the cache has "
                f"{self.shape.max_len}; raise max_len (or the memory budget)")

    def commit(self, num_tokens: torch.Tensor, host: HostCounts | None = None) -> None:
        """Keeps the first num_tokens[b] tokens each row's last forward wrote (num_tokens (B,)
        on the device; host: the same counts on the host, if the caller knows them)."""
        counts = _host(num_tokens if host is None else host, self.shape.batch)
        self.check_room(counts)
        self.lengths += num_tokens.to(self.lengths)
        self.host_lengths += counts

    def compact(self, accept_index: torch.Tensor, num_accepted: torch.Tensor,
                host: HostCounts | None = None, *, validate: bool = True) -> None:
        """After a tree verification: move each row's accepted path (root included) to the
        slots after its prefix and commit it (num_accepted[b] + 1 tokens; host: num_accepted
        on the host, if the caller knows it). validate=False skips the kernel's row-status
        check (a host sync) for paths the verification kernel produced."""
        accepted = _host(num_accepted if host is None else host, self.shape.batch)
        if self._parent is None or self.data.is_contiguous():
            ops.compact_kv_(self.data, accept_index, num_accepted, self.lengths.to(torch.int32),
                            validate=validate)
        else:
            # A rows() view is not contiguous, which the kernel needs: compact the whole cache,
            # the other rows given the identity path (root slot 0 onto itself).
            parent, rows = self._parent, slice(self._start, self._start + self.shape.batch)
            full_index = torch.full((parent.shape.batch, accept_index.shape[1]), -1,
                                    dtype=torch.int32, device=self.device)
            full_index[:, 0] = 0
            full_index[rows] = accept_index
            full_accepted = torch.zeros(parent.shape.batch, dtype=torch.int32, device=self.device)
            full_accepted[rows] = num_accepted
            full_len = torch.zeros(parent.shape.batch, dtype=torch.int32, device=self.device)
            full_len[rows] = self.lengths
            ops.compact_kv_(parent.data, full_index, full_accepted, full_len, validate=validate)
        self.lengths += num_accepted.to(self.lengths) + 1
        self.host_lengths += accepted + 1

    def rollback(self, lengths: torch.Tensor) -> None:
        """Truncates rows to `lengths` (B,) tokens; a row can only shrink."""
        lengths = lengths.to(self.lengths)
        if bool((lengths < 0).any()) or bool((lengths > self.lengths).any()):
            raise ValueError("lengths: rollback can only shrink rows, to >= 0 tokens")
        self.lengths.copy_(lengths)
        self.host_lengths[:] = lengths.cpu().numpy()

    def set_lengths(self, lengths: HostCounts, rows: slice = slice(None)) -> None:
        """Sets rows' committed lengths outright (a new call, a freed row, a prefill), on the
        device and in the host mirror."""
        values = _host(lengths, len(range(*rows.indices(self.shape.batch))))
        if (values < 0).any() or (values > self.shape.max_len).any():
            raise ValueError(f"lengths: must be in [0, {self.shape.max_len}], got {values}")
        self.host_lengths[rows] = values
        self.lengths[rows] = torch.from_numpy(values.copy()).to(self.lengths.device)

    def rows(self, start: int, count: int) -> "KVCache":
        """A cache over rows [start, start + count) that shares this one's memory: what a
        forward over a contiguous block of running rows is given."""
        if not (0 <= start and count >= 1 and start + count <= self.shape.batch):
            raise ValueError(f"rows: [{start}, {start + count}) is outside the cache's "
                             f"{self.shape.batch} rows")
        view = object.__new__(KVCache)
        view.shape = CacheShape(self.shape.num_layers, count, self.shape.num_kv_heads,
                                self.shape.max_len, self.shape.head_dim)
        view.data = self.data[:, :, start:start + count]
        view.lengths = self.lengths[start:start + count]
        view.host_lengths = self.host_lengths[start:start + count]  # a view: shares the mirror
        view._parent, view._start = self, start
        if self._parent is not None:  # a view of a view: compact through the root cache
            view._parent, view._start = self._parent, self._start + start
        return view

    def move_row(self, source: int, target: int) -> None:
        """Copies row `source` (its slots up to its length, and the length) over row `target`:
        how the engine keeps running rows contiguous when one finishes."""
        length = int(self.host_lengths[source])
        self.data[:, :, target, :, :length] = self.data[:, :, source, :, :length]
        self.lengths[target] = self.lengths[source]
        self.host_lengths[target] = length
