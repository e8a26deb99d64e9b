"""Per-row sampling state over the engine's cache rows: each row's root token, its sample's seed
and tokens generated so far (the Philox offset), and its sampling parameters, kept as tensors in
place so a step does not rebuild them from Python lists. Rows move with their samples.

Shapes: R cache rows.
"""

from __future__ import annotations

import torch

from tlt_core.engine.records import SamplingParams


class RowState:
    def __init__(self, rows: int, device: torch.device):
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,) the root token
        self.seed = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,)
        self.offset = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,) tokens generated
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)  # (R,)
        self.top_k = torch.zeros(rows, dtype=torch.int32, device=device)  # (R,)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)  # (R,)

    def admit(self, row: int, seed: int, params: SamplingParams) -> None:
        self.seed[row], self.offset[row] = seed, 0
        self.temperature[row], self.top_k[row], self.top_p[row] = (
            params.temperature, params.top_k, params.top_p)

    def advance(self, rows: slice, last: torch.Tensor, counts: torch.Tensor | int) -> None:
        """Each of `rows` committed counts (B,) tokens (or that many each), the last of them
        `last` (B,): its new root."""
        self.last[rows] = last
        self.offset[rows] += counts

    def move(self, source: int, target: int) -> None:
        for t in (self.last, self.seed, self.offset, self.temperature, self.top_k, self.top_p):
            t[target] = t[source]

    def sampling(self, rows: slice) -> dict:
        """The sampling kernels' per-row arguments for rows."""
        return dict(temperature=self.temperature[rows], top_k=self.top_k[rows],
                    top_p=self.top_p[rows], seed=self.seed[rows], offset=self.offset[rows])
