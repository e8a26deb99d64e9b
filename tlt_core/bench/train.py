"""`tlt bench train`: GRPO end to end, TLT against SD off, side by side.

Three runs of the same config on the embedded task and model (or a checkpoint with its drafter
on arithmetic word problems, `--model DIR --drafter DIR`), stepped in turn (step k of each, then
step k + 1) so machine noise hits them alike: TLT (adaptive SD, seed s), SD off (seed s),
and SD off again with another seed (s + 1), whose reward curve against the first SD-off run is
the noise floor. Rows: per step and run, step time, rollout time, reward. Summary: `speedup`
(SD-off time / TLT time, summed over steps), `reward_gap` (mean |reward_TLT - reward_off| per
step) and `reward_noise` (the same between the two SD-off runs). SD is lossless, so TLT's rewards
differ from SD-off's only as much as two seeds' do (the samples differ; their distribution does
not).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from tlt_core.bench.model_workload import EMBEDDED_LABEL, ModelOptions
from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.embedded.workload import train_inputs
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.inputs import TrainInputs

RUNS = (("tlt", True, 0), ("off", False, 0), ("off_seed2", False, 1))


@dataclass(frozen=True)
class TrainOptions:
    """`tlt bench train`: the runs' length and sizes (None: TrainConfig's)."""
    json: Path | None = option("write rows + summary", None, metavar="FILE")
    steps: int = option("GRPO steps per run", 12)
    prompts_per_step: int | None = option("prompts per GRPO step (default: TrainConfig's)", None,
                                          metavar="N")
    samples_per_prompt: int | None = option("samples per prompt (default: TrainConfig's)", None,
                                            metavar="N")
    max_new_tokens: int | None = option("longest response (default: TrainConfig's)", None,
                                        metavar="N")
    sampled_drafts: bool = option("TLT's adaptive plans include sampled chains", False)
    no_progress: bool = option("no progress bars", False)


CLI_OPTIONS = (TrainOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench train`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


def run(config: TrainConfig = TrainConfig(steps=12), progress: bool = True,
        inputs: Callable[[], TrainInputs] | None = None, label: str = EMBEDDED_LABEL) -> dict:
    """inputs: builds one run's TrainInputs, called once per run so that each run trains its
    own copy of the policy and drafter (default: the embedded workload's)."""
    inputs_for_run = inputs or (lambda: train_inputs(progress=progress))
    drivers = {}
    for name, tlt, seed_offset in RUNS:
        inputs = inputs_for_run()
        drivers[name] = RLDriver(inputs.policy, inputs.prompts, inputs.reward_fn,
                                 inputs.detokenize, inputs.stop_ids,
                                 replace(config, tlt=tlt, seed=config.seed + seed_offset),
                                 drafter=inputs.drafter, calibration=inputs.calibration)
    rows = []
    bar = tqdm(total=config.steps * len(RUNS), disable=not progress, unit="step", desc="train")
    for _ in range(config.steps):
        for name, driver in drivers.items():
            m = driver.step()
            rows.append({"model": label, "run": name, "step": m["step"],
                         "step_s": m["step_s"],
                         "rollout_s": m["rollout_s"], "train_s": m["train_s"],
                         "reward": m["reward"], "acceptance_length": m["acceptance_length"],
                         **{key: m[key] for key in m if key.startswith("acceptance_length/")},
                         "sd_on_share": m["sd_on_share"], "logprob_gap": m["logprob_gap"],
                         "tokens": sum(m["response_lengths"])})
            bar.update()
    bar.close()
    return {"model": label, "config": asdict(config), "rows": rows,
            "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    def of(run, key):
        return [r[key] for r in sorted((r for r in rows if r["run"] == run),
                                       key=lambda r: r["step"])]

    def gap(a, b):
        return sum(abs(x - y) for x, y in zip(of(a, "reward"), of(b, "reward"))) / len(of(a, "reward"))

    time = {run: sum(of(run, "step_s")) for run, _, _ in RUNS}
    rollout = {run: sum(of(run, "rollout_s")) for run, _, _ in RUNS}
    return {"speedup": time["off"] / time["tlt"],
            "rollout_speedup": rollout["off"] / rollout["tlt"],
            "reward_gap": gap("tlt", "off"), "reward_noise": gap("off_seed2", "off"),
            "time_s": time, "rollout_s": rollout,
            "rollout_share_off": rollout["off"] / time["off"],
            "mean_reward": {run: sum(of(run, "reward")) / len(of(run, "reward"))
                            for run, _, _ in RUNS},
            "max_logprob_gap": max(r["logprob_gap"] for r in rows)}


def format_table(result: dict) -> str:
    lines = [f"model: {result.get('model', EMBEDDED_LABEL)}",
             f"{'step':>4}" + "".join(f"{run + ' s':>13}{'reward':>8}" for run, _, _ in RUNS)]
    steps = sorted({r["step"] for r in result["rows"]})
    for step in steps:
        cells = ""
        for run, _, _ in RUNS:
            r = next(x for x in result["rows"] if x["run"] == run and x["step"] == step)
            cells += f"{r['step_s']:>13.2f}{r['reward']:>8.3f}"
        lines.append(f"{step:>4}{cells}")
    s = result["summary"]
    lines.append(f"speedup {s['speedup']:.2f}x end to end ({s['rollout_speedup']:.2f}x on rollout; "
                 f"rollout is {100 * s['rollout_share_off']:.0f}% of an SD-off step); reward gap "
                 f"{s['reward_gap']:.3f} vs noise {s['reward_noise']:.3f}")
    return "\n".join(lines)
