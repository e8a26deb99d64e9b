"""A step's one device-to-host read: everything the host loop needs from a step (emitted tokens,
their counts and log-probs) in one copy, so a step waits for the device once.

The tensors are packed into one float64 vector (token ids and counts are integers far below
2^53, float32 log-probs are exact in float64), copied through a pinned staging buffer on CUDA
(the copy then runs at full bandwidth and `tolist` reads host memory), and split back into
nested lists of the tensors' shapes.
"""

from __future__ import annotations

import math

import torch


class HostReader:
    def __init__(self, device: torch.device):
        self.device = device
        self._staging: torch.Tensor | None = None  # pinned float64, grown on demand

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """The tensors' values as nested Python lists (ints for integer tensors, floats
        otherwise), with one device-to-host copy for all of them."""
        sizes = [t.numel() for t in tensors]
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        if self.device.type == "cuda":
            total = flat.numel()
            if self._staging is None or self._staging.numel() < total:
                self._staging = torch.empty(max(total, 2 * (0 if self._staging is None else
                                                            self._staging.numel())),
                                            dtype=torch.float64, pin_memory=True)
            staged = self._staging[:total]
            staged.copy_(flat, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            values = staged.tolist()
        else:
            values = flat.tolist()
        out, start = [], 0
        for tensor, size in zip(tensors, sizes):
            part = values[start:start + size]
            start += size
            if not tensor.dtype.is_floating_point:
                part = [int(v) for v in part]
            out.append(_nest(part, tuple(tensor.shape)))
        return out


def _nest(flat: list, shape: tuple[int, ...]) -> list:
    if len(shape) <= 1:
        return flat
    step = math.prod(shape[1:])
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
