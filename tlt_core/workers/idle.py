"""When may this worker spot-train the drafter? The idle detector (C++ in csrc/idle_detector.cpp).

A worker is idle when its engine has no requests left and its accelerator is quiet (NVML
utilization at most `utilization_threshold` percent), both without a break for `idle_after_s`
seconds; it is busy again the moment work arrives. NVML is loaded at run time; where it is
missing (no GPU, no driver, a CPU machine) the detector says so once and decides on the engine's
signal alone.

The device is found by UUID: NVML numbers every GPU on the machine, CUDA only the visible ones
(CUDA_VISIBLE_DEVICES, one GPU per rank under torchrun), so CUDA's index 0 is often not NVML's.
By default the detector watches torch's current CUDA device, matched through its UUID.

Threads may share a detector: the NVML read releases the GIL, so the clock read and the state
update that follow it are made under one lock, keeping observation times non-decreasing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from tlt_core import _C

logger = logging.getLogger(__name__)

NVML_LIBRARY = "libnvidia-ml.so.1"
_warned: set[str] = set()  # NVML problems already reported in this process


class IdleDetector:
    def __init__(self, *, device: torch.device | str | None = None,
                 device_index: int | None = None, utilization_threshold: float = 10.0,
                 idle_after_s: float = 0.5, nvml_library: str = NVML_LIBRARY,
                 clock: Callable[[], float] = time.monotonic):
        """device: the CUDA device to watch (default torch's current one), found in NVML by
        UUID; device_index: an NVML index instead (a machine-wide number)."""
        if device_index is not None and (isinstance(device_index, bool)
                                         or not isinstance(device_index, int)):
            raise TypeError(f"device_index: must be an int or None, got "
                            f"{type(device_index).__name__} {device_index!r}")
        self._machine = _C.IdleStateMachine(utilization_threshold, idle_after_s)
        self._probe = _C.NvmlProbe(nvml_library)
        self._clock = clock
        self._lock = threading.Lock()  # the state machine and the clock read that feeds it
        if not self._probe.available and self._probe.error not in _warned:
            _warned.add(self._probe.error)
            # a logged warning, not warnings.warn: the machine, not the caller, lacks NVML
            logger.warning("idle detector: NVML unavailable (%s); deciding on the engine's "
                           "signal alone", self._probe.error)
        if device_index is None:
            device_index = self._nvml_index(device) if self._probe.available else 0
        self.device_index = device_index
        if self._probe.available and not 0 <= device_index < self._probe.device_count():
            raise ValueError(f"device_index: {device_index} is not one of NVML's "
                             f"{self._probe.device_count()} devices")

    def _nvml_index(self, device: torch.device | str | None) -> int:
        if device is None and not torch.cuda.is_available():
            return 0  # no CUDA device torch can see: NVML's first, as nvidia-smi shows it
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device: the idle detector watches a CUDA device, got {device}")
        uuid = nvml_uuid(device)
        index = self._probe.index_of_uuid(uuid)
        if index < 0:
            raise ValueError(f"device: NVML has no device with {device}'s UUID {uuid}")
        return index

    @property
    def nvml_available(self) -> bool:
        return self._probe.available

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._machine.idle

    @property
    def transitions(self) -> int:
        with self._lock:
            return self._machine.transitions

    def utilization(self) -> int:
        """The device's utilization percent now, or -1 without NVML."""
        return self._probe.utilization(self.device_index) if self._probe.available else -1

    def poll(self, engine_has_work: bool) -> bool:
        """Observe now (clock, NVML) and the engine's signal; True when the worker is idle."""
        utilization = self.utilization()  # outside the lock: NVML may take a while
        with self._lock:
            return self._machine.update(self._clock(), utilization, engine_has_work)

    def observe(self, now_s: float, utilization: float, engine_has_work: bool) -> bool:
        """One recorded observation (utilization < 0: unknown); True when idle. For replaying
        traces; poll() is the live path."""
        with self._lock:
            return self._machine.update(now_s, utilization, engine_has_work)


def nvml_uuid(device: torch.device) -> str:
    """NVML's name for a CUDA device: "GPU-" and the UUID torch reports."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
