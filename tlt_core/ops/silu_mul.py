"""`silu_mul`: a SwiGLU MLP's activation, silu(gate) * up from the fused gate|up projection, in
one kernel call (csrc/include/tlt/silu_mul.h).

PyTorch spends a split, a silu and a multiply on it (10 us a layer for SmolLM2 in bf16 at one
row on this project's CPUs); a decoding step of a small model runs 30 of them. One rounding to
the dtype where PyTorch's bf16 rounds twice: the values agree to the last bf16 place. CPU
tensors only: on a GPU the decode passes replay as CUDA graphs.
"""

from __future__ import annotations

import torch

from tlt_core import _C

_TYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}  # tlt::FloatType


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (R, 2 I) float32 or bfloat16 on the CPU, its rows dense (a row stride is fine) ->
    silu(gate_up[:, :I]) * gate_up[:, I:], (R, I) of its dtype, a new tensor."""
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2 \
            or gate_up.layout != torch.strided:
        raise ValueError(f"gate_up: expected a 2-D strided torch tensor (R, 2 I), got "
                         f"{_described(gate_up)}")
    if gate_up.dtype not in _TYPE_CODES or gate_up.device.type != "cpu":
        raise ValueError(f"gate_up: silu_mul runs on float32 or bfloat16 CPU tensors (on a GPU "
                         f"the passes are CUDA graphs), got {_described(gate_up)}")
    rows, columns = gate_up.shape
    if columns < 2 or columns % 2:
        raise ValueError(f"gate_up: needs an even width 2 I >= 2, got {columns}")
    if gate_up.stride(1) != 1 or rows > 1 and gate_up.stride(0) < columns:
        raise ValueError(f"gate_up: rows must be dense (call .contiguous() first), got "
                         f"{_described(gate_up)}")
    return launch(gate_up)


def launch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul without its checks, for arguments already known good (the packed pass's own
    gate|up product, 30 calls a decoding step)."""
    rows, columns = gate_up.shape
    out = torch.empty(rows, columns // 2, dtype=gate_up.dtype)
    _C.silu_mul(gate_up.data_ptr(), _TYPE_CODES[gate_up.dtype], rows, columns // 2,
                gate_up.stride(0) if rows > 1 else columns, out.data_ptr())
    return out


def _described(value) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.layout != torch.strided:
        return f"a {value.layout} tensor"
    return f"{tuple(value.shape)} {value.dtype} on {value.device} with strides {value.stride()}"
