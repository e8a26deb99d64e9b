"""The GPU script's rollout stage: calibration, rollout benchmark and projection on one device.

    python bench/gpu_rollout.py OUT_DIR [--device cuda] [--rounds 2]

Needs the warm embedded model and drafter in $TLT_CACHE_DIR (carry them: training them here
would not fit the GPU script's 8 minutes). Writes
  OUT_DIR/calibration_<device>.json  the cost model (tlt_core.simulator.load_calibration reads it)
  OUT_DIR/rollout_<device>.json      `tlt bench rollout` on this device, graph-pool study included
  OUT_DIR/projection_<device>.json   the simulator's 64-worker projection on this calibration
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from tlt_core.adaptive import DEFAULT_PLANS
from tlt_core.bench import rollout as bench_rollout
from tlt_core.bench import simulate as bench_simulate
from tlt_core.cost_model import calibrate
from tlt_core.drafter import Drafter
from tlt_core.drafter_training import DrafterWarmupConfig, drafter_folder
from tlt_core.embedded import EMBEDDED_MODEL_CONFIG
from tlt_core.engine import EngineConfig, RolloutEngine
from tlt_core.simulator import save_calibration
from tlt_core.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.traces import replay_requests
from tlt_core.warmup import WarmupConfig, cache_dir, load_or_train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = cache_dir(WarmupConfig(), EMBEDDED_MODEL_CONFIG)
    drafter_path = drafter_folder(folder, DrafterWarmupConfig())
    if not (folder / "warmup_report.json").is_file() or not drafter_path.is_dir():
        print(f"gpu_rollout: no warm model and drafter under {folder}; carry $TLT_CACHE_DIR "
              "(skipping the rollout stage)", file=sys.stderr)
        return 0
    device = torch.device(args.device)
    target = load_or_train(progress=False)[0].to(device).eval()
    drafter = Drafter.load(drafter_path, target).eval()
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

    result = bench_rollout.run(target, drafter, rounds=args.rounds, progress=False)
    (args.out / f"rollout_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(bench_rollout.format_table(result))

    projection = bench_simulate.project(cost, rollout_share=0.85)
    projection["cost_model"] = name
    (args.out / f"projection_{tag}.json").write_text(json.dumps(projection, indent=1) + "\n")
    print("PROJECTION (simulated, not measured):", projection)
    return 0


if __name__ == "__main__":
    sys.exit(main())
