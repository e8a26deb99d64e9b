"""Array plumbing for tlt_core.ops: accept torch tensors and any DLPack array (NumPy, CuPy),
check shapes / dtypes / devices / Python scalars with errors that name the argument, convert
to the dtypes the kernels read, and hand raw pointers to tlt_core._C. Knows nothing about what
the kernels compute.

Which checks run when:
  * dtypes, shapes, devices and Python scalars are always checked: that reads no tensor.
  * checks that read tensor values (the ranges below) run only with validate=True, because on a
    device tensor each is a host sync, and the engine's hot loop calls the ops with
    validate=False.
  * converting an integer tensor to a narrower dtype never wraps: with validate=True a value
    outside the target's range (or the argument's own range) raises; with validate=False the
    conversion saturates (one element-wise op, no sync, and none at all when the source dtype
    already fits), so an out-of-range value stays out of range and the kernel treats it as the
    invalid value it is instead of a valid one it happens to alias.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np
import torch

# A kind tells how to give results back: as torch tensors, NumPy arrays or CuPy arrays.
TORCH, NUMPY, CUPY = "torch", "numpy", "cupy"

_FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_REAL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Integer dtypes torch compares and clamps directly; the wider unsigned ones it only converts.
_COMPARABLE_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_INTEGER_DTYPES = _COMPARABLE_INTEGERS + (torch.uint16, torch.uint32, torch.uint64)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def array_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return TORCH
    module = type(value).__module__.split(".")[0]
    return CUPY if module == "cupy" else NUMPY if module == "numpy" else TORCH


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """A torch view of `value` (no copy for tensors, NumPy and DLPack arrays)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(value)
        except (TypeError, ValueError) as error:  # dtype, byte order or negative strides
            raise TypeError(f"{name}: this NumPy array cannot be viewed as a tensor "
                            f"({error})") from error
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


def is_array(value: Any) -> bool:
    """An array argument, as opposed to a Python or NumPy scalar."""
    return isinstance(value, (torch.Tensor, np.ndarray)) or (
        hasattr(value, "__dlpack__") and not isinstance(value, numbers.Number))


def python_int(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    """An int argument (Python or NumPy integer; never a bool) in [low, high] (None: unbounded)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}: must be in [{low}, {high}], got {value}")
    return value


def python_real(value: Any, name: str) -> float:
    """A real-number argument (int or float, Python or NumPy; never a bool or complex) as a
    float; ints too large for a float become +-inf, for the caller's range check to reject."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _integer_source(value: Any, name: str, shape: Sequence[int | None],
                    device: torch.device) -> torch.Tensor:
    tensor = as_tensor(value, name)
    if tensor.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name}: expected an integer dtype, got {tensor.dtype}")
    check_shape(tensor, name, shape)
    check_device(tensor, name, device)
    return tensor


def _comparable(tensor: torch.Tensor, name: str, validate: bool, low: int, high: int
                ) -> torch.Tensor:
    """The same values in a dtype torch can compare: uint16 / uint32 widened to int64 (exact);
    uint64 reinterpreted as int64, where values >= 2**63 turn negative: with validate they
    raise (outside [low, high] <= int64), otherwise they saturate to 2**63 - 1."""
    if tensor.dtype in _COMPARABLE_INTEGERS:
        return tensor
    if tensor.dtype != torch.uint64:
        return tensor.to(torch.int64)
    signed = tensor.view(torch.int64)
    huge = signed < 0
    if validate:
        if bool(huge.any()):
            _raise_out_of_range(name, low, high, int(signed[huge][0]) + (1 << 64))
        return signed
    return torch.where(huge, torch.full_like(signed, _INT64_MAX), signed)


def _raise_out_of_range(name: str, low: int, high: int, value: int) -> None:
    raise ValueError(f"{name}: every value must be in [{low}, {high}], got {value}")


