"""The argument checks of the CPU-only ops that take torch tensors (add_rms_norm, panel_matmul,
silu_mul, and what rope_kv_write and decode_attention name): type, dtype, device, layout and
shape, each failure a message that starts with the argument's name."""

from __future__ import annotations

import torch

# The float types the CPU kernels take, as tlt::FloatType codes
FLOAT_TYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}


def isa_code(isa) -> int:
    """A CPU kernel's `isa` argument as its headers take it: 0 for "auto" (the fastest this CPU
    runs), 1 for "portable" (the scalar loops)."""
    if isa not in ("auto", "portable"):
        raise ValueError(f"isa: expected one of ['auto', 'portable'], got {isa!r}")
    return 0 if isa == "auto" else 1


def check_cpu_matrix(tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None, *,
                     columns: str, rows_strided: bool = False) -> None:
    """`tensor` must be a CPU `dtype` tensor of `shape` (None: any (rows, columns) with columns
    >= 1), contiguous, or with rows_strided only its rows dense (a row stride >= its length)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name}: expected a strided (dense) tensor, got {described(tensor)}")
    if rows_strided and tensor.dim() == 2:
        dense = tensor.stride(1) == 1 and (tensor.shape[0] <= 1
                                           or tensor.stride(0) >= tensor.shape[1])
    else:
        dense = tensor.is_contiguous()
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not dense:
        kind = str(dtype).removeprefix("torch.")
        what = (f"a CPU {kind} tensor with contiguous rows" if rows_strided
                else f"a contiguous CPU {kind} tensor")
        raise ValueError(f"{name}: expected {what}, got {tuple(tensor.shape)} {tensor.dtype} "
                         f"on {tensor.device}" + ("" if dense else " (not contiguous)"))
    if shape is None:
        if tensor.dim() != 2 or tensor.shape[1] < 1:
            raise ValueError(f"{name}: expected (rows, {columns}) with {columns} >= 1, got "
                             f"{tuple(tensor.shape)}")
    elif tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")


def described(value) -> str:
    """What an argument is, for an error message: its shape, dtype, device and strides."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.layout != torch.strided:
        return f"a {value.layout} tensor"
    return f"{tuple(value.shape)} {value.dtype} on {value.device} with strides {value.stride()}"
