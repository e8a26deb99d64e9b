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
from tlt_core.ops._cpu_tensors import FLOAT_TYPE_CODES, check_cpu_matrix


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (R, 2 I) float32 or bfloat16 on the CPU, its rows dense (a row stride is fine) ->
    silu(gate_up[:, :I]) * gate_up[:, I:], (R, I) of its dtype, a new tensor."""
    dtype = gate_up.dtype if isinstance(gate_up, torch.Tensor) else torch.float32
    if dtype not in FLOAT_TYPE_CODES:
        raise ValueError(f"gate_up: expected a float32 or bfloat16 tensor, got {dtype}")
    check_cpu_matrix(gate_up, "gate_up", dtype, None, columns="2 I", rows_strided=True)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: needs an even width 2 I, got {gate_up.shape[1]}")
    return launch(gate_up)


def launch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul without its checks, for arguments already known good (the packed pass's own
    gate|up product, 30 calls a decoding step)."""
    rows, columns = gate_up.shape
    out = torch.empty(rows, columns // 2, dtype=gate_up.dtype)
    _C.silu_mul(gate_up.data_ptr(), FLOAT_TYPE_CODES[gate_up.dtype], rows, columns // 2,
                gate_up.stride(0) if rows > 1 else columns, out.data_ptr())
    return out
