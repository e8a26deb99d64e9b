"""Long-tail traces and a scale simulator: what a rollout of a given length distribution costs
on N workers, predicted from a calibrated cost model without running the model.

`traces.py` samples and loads response-length distributions and replays them through the
engine with forced lengths; `simulator.py` predicts makespan, idle worker time and end-to-end
speedup from a `tlt_core.adaptive.CostModel`, and saves / loads calibrations measured elsewhere.
"""

from tlt_core.sim.simulator import (Prediction, adaptive_plan, end_to_end_speedup,
                                    load_calibration, save_calibration, simulate)
from tlt_core.sim.traces import FAMILIES, load_lengths, replay_requests, sample_lengths, tail_stats

__all__ = ["FAMILIES", "Prediction", "adaptive_plan", "end_to_end_speedup", "load_calibration",
           "load_lengths", "replay_requests", "sample_lengths", "save_calibration", "simulate",
           "tail_stats"]