def integer_tensor(value: Any, name: str, dtype: torch.dtype, device: torch.device,
                   shape: Sequence[int | None], *, validate: bool, low: int | None = None,
                   high: int | None = None, saturate: bool = False) -> torch.Tensor:
    """Small integer metadata as a contiguous `dtype` tensor: any integer dtype (bool not) is
    accepted and converted, a cheap copy. [low, high] (default: dtype's range, and never wider)
    is the argument's range, checked with validate; without, conversion saturates (module
    docstring). saturate: always saturate, never check, for an argument whose meaning is the
    same beyond dtype's range (top_k: every k <= 0 and every k >= V is "off")."""
    info = torch.iinfo(dtype)
    low = info.min if low is None else max(low, info.min)
    high = info.max if high is None else min(high, info.max)
    validate = validate and not saturate
    tensor = _comparable(_integer_source(value, name, shape, device), name, validate, low, high)
    source = torch.iinfo(tensor.dtype)
    if validate:
        if (low > source.min or high < source.max) and tensor.numel():
            outside = (tensor < low) | (tensor > high)
            if bool(outside.any()):
                _raise_out_of_range(name, low, high, int(tensor[outside][0]))
    elif info.min > source.min or info.max < source.max:
        tensor = tensor.clamp(info.min, info.max)
    return tensor.to(dtype).contiguous()


def bits64_tensor(value: Any, name: str, device: torch.device,
                  shape: Sequence[int | None]) -> torch.Tensor:
    """A 64-bit pattern per entry (Philox seeds and offsets, which random.h reads as uint64) as a
    contiguous int64 tensor: signed dtypes sign-extend, uint64 is reinterpreted bit for bit.
    Every value is valid, so nothing is read."""
    tensor = _integer_source(value, name, shape, device)
    if tensor.dtype == torch.uint64:
        return tensor.view(torch.int64).contiguous()
    return tensor.to(torch.int64).contiguous()


def per_row_integer(value: Any, name: str, dtype: torch.dtype, batch: int,
                    device: torch.device, *, validate: bool, saturate: bool = False
                    ) -> torch.Tensor:
    """A per-row integer parameter given as an int or a (B,) integer array, as `dtype`. Values
    outside dtype's range raise (ints always, arrays with validate) or, with saturate, are
    clamped into it (integer_tensor)."""
    if not is_array(value):
        info = torch.iinfo(dtype)
        if saturate:
            number = min(max(python_int(value, name), info.min), info.max)
        else:
            number = python_int(value, name, info.min, info.max)
        return torch.full((batch,), number, dtype=dtype, device=device)
    return integer_tensor(value, name, dtype, device, (batch,), validate=validate,
                          saturate=saturate)


def per_row_bits64(value: Any, name: str, batch: int, device: torch.device) -> torch.Tensor:
    """A per-row 64-bit pattern (bits64_tensor) given as an int in [-2**63, 2**64) or a (B,)
    integer array."""
    if not is_array(value):
        number = python_int(value, name, _INT64_MIN, (1 << 64) - 1)
        number = number - (1 << 64) if number > _INT64_MAX else number
        return torch.full((batch,), number, dtype=torch.int64, device=device)
    return bits64_tensor(value, name, device, (batch,))


def per_row_real(value: Any, name: str, batch: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | float]:
    """A per-row real parameter given as a number or a (B,) integer or float array:
    (the float32 (B,) tensor the kernel reads, the value as given: a float or the source
    array), so the caller can check values that float32 rounds (1e-300 to 0)."""
    if not is_array(value):
        number = python_real(value, name)
        with np.errstate(over="ignore"):
            rounded = float(np.float32(number))
        return torch.full((batch,), rounded, dtype=torch.float32, device=device), number
    tensor = as_tensor(value, name)
    if tensor.dtype not in _REAL_FLOATS + _INTEGER_DTYPES:
        raise TypeError(f"{name}: expected an integer or float dtype, got {tensor.dtype}")
    check_shape(tensor, name, (batch,))
    check_device(tensor, name, device)
    if tensor.dtype in _INTEGER_DTYPES and tensor.dtype not in _COMPARABLE_INTEGERS:
        tensor = tensor.to(torch.float64)  # uint16 / 32 / 64: comparable as float64
    return tensor.to(torch.float32).contiguous(), tensor


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
