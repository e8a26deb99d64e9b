"""The idle detector: its state machine on traces, the run-time NVML loader, the Python
wrapper's fallback to the engine's signal."""

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from tlt_core import _C
from tlt_core.workers.idle import IdleDetector

# bench/gpu_check.sh records a trace and points TLT_NVML_TRACE at it; one is kept in tests/data.
RECORDED = Path(os.environ.get("TLT_NVML_TRACE",
                               Path(__file__).parent / "data" / "nvml_trace_h200.json"))


def replay(trace, threshold=10.0, idle_after=0.5):
    """States after each (t, utilization, engine_has_work) observation."""
    machine = _C.IdleStateMachine(threshold, idle_after)
    return [machine.update(t, u, w) for t, u, w in trace], machine


def rollout_worker_trace():
    """A worker decoding until t = 2.0 (utilization ~90% with dips to 4% between steps),
    then done: the device drains and idles; new work arrives at t = 3.2."""
    trace = []
    for i in range(200):  # 10 ms samples
        t = i * 0.01
        trace.append((t, 4.0 if i % 10 == 9 else 90.0, True))
    for i in range(120):
        t = 2.0 + i * 0.01
        trace.append((t, 40.0 if i < 5 else 2.0, False))  # 50 ms of draining kernels
    trace.append((3.2, 2.0, True))
    return trace


def test_busy_decoding_with_dips_never_looks_idle():
    states, machine = replay(rollout_worker_trace())
    assert not any(states[:200])  # dips between decode steps are not idleness
    first_idle = next(i for i, s in enumerate(states) if s)
    # quiet from t = 2.05 (draining ends), idle 0.5 s later
    assert rollout_worker_trace()[first_idle][0] == pytest.approx(2.55)
    assert states[-2] and not states[-1]  # work arriving preempts at once
    assert machine.transitions == 2 and machine.last_change_s == pytest.approx(3.2)


def test_a_utilization_spike_restarts_the_quiet_period():
    trace = [(t / 10, 1.0, False) for t in range(4)] + [(0.4, 80.0, False)]
    trace += [(0.4 + t / 10, 1.0, False) for t in range(1, 8)]
    states, _ = replay(trace)
    first_idle = next(i for i, s in enumerate(states) if s)
    assert trace[first_idle][0] == pytest.approx(1.0)  # 0.5 s after the spike, not after t = 0


def test_without_nvml_the_engine_signal_decides():
    trace = [(0.0, -1, True), (0.1, -1, False), (0.5, -1, False), (0.6, -1, False),
             (0.7, -1, True)]
    states, _ = replay(trace)
    assert states == [False, False, False, True, False]


def test_idle_after_zero_and_an_idle_device_with_work():
    states, _ = replay([(0.0, 0.0, False), (0.1, 0.0, True)], idle_after=0.0)
    assert states == [True, False]


def test_bad_state_machine_input_names_the_argument():
    with pytest.raises(ValueError, match="utilization_threshold"):
        _C.IdleStateMachine(-1.0, 0.5)
    with pytest.raises(ValueError, match="idle_after_s"):
        _C.IdleStateMachine(10.0, float("nan"))
    machine = _C.IdleStateMachine(10.0, 0.5)
    machine.update(1.0, 0.0, False)
    with pytest.raises(ValueError, match="now_s"):
        machine.update(0.5, 0.0, False)


def test_nvml_loader_handles_a_missing_library():
    probe = _C.NvmlProbe("libnvidia-ml-does-not-exist.so.1")
    assert not probe.available and "libnvidia-ml-does-not-exist" in probe.error
    assert probe.device_count() == 0 and probe.utilization(0) == -1


def test_detector_warns_once_and_falls_back_to_the_engine_signal(caplog):
    now = [0.0]
    library = "libnvidia-ml-missing-for-this-test.so"
    with caplog.at_level(logging.WARNING, logger="tlt_core"):
        detector = IdleDetector(nvml_library=library, idle_after_s=0.2, clock=lambda: now[0])
        IdleDetector(nvml_library=library)  # the second detector stays silent
    assert [(r.name, r.levelno) for r in caplog.records] == \
        [("tlt_core.workers.idle", logging.WARNING)]
    assert "engine's signal alone" in caplog.records[0].getMessage()
    assert not detector.nvml_available and detector.utilization() == -1
    assert not detector.poll(engine_has_work=False)
    now[0] = 0.25
    assert detector.poll(engine_has_work=False) and detector.idle
    now[0] = 0.3
    assert not detector.poll(engine_has_work=True) and detector.transitions == 2


@pytest.mark.skipif(not RECORDED.is_file(), reason="no recorded NVML trace")
def test_recorded_h200_trace():
    """A trace recorded on an H200 (bench/record_nvml_trace.py): NVML utilization sampled every
    20 ms while a stand-in worker ran 1.5 s bursts of matmuls separated by 3 s idle gaps. NVML
    averages over its sample period, so utilization lags the work by a few hundred ms (99% ->
    30% -> 0% here). In every gap the detector turns idle exactly idle_after_s after the first
    quiet sample, stays idle to the gap's end, and is busy whenever work runs."""
    record = json.loads(RECORDED.read_text())
    trace = [(t, u, w) for t, u, w in record["samples"]]
    threshold, idle_after = record["threshold"], record["idle_after_s"]
    states, machine = replay(trace, threshold, idle_after)
    for start, end in record["idle_gaps"]:  # the engine had no work in [start, end)
        gap = [(t, u, s) for (t, u, _), s in zip(trace, states) if start <= t < end]
        quiet_from = next(t for t, u, _ in gap if u <= threshold)
        assert quiet_from - start < 1.0  # NVML's sample period is at most 1 s
        onset = next(t for t, _, s in gap if s)
        assert onset - quiet_from == pytest.approx(idle_after, abs=0.025)  # one 20 ms sample
        assert all(s for t, _, s in gap if t >= onset)
    assert not any(s for (_, _, work), s in zip(trace, states) if work)
    assert machine.transitions == 2 * len(record["idle_gaps"]) - 1  # it ends in the last gap


@pytest.mark.gpu
def test_nvml_on_a_real_gpu_agrees_with_nvidia_ml_py():
    probe = _C.NvmlProbe()
    if not probe.available:
        pytest.skip(f"NVML unavailable: {probe.error}")
    assert probe.device_count() >= 1
    assert 0 <= probe.utilization(0) <= 100
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == probe.device_count()


class _SlowProbe:
    """An NVML stand-in whose utilization read lets other threads run, as the real probe does
    (it releases the GIL)."""

    available = True
    error = ""

    def device_count(self):
        return 1

    def utilization(self, index):
        time.sleep(0.0005)
        return 0


def test_concurrent_polls_never_go_back_in_time():
    detector = IdleDetector(nvml_library="libnvidia-ml-missing-for-thread-test.so",
                            idle_after_s=0.0)
    detector._probe = _SlowProbe()
    errors = []

    def hammer(has_work):
        try:
            for _ in range(200):
                detector.poll(engine_has_work=has_work)
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(i % 2 == 0,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert detector.poll(engine_has_work=True) is False and not detector.idle


def test_bad_input_gets_a_clear_error_device_index_is_an_int():
    for value in (1.0, True, "0"):
        with pytest.raises(TypeError, match="device_index"):
            IdleDetector(device_index=value)
