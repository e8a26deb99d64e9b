"""When may this worker spot-train the drafter? The idle detector (C++ in csrc/idle_detector.cpp).

A worker is idle when its engine has no requests left and its accelerator is quiet (NVML
utilization at most `utilization_threshold` percent), both without a break for `idle_after_s`
seconds; it is busy again the moment work arrives. NVML is loaded at run time; where it is
missing (no GPU, no driver, a CPU machine) the detector says so once and decides on the engine's
signal alone.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

from tlt_core import _C

NVML_LIBRARY = "libnvidia-ml.so.1"
_warned: set[str] = set()  # NVML problems already reported in this process


class IdleDetector:
    def __init__(self, *, device_index: int = 0, utilization_threshold: float = 10.0,
                 idle_after_s: float = 0.5, nvml_library: str = NVML_LIBRARY,
                 clock: Callable[[], float] = time.monotonic):
        self._machine = _C.IdleStateMachine(utilization_threshold, idle_after_s)
        self._probe = _C.NvmlProbe(nvml_library)
        self._clock, self.device_index = clock, device_index
        if not self._probe.available and self._probe.error not in _warned:
            _warned.add(self._probe.error)
            warnings.warn(f"idle detector: NVML unavailable ({self._probe.error}); deciding on "
                          "the engine's signal alone", RuntimeWarning, stacklevel=2)
        elif self._probe.available and not 0 <= device_index < self._probe.device_count():
            raise ValueError(f"device_index: {device_index} is not one of NVML's "
                             f"{self._probe.device_count()} devices")

    @property
    def nvml_available(self) -> bool:
        return self._probe.available

    @property
    def idle(self) -> bool:
        return self._machine.idle

    @property
    def transitions(self) -> int:
        return self._machine.transitions

    def utilization(self) -> int:
        """The device's utilization percent now, or -1 without NVML."""
        return self._probe.utilization(self.device_index) if self._probe.available else -1

    def poll(self, engine_has_work: bool) -> bool:
        """Observe now (clock, NVML) and the engine's signal; True when the worker is idle."""
        return self._machine.update(self._clock(), self.utilization(), engine_has_work)

    def observe(self, now_s: float, utilization: float, engine_has_work: bool) -> bool:
        """One recorded observation (utilization < 0: unknown); True when idle. For replaying
        traces; poll() is the live path."""
        return self._machine.update(now_s, utilization, engine_has_work)
