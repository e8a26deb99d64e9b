"""Record an NVML utilization trace on a GPU for the idle detector's replay test.

Usage: python bench/record_nvml_trace.py OUT.json

A stand-in worker alternates bursts of GPU work (back-to-back matmuls, the "engine has work"
phase) with idle gaps, while tlt_core's own NVML probe samples utilization every 20 ms. The
file holds the samples (t, utilization, engine_has_work), the gaps, and the detector settings
the test replays them with.
"""

import json
import sys
import time

import torch

from tlt_core import _C

BURST_S, GAP_S, CYCLES, PERIOD_S = 1.5, 3.0, 3, 0.02


def main(out: str) -> None:
    probe = _C.NvmlProbe()
    if not probe.available or not torch.cuda.is_available():
        sys.exit(f"needs a GPU and NVML ({probe.error})")
    a = torch.randn(4096, 4096, device="cuda")
    samples, gaps, start = [], [], time.monotonic()
    for _ in range(CYCLES):
        burst_end = time.monotonic() + BURST_S
        while time.monotonic() < burst_end:
            for _ in range(4):
                a = torch.tanh(a @ a * 1e-3)  # keep the device busy
            torch.cuda.synchronize()
            samples.append((time.monotonic() - start, probe.utilization(0), True))
        gap_start = time.monotonic() - start
        gap_end = time.monotonic() + GAP_S
        while time.monotonic() < gap_end:
            time.sleep(PERIOD_S)
            samples.append((time.monotonic() - start, probe.utilization(0), False))
        gaps.append((gap_start, time.monotonic() - start))
    record = {"device": torch.cuda.get_device_name(0), "threshold": 10.0, "idle_after_s": 0.5,
              "period_s": PERIOD_S, "idle_gaps": gaps, "samples": samples}
    with open(out, "w") as f:
        json.dump(record, f)
    print(f"wrote {len(samples)} samples to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
