"""Array plumbing for tlt_core.ops: accept torch tensors and any DLPack array (NumPy, CuPy),
check shapes / dtypes / devices with errors that name the argument, and hand raw pointers to
tlt_core._C. Knows nothing about what the kernels compute."""

from __future__ import annotations

from typing import Any, Sequence

import torch

# A kind tells how to give results back: as torch tensors, NumPy arrays or CuPy arrays.
TORCH, NUMPY, CUPY = "torch", "numpy", "cupy"

_FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def array_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return TORCH
    module = type(value).__module__.split(".")[0]
    return CUPY if module == "cupy" else NUMPY if module == "numpy" else TORCH


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """A torch view of `value` (no copy for tensors, NumPy and DLPack arrays)."""
    if isinstance(value, torch.Tensor):
        return value
    if type(value).__module__.split(".")[0] == "numpy":
        return torch.from_numpy(value)
    if hasattr(value, "__dlpack__"):
        try:
            return torch.from_dlpack(value)
        except Exception as error:  # noqa: BLE001 - re-raised with the argument's name
            raise TypeError(f"{name}: cannot be viewed through DLPack ({error})") from error
    raise TypeError(
        f"{name}: expected a torch tensor or an array with __dlpack__ (NumPy, CuPy), "
        f"got {type(value).__name__}"
    )


def give_back(tensor: torch.Tensor, kind: str) -> Any:
    if kind == NUMPY:
        return tensor.cpu().numpy()
    if kind == CUPY:
        import cupy

        return cupy.from_dlpack(tensor)
    return tensor


def check_shape(tensor: torch.Tensor, name: str, shape: Sequence[int | None]) -> None:
    """shape entries of None match any size."""
    ok = tensor.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(tensor.shape, shape)
    )
    if not ok:
        pretty = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name}: expected shape {pretty}, got {tuple(tensor.shape)}")


def check_device(tensor: torch.Tensor, name: str, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name}: is on {tensor.device}, expected {device} like the other inputs")


def float_type_code(tensor: torch.Tensor, name: str) -> int:
    if tensor.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{name}: dtype must be float32, float16 or bfloat16, got {tensor.dtype}")
    return _FLOAT_TYPES[tensor.dtype]


def require_contiguous(tensor: torch.Tensor, name: str) -> None:
    # Large inputs are never copied behind the caller's back.
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() first)")


def integer_tensor(value: Any, name: str, dtype: torch.dtype, device: torch.device,
                   shape: Sequence[int | None]) -> torch.Tensor:
    """Small integer metadata: any integer dtype is accepted and converted (a cheap copy)."""
    tensor = as_tensor(value, name)
    if tensor.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name}: expected an integer dtype, got {tensor.dtype}")
    check_shape(tensor, name, shape)
    check_device(tensor, name, device)
    return tensor.to(dtype).contiguous()


def per_row(value: Any, name: str, dtype: torch.dtype, batch: int,
            device: torch.device) -> torch.Tensor:
    """A per-row parameter given as a Python number or a (B,) array."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=dtype, device=device)
    tensor = as_tensor(value, name)
    check_shape(tensor, name, (batch,))
    check_device(tensor, name, device)
    if not dtype.is_floating_point and tensor.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name}: expected an integer dtype, got {tensor.dtype}")
    return tensor.to(dtype).contiguous()


def launch_target(device: torch.device) -> tuple[int, int]:
    """(device index, stream handle) for tlt_core._C: (-1, 0) is the host."""
    if device.type == "cpu":
        return -1, 0
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return index, torch.cuda.current_stream(index).cuda_stream
    raise ValueError(f"unsupported device {device}: tlt_core kernels run on cpu and cuda")


def ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()
