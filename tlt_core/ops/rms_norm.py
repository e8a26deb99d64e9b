"""`add_rms_norm`: a bf16 decoder layer's residual add and RMSNorm in one kernel call
(csrc/include/tlt/rms_norm.h).

PyTorch spends four ops on a bf16 RMSNorm (widen, rms_norm, narrow, scale by the weight: 19 us
at one row of SmolLM2's 576 on this project's CPUs) and one more on the residual add before it;
a decoding step of a small model runs 60 of them. CPU tensors only: on a GPU the decode passes
replay as CUDA graphs, which remove that cost already. bfloat16 only: a float32 model keeps
PyTorch's op, whose sum the training pass shares bit for bit.
"""

from __future__ import annotations

import torch

from tlt_core import _C
from tlt_core.ops._cpu_tensors import check_cpu_matrix


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for h, delta (R, H) and weight (H,): contiguous
    CPU bfloat16 tensors (delta None: no add; the first tensor is then h itself). New tensors;
    the inputs are not written. The math and its rounding are rms_norm.h's: transformers'
    LlamaRMSNorm up to the last bfloat16 place."""
    _check(h, "h", None)
    rows, hidden = h.shape
    if delta is not None:
        _check(delta, "delta", (rows, hidden))
    _check(weight, "weight", (hidden,))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")
    return launch(h, delta, weight, eps)


def launch(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm without its checks, for arguments already known good (add_rms_norm's after
    checking them; the packed pass's own activations and a layer's norm, whose every call a
    check would cost ~10 us, 60 calls a decoding step)."""
    rows, hidden = h.shape
    h_out = h if delta is None else torch.empty_like(h)
    normed = torch.empty_like(h)
    _C.add_rms_norm_bf16(h.data_ptr(), 0 if delta is None else delta.data_ptr(),
                         weight.data_ptr(), rows, hidden, float(eps), h_out.data_ptr(),
                         normed.data_ptr())
    return h_out, normed


def _check(tensor, name: str, shape: tuple[int, ...] | None) -> None:
    check_cpu_matrix(tensor, name, torch.bfloat16, shape, columns="hidden")
