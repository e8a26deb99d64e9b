"""`tlt bench train`: GRPO end to end, TLT against SD off, side by side.

Three runs of the same config on the embedded task and model (or a checkpoint with its drafter
on arithmetic word problems, `--model DIR --drafter DIR`), stepped in turn (step k of each, then
step k + 1) so machine noise hits them alike: TLT (adaptive SD, seed s), SD off (seed s),
and SD off again with another seed (s + 1), whose numbers against the first SD-off run are the
noise floor.

Workloads (`--workload`):
- natural: each response ends at the model's stop ids or max_new_tokens, as `tlt train` rolls
  out;
- trace: each sample decodes to exactly a length drawn from a long-tailed distribution
  (tlt_core.bench.length_trace: a lognormal, p99 10.2x the median at sigma 1, or the lengths of
  `--trace-file`), capped at max_new_tokens, its stop ids masked up to it (so it stays a
  response): a forced output length, as vLLM's benchmarks fix one, through the driver's
  `forced_lengths`. Sample j of the k-th prompt of step s takes entry (s x prompts_per_step +
  k) x samples_per_prompt + j of the lengths (`TraceLengths`), so all three runs decode the
  same lengths at the same (step, prompt, sample), and the runs differ by their step rates
  alone.

The adaptive loop calibrates when the TLT run starts; its seconds count in TLT's step 0
(`calibration_s`, inside that step's step_s and rollout_s). With `--calibration-cache` a
calibration an earlier run stored is read instead (`calibration_cached` in the rows), and
step 0 pays the reading.

Rows, per step and run: step_s, rollout_s, train_s, calibration_s, reward, acceptance, `tokens`
(response tokens committed in the step, every rank's, stop tokens included), `tok_s` (tokens /
step_s) and `rollout_tok_s` (tokens / rollout_s), the step's `response_lengths` and its rollout's
`step_trace` (rank 0's decode steps: TRACE_COLUMNS, one row per step).

Summary, each rate summed over the steps (total tokens / total seconds):
- `speedup_per_token`: TLT's tok_s over SD off's, and `rollout_speedup_per_token` the same on
  the rollout; runs that sample different lengths (natural) compare fairly only per token;
- `noise_per_token` / `rollout_noise_per_token`: SD off reseeded over SD off, the same ratios
  between two runs that differ by seed alone: a speedup is real only as far as it stands out
  from their distance to 1;
- `speedup_per_token_after_calibration`: the per-token ratio with TLT's calibration seconds
  left out: what a run long enough to amortise them would see, or one reading its calibration
  from a cache;
- `speedup` / `rollout_speedup`: per-step time ratios, SD-off time over TLT time for the same
  steps (equal to the per-token ratios when the runs decode the same tokens);
- `reward_gap` (mean |reward_TLT - reward_off| per step) and `reward_noise` (the same between
  the two SD-off runs). SD is lossless, so TLT's rewards differ from SD-off's only as much as
  two seeds' do (the samples differ; their distribution does not).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from tlt_core.bench.length_trace import TraceOptions, tail_shape
from tlt_core.bench.model_workload import EMBEDDED_LABEL, ModelOptions
from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.embedded.workload import train_inputs
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.inputs import TrainInputs

RUNS = (("tlt", True, 0), ("off", False, 0), ("off_seed2", False, 1))
WORKLOADS = ("natural", "trace")
TRACE_COLUMNS = ("round", "step", "batch", "context", "arm", "emitted", "seconds", "catch_up_s")
TRACE_SEED = 0  # the lognormal's draws: one set for all three runs


@dataclass(frozen=True)
class TrainOptions(TraceOptions):
    """`tlt bench train`: the workload, the trace's lengths, the runs' length and sizes (None:
    TrainConfig's)."""
    json: Path | None = option("write rows + summary (with each step's response lengths and "
                               "step trace)", None, metavar="FILE")
    workload: str = option("natural: each response ends at the model's stop ids or "
                           "--max-new-tokens; trace: each sample decodes to exactly a length "
                           "drawn from a long-tailed distribution (the lognormal of "
                           "--trace-median / --trace-sigma, or --trace-file), capped at "
                           "--max-new-tokens, its stop ids masked up to it, the same lengths in "
                           "every run", "natural", choices=WORKLOADS)
    steps: int = option("GRPO steps per run", 12)
    prompts_per_step: int | None = option("prompts per GRPO step (default: TrainConfig's)", None,
                                          metavar="N")
    samples_per_prompt: int | None = option("samples per prompt (default: TrainConfig's)", None,
                                            metavar="N")
    max_new_tokens: int | None = option("longest response (default: TrainConfig's)", None,
                                        metavar="N")
    max_batch: int | None = option("engine rows of each run (default: TrainConfig's); the three "
                                   "runs hold their KV caches at once, so long responses may "
                                   "need fewer rows to fit in memory", None, metavar="N")
    lr: float | None = option("AdamW learning rate of each run (default: TrainConfig's 2e-4, "
                              "which suits the embedded model; a pre-trained LLM wants about "
                              "1e-6 to 1e-5, and a faster-moving policy leaves its drafter "
                              "behind sooner)", None, metavar="LR")
    sampled_drafts: bool = option("TLT's adaptive plans are sampled chains (at T > 0)", False)
    plans_from: Path | None = option("TLT's adaptive plans from a `tlt bench speculative --json` "
                                     "file: of its rows at the runs' temperature (T = 1), the "
                                     "plan with the highest speedup at each batch size it "
                                     "measured (none: the built-in plans)", None, metavar="FILE")
    calibration_cache: Path | None = option("TLT reads its calibration from this folder when an "
                                            "earlier run on this machine stored the same one "
                                            "(`tlt train --calibration-cache`), else stores it "
                                            "there; the rows say which (none: TLT calibrates)",
                                            None, metavar="DIR")
    no_progress: bool = option("no progress bars", False)

    def __post_init__(self):
        super().__post_init__()
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got "
                             f"{self.workload!r}")
        if self.trace_file is not None and self.workload != "trace":
            raise ValueError("trace_file: lengths for the trace workload; add --workload trace")

    def train_config(self) -> TrainConfig:
        """The runs' TrainConfig: TrainConfig's defaults with the sizes and lr given here."""
        sizes = {name: getattr(self, name) for name in ("prompts_per_step", "samples_per_prompt",
                                                         "max_new_tokens", "max_batch", "lr")
                 if getattr(self, name) is not None}
        return TrainConfig(steps=self.steps, sampled_drafts=self.sampled_drafts,
                           plans_from=self.plans_from, calibration_cache=self.calibration_cache,
                           **sizes)


