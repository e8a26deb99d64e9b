"""Per-row sampling state over the engine's cache rows: each row's root token, its sample's seed
and tokens generated so far (the Philox offset), and its sampling parameters, kept as tensors in
place so a step does not rebuild them from Python lists. Rows move with their samples.

min_tokens as positions: the logits at cache position p predict the token at p + 1, which the
sample holds as its (p + 1 - prompt length)-th generated token before it, so its stop ids are
masked at every position p < stops_from = prompt length + min_tokens - 1 (0: never).

Shapes: R cache rows, S = MAX_MASKED_STOP_IDS.
"""

from __future__ import annotations

import torch

from tlt_core.engine.records import MAX_MASKED_STOP_IDS, SamplingParams


class RowState:
    def __init__(self, rows: int, device: torch.device):
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,) the root token
        self.seed = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,)
        self.offset = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,) tokens generated
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)  # (R,)
        self.top_k = torch.zeros(rows, dtype=torch.int32, device=device)  # (R,)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)  # (R,)
        self.stops_from = torch.zeros(rows, dtype=torch.int64, device=device)  # (R,)
        # (R, S) the stop ids masked before stops_from, a row's first id repeated as padding
        self.masked_stops = torch.zeros(rows, MAX_MASKED_STOP_IDS, dtype=torch.int64,
                                        device=device)

    def admit(self, row: int, seed: int, params: SamplingParams, prompt_len: int) -> None:
        self.seed[row], self.offset[row] = seed, 0
        self.temperature[row], self.top_k[row], self.top_p[row] = (
            params.temperature, params.top_k, params.top_p)
        stops = sorted(set(params.stop_ids)) if params.min_tokens else []
        self.stops_from[row] = prompt_len + params.min_tokens - 1 if stops else 0
        padded = (stops + stops[:1] * MAX_MASKED_STOP_IDS)[:MAX_MASKED_STOP_IDS] if stops else 0
        self.masked_stops[row] = torch.tensor(padded)

    def advance(self, rows: slice, last: torch.Tensor, counts: torch.Tensor | int) -> None:
        """Each of `rows` committed counts (B,) tokens (or that many each), the last of them
        `last` (B,): its new root."""
        self.last[rows] = last
        self.offset[rows] += counts

    def move(self, source: int, target: int) -> None:
        for t in (self.last, self.seed, self.offset, self.temperature, self.top_k, self.top_p,
                  self.stops_from, self.masked_stops):
            t[target] = t[source]

    def sampling(self, rows: slice) -> dict:
        """The sampling kernels' per-row arguments for rows."""
        return dict(temperature=self.temperature[rows], top_k=self.top_k[rows],
                    top_p=self.top_p[rows], seed=self.seed[rows], offset=self.offset[rows])

    def mask_stops(self, logits: torch.Tensor, positions: torch.Tensor, rows: slice) -> None:
        """Sets logits (B, N, V) to -inf, in place, at each row's masked stop ids where its node
        positions (B, N) come before its stops_from. Fixed shapes, no host read: a captured
        graph holds it."""
        below = positions < self.stops_from[rows, None]  # (B, N)
        index = self.masked_stops[rows, None, :].expand(-1, logits.shape[1], -1)  # (B, N, S)
        kept = logits.gather(2, index).masked_fill_(below[..., None], float("-inf"))
        logits.scatter_(2, index, kept)
