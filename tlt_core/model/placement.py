"""Where a model runs and in which dtype: `--device auto|cpu|cuda`, `--dtype auto|float32|
bfloat16|float16`, resolved once and said out loud (`Placement.describe`).

auto device: CUDA when torch sees a GPU, else the CPU. Under torchrun a CUDA rank takes
`cuda:LOCAL_RANK`. auto dtype: bfloat16 on CUDA (float16 on GPUs without bf16); on the CPU
bfloat16 where the processor has native bf16 matrix instructions (AMX-BF16 or AVX512-BF16: on
this project's CPUs SmolLM2-135M decodes 1.4-2.3x faster in bf16 than in float32, batch 64 to
1, `tlt bench engine`), else float32.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names, best first


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    why: str  # how auto chose, or "as requested"

    def describe(self) -> str:
        return f"{self.device}, {str(self.dtype).removeprefix('torch.')} ({self.why})"


def cpu_bf16_flag(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The processor's native bf16 matrix instruction set (CPU_BF16_FLAGS), or None (also where
    the flags cannot be read: not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return next((flag for flag in CPU_BF16_FLAGS if flag in flags), None)


def resolve_placement(device: str = "auto", dtype: str = "auto") -> Placement:
    """The device and dtype for `--device` / `--dtype` (see the module docstring)."""
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {DEVICES}, got {device!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype: expected auto or one of {tuple(DTYPES)}, got {dtype!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for, but torch sees no CUDA device (a CPU "
                         "build of torch, or no driver); use --device cpu")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    chosen = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda
              else torch.device("cpu"))
    if dtype != "auto":
        return Placement(chosen, DTYPES[dtype], "as requested")
    if cuda:
        if torch.cuda.is_bf16_supported():
            return Placement(chosen, torch.bfloat16, "auto: bf16 on CUDA")
        return Placement(chosen, torch.float16, "auto: this GPU has no bf16, so float16")
    flag = cpu_bf16_flag()
    if flag is not None:
        return Placement(chosen, torch.bfloat16, f"auto: the CPU has native bf16 ({flag})")
    return Placement(chosen, torch.float32, "auto: the CPU has no native bf16 matrix unit")


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held since the last `reset_peak_memory`: CUDA's peak
    allocation on `device`, or on the CPU the peak resident set size (Linux's VmHWM, else the
    process's lifetime peak)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if os.uname().sysname == "Darwin" else 1024)  # macOS: bytes, Linux: KiB


def reset_peak_memory(device: torch.device) -> None:
    """Restart `peak_memory_bytes` from what the process holds now (where the system allows:
    CUDA, and Linux's clear_refs for the resident set)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
