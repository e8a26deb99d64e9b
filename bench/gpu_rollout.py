"""The GPU script's rollout stage: calibration, rollout benchmark and projection on one device.

    python bench/gpu_rollout.py OUT_DIR [--device cuda] [--rounds 2]

On the embedded model and drafter (shipped with the package). Writes
  OUT_DIR/calibration_<device>.json  the cost model (tlt_core.sim.load_calibration reads it)
  OUT_DIR/rollout_<device>.json      `tlt bench rollout` on this device (natural, trace and
                                     no_tail workloads), graph-pool study included
  OUT_DIR/projection_<device>.json   the simulator's 64-worker projection on this calibration
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from tlt_core.adaptive.policy import DEFAULT_PLANS
from tlt_core.bench import rollout as bench_rollout
from tlt_core.bench import simulate as bench_simulate
from tlt_core.adaptive.cost_model import calibrate
from tlt_core.embedded import CharTokenizer, TaskConfig, generate_problems, load_embedded
from tlt_core.engine import EngineConfig, RolloutEngine
from tlt_core.sim.simulator import save_calibration
from tlt_core.sim.traces import replay_requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    workload = load_embedded(progress=False)  # shipped: nothing to train on the GPU machine
    target, drafter = workload.target.to(device).eval(), workload.drafter.to(device).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = args.device.split(":")[0]
    args.out.mkdir(parents=True, exist_ok=True)

    # as `tlt bench simulate` calibrates: long prompts, forced 192-token responses
    engine = RolloutEngine(target, EngineConfig(max_batch=64, max_len=600), drafter)
    tokenizer = CharTokenizer()
    prompts = [tuple(tokenizer.prompt_ids(p.prompt)) for p in generate_problems(
        TaskConfig(seed=31, num_problems=4, min_steps=57, max_steps=63))]
    cost = calibrate(engine, DEFAULT_PLANS, (1, 2, 4, 8, 16, 32, 64),
                     replay_requests([192] * 4, prompts, group_size=1), max_tokens=192,
                     sd_off=True)
    save_calibration(cost, args.out / f"calibration_{tag}.json", name)

    workloads = bench_rollout.embedded_workloads(bench_rollout.WORKLOADS,
                                                 bench_rollout.RolloutOptions())
    result = bench_rollout.run(target, drafter, workloads, rounds=args.rounds, progress=False)
    result["graph_pool"] = bench_rollout.graph_pool_study(target, drafter, DEFAULT_PLANS, 64)
    (args.out / f"rollout_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(bench_rollout.format_table(result))

    projection = bench_simulate.project(cost, rollout_share=0.85)
    projection["cost_model"] = name
    (args.out / f"projection_{tag}.json").write_text(json.dumps(projection, indent=1) + "\n")
    print("PROJECTION (simulated, not measured):", projection)
    return 0


if __name__ == "__main__":
    sys.exit(main())