CLI_OPTIONS = (TrainOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench train`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


@dataclass(frozen=True)
class TraceLengths:
    """The trace workload's forced lengths (tlt_core.rl.driver.ForcedLengths): sample j of the
    k-th prompt rolled out in step s decodes `lengths[(s x prompts_per_step + k) x
    samples_per_prompt + j]`, from the start again past the end. `source` says where the
    lengths came from."""
    lengths: tuple[int, ...]
    prompts_per_step: int
    samples_per_prompt: int
    source: str

    def __call__(self, step: int, prompt: int, sample: int) -> int:
        row = (step * self.prompts_per_step + prompt) * self.samples_per_prompt + sample
        return self.lengths[row % len(self.lengths)]


def trace_lengths(options: TrainOptions, config: TrainConfig) -> TraceLengths:
    """The lengths of `--workload trace`: --trace-file's, or one lognormal draw per sample of
    the run; each capped at max_new_tokens. A bad file raises FileNotFoundError / ValueError
    naming it."""
    rows = config.steps * config.prompts_per_step * config.samples_per_prompt
    lengths, source = options.trace_lengths(rows, cap=config.max_new_tokens, seed=TRACE_SEED)
    return TraceLengths(tuple(lengths), config.prompts_per_step, config.samples_per_prompt,
                        source)


def run(config: TrainConfig = TrainConfig(steps=12), progress: bool = True,
        inputs: Callable[[], TrainInputs] | None = None, label: str = EMBEDDED_LABEL,
        trace: TraceLengths | None = None) -> dict:
    """inputs: builds one run's TrainInputs, called once per run so that each run trains its
    own copy of the policy and drafter (default: the embedded workload's). trace: the trace
    workload's lengths; None: the natural workload."""
    inputs_for_run = inputs or (lambda: train_inputs(progress=progress))
    drivers = {}
    for name, tlt, seed_offset in RUNS:
        inputs = inputs_for_run()
        drivers[name] = RLDriver(inputs.policy, inputs.prompts, inputs.reward_fn,
                                 inputs.detokenize, inputs.stop_ids,
                                 replace(config, tlt=tlt, seed=config.seed + seed_offset),
                                 drafter=inputs.drafter, calibration=inputs.calibration,
                                 forced_lengths=trace)
    rows = []
    bar = tqdm(total=config.steps * len(RUNS), disable=not progress, unit="step", desc="train")
    for _ in range(config.steps):
        for name, driver in drivers.items():
            rows.append(_row(label, name, driver.step()))
            bar.update()
    bar.close()
    workload = ({"name": "natural"} if trace is None else
                {"name": "trace", "lengths": trace.source})
    return {"model": label, "workload": workload, "config": config.as_record(), "rows": rows,
            "summary": summarize(rows)}


def _row(label: str, run_name: str, m: dict) -> dict:
    """One run's step as a row: its times, rates, reward and acceptance, lengths and trace."""
    tokens = sum(m["response_lengths"])
    return {"model": label, "run": run_name, "step": m["step"],
            "step_s": m["train/step_s"], "rollout_s": m["rollout/time_s"],
            "train_s": m["train/update_s"], "calibration_s": m["rollout/calibration_s"],
            "calibration_cached": bool(m["rollout/calibration_cached"]),
            "tokens": tokens, "tok_s": tokens / m["train/step_s"],
            "rollout_tok_s": tokens / m["rollout/time_s"],
            "reward": m["train/reward"], "acceptance_length": m["spec/acceptance_length"],
            **{key.removeprefix("spec/"): m[key] for key in m
               if key.startswith("spec/acceptance_length/")},
            "sd_on_share": m["spec/sd_step_share"], "logprob_gap": m["train/logprob_gap"],
            "inert_fraction": m["train/inert_fraction"], "response_lengths": m["response_lengths"],
            "step_trace": {"columns": list(TRACE_COLUMNS),
                           "rows": [[row[c] for c in TRACE_COLUMNS] for row in m["step_trace"]]}}


def summarize(rows: list[dict]) -> dict:
    """The runs' totals and ratios (module docstring) from their rows."""
    def of(run, key):
        return [r[key] for r in sorted((r for r in rows if r["run"] == run),
                                       key=lambda r: r["step"])]

    def gap(a, b):
        pairs = list(zip(of(a, "reward"), of(b, "reward")))
        return sum(abs(x - y) for x, y in pairs) / len(pairs)

    names = [run for run, _, _ in RUNS]
    time = {run: sum(of(run, "step_s")) for run in names}
    rollout = {run: sum(of(run, "rollout_s")) for run in names}
    tokens = {run: sum(of(run, "tokens")) for run in names}
    tok_s = {run: tokens[run] / time[run] for run in names}
    rollout_tok_s = {run: tokens[run] / rollout[run] for run in names}
    calibration = {run: sum(of(run, "calibration_s")) for run in names}
    after_calibration = tokens["tlt"] / (time["tlt"] - calibration["tlt"])
    return {"speedup_per_token": tok_s["tlt"] / tok_s["off"],
            "speedup_per_token_after_calibration": after_calibration / tok_s["off"],
            "rollout_speedup_per_token": rollout_tok_s["tlt"] / rollout_tok_s["off"],
            "noise_per_token": tok_s["off_seed2"] / tok_s["off"],
            "rollout_noise_per_token": rollout_tok_s["off_seed2"] / rollout_tok_s["off"],
            "speedup": time["off"] / time["tlt"],
            "rollout_speedup": rollout["off"] / rollout["tlt"],
            "reward_gap": gap("tlt", "off"), "reward_noise": gap("off_seed2", "off"),
            "tokens": tokens, "tok_s": tok_s, "rollout_tok_s": rollout_tok_s,
            "time_s": time, "rollout_s": rollout,
            "calibration_s": calibration,
            "calibration_cached": any(r["calibration_cached"] for r in rows),
            "rollout_share_off": rollout["off"] / time["off"],
            "response_lengths": {run: tail_shape([n for lengths in of(run, "response_lengths")
                                                  for n in lengths]) for run in names},
            "mean_reward": {run: sum(of(run, "reward")) / len(of(run, "reward"))
                            for run in names},
            "max_logprob_gap": max(r["logprob_gap"] for r in rows)}


def format_table(result: dict) -> str:
    workload = result["workload"]
    lines = [f"model: {result.get('model', EMBEDDED_LABEL)}",
             f"workload: {workload['name']}" + (f" ({workload['lengths']})"
                                                if "lengths" in workload else ""),
             f"{'step':>4}" + "".join(f"{run + ' s':>13}{'tok/s':>8}{'reward':>8}"
                                      for run, _, _ in RUNS)]
    steps = sorted({r["step"] for r in result["rows"]})
    for step in steps:
        cells = ""
        for run, _, _ in RUNS:
            r = next(x for x in result["rows"] if x["run"] == run and x["step"] == step)
            cells += f"{r['step_s']:>13.2f}{r['tok_s']:>8.1f}{r['reward']:>8.3f}"
        lines.append(f"{step:>4}{cells}")
    s = result["summary"]
    shape = s["response_lengths"]["off"]
    lines += [
        f"responses (SD off): median {shape['median']}, p99 {shape['p99']}, max {shape['max']} "
        f"tokens; {s['tokens']['tlt']} / {s['tokens']['off']} / {s['tokens']['off_seed2']} "
        f"tokens in all (TLT / SD off / SD off reseeded)",
        f"per token: TLT {s['speedup_per_token']:.2f}x SD off end to end "
        f"({s['rollout_speedup_per_token']:.2f}x on the rollout); noise floor, SD off reseeded "
        f"over SD off: {s['noise_per_token']:.2f}x ({s['rollout_noise_per_token']:.2f}x)",
        f"per-step time: TLT {s['speedup']:.2f}x SD off end to end ({s['rollout_speedup']:.2f}x "
        f"on the rollout; rollout is {100 * s['rollout_share_off']:.0f}% of an SD-off step); "
        f"TLT's step 0 includes {s['calibration_s']['tlt']:.1f} s of calibration"
        + (" (read from the cache)" if s["calibration_cached"] else "")
        + f"; without it, TLT {s['speedup_per_token_after_calibration']:.2f}x per token",
        f"reward gap {s['reward_gap']:.3f} vs noise {s['reward_noise']:.3f}"]
    return "\n".join(lines)
