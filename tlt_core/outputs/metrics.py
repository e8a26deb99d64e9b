"""Per-step metrics of the RL driver: their stable names, and where they are written.

`METRICS` is the contract: every scalar `RLDriver.step()` returns, with its unit and meaning.
The names are the keys of `metrics.jsonl` and the tags of the TensorBoard scalars alike, and they
do not change: dashboards and comparisons across runs key on them. `RECORD_FIELDS` lists the
step record's other keys (the step index, text, lists) and why each is not a scalar. A test holds
both tables to what `driver.py` emits, and docs/metrics.md to `render_markdown()` (regenerate it
with `python -c "import tlt_core.outputs.metrics as m; print(m.render_markdown(), end='')" >
docs/metrics.md`).

`MetricsWriter` writes one JSON line per step to `metrics.jsonl`, always; with TensorBoard on,
also each scalar of `METRICS` (at global step = the record's `step`; a null value, e.g. no
acceptance length in a step without speculation, is skipped) and the response lengths as a
histogram, through `torch.utils.tensorboard.SummaryWriter`; with wandb settings, the same
scalars and histogram, at wandb step = the record's `step`, to a Weights & Biases run
(tlt_core.outputs.wandb_logger: online, or offline under the run folder for `wandb sync`; a resumed
run continues the same wandb run). TensorBoard and wandb are optional: neither package is a
dependency (`pip install tensorboard`, `pip install wandb`).

metrics.jsonl only ever holds whole records: a line is appended and fsync'd, and an append that
fails (disk full, no permission) is cut back off before the OSError, which names the file, is
raised; a resumed run's rewrite replaces the file atomically (checkpoint_io.atomic_file). Lines
are appended rather than the file rewritten each step because a record carries the step's
rollout trace: rewriting would cost O(steps^2) bytes over a run.

Rank-local values: in a multi-process run a step's timings, trace and speculation counters are
those of the rank that writes (rank 0); rewards, lengths and losses cover every rank's samples.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from tlt_core.engine.records import POSITION_BUCKET_EDGES, POSITION_BUCKET_LABELS
from tlt_core.outputs.wandb_logger import WandbLogger, WandbSettings, remove_local_run
from tlt_core.persistence.checkpoint_io import atomic_file, failed_write
from tlt_core.rl.evaluation import PASS_AT_K


def _bucket_range(bucket: int) -> str:
    """The contexts of POSITION_BUCKET_LABELS[bucket], in words."""
    edges = POSITION_BUCKET_EDGES
    if bucket == 0:
        return f"< {edges[0]}"
    if bucket == len(edges):
        return f">= {edges[-1]}"
    return f"{edges[bucket - 1]} to {edges[bucket] - 1}"


# name: (unit, meaning). The namespaces group the scalars as veRL's and TRL's dashboards do:
# rollout/ (generation: timings, lengths, dynamic sampling), spec/ (speculative decoding),
# drafter/ (the drafter's versions and training), train/ (rewards, losses, the update), eval/
# (the held-out evaluation).
METRICS: dict[str, tuple[str, str]] = {
    "train/reward": ("reward", "mean reward of the step's samples"),
    "train/reward_std": ("reward", "standard deviation of the step's rewards"),
    "train/step_s": ("s", "wall time of the whole step: rollout, scoring, update, drafter "
                          "refresh"),
    "rollout/time_s": ("s", "the rollout: this rank's generation, then waiting (and spot-"
                            "training the drafter) until every rank is done, then gathering "
                            "the samples; the first step of a run also calibrates the adaptive "
                            "loop (rollout/calibration_s)"),
    "rollout/calibration_s": ("s", "the adaptive loop's calibration that ran for this step (the "
                                   "first of a run or a resume; 0 after), inside rollout/time_s "
                                   "and train/step_s; with --calibration-cache and a stored "
                                   "calibration, the seconds reading it"),
    "rollout/calibration_cached": ("0 or 1", "1 at the step whose calibration was read from "
                                             "--calibration-cache instead of measured"),
    "train/update_s": ("s", "the policy update: PPO-clip epochs over the mini-batches"),
    "rollout/time_share": ("fraction", "rollout/time_s / train/step_s"),
    "rollout/tail_s": ("s", "rollout time spent with at most 25% of the rollout's peak running "
                            "batch decoding (driver.TAIL_FRACTION): the long tail"),
    "spec/acceptance_length": ("tokens / step", "mean tokens a row emits per speculative step "
                                                "(accepted draft tokens + 1); null when no step "
                                                "was speculative"),
    **{f"spec/acceptance_length/{label}": (
        "tokens / step", f"spec/acceptance_length over the row-steps whose context (the row's "
                         f"tokens in the target's cache when the step began: prompt + generated "
                         f"- 1) was {_bucket_range(bucket)} tokens; null when none was")
       for bucket, label in enumerate(POSITION_BUCKET_LABELS)},
    "spec/sd_step_share": ("fraction", "share of the rollout's decode steps that were "
                                       "speculative"),
    "spec/batch_max": ("rows", "the largest running batch of a speculative step in this rank's "
                               "rollout: SD is on at and below it, off above it when the "
                               "adaptive loop switches by batch size; null when no step was "
                               "speculative"),
    "drafter/version": ("version", "drafter version after this step's refresh and watchdog "
                                   "verdict (0: the initial drafter; each refresh that trained "
                                   "publishes the next, a rollback returns to an older one); "
                                   "null without a drafter"),
    "drafter/spot_steps": ("steps", "drafter training steps taken in this rank's idle tail"),
    "rollout/response_length_mean": ("tokens", "mean generated tokens per sample, stop token "
                                               "included"),
    "train/reward_errors": ("samples", "samples whose reward function raised or returned NaN "
                                       "(each scored 0)"),
    "rollout/truncated_fraction": ("fraction", "share of the step's samples cut at "
                                               "max_new_tokens (mask_truncated_completions "
                                               "leaves them out of the loss)"),
    "rollout/groups_dropped": ("groups", "groups whose rewards were all equal, dropped by "
                                         "dynamic sampling (0 without it)"),
    "rollout/refill_rounds": ("rounds", "rollout rounds dynamic sampling added to refill the "
                                        "step's groups (0 without it)"),
    "train/lr": ("learning rate", "the policy's learning rate in this step (the schedule's "
                                  "value)"),
    "train/loss": ("nats / token", "clipped-surrogate policy loss as loss_agg_mode aggregates "
                                   "it (KL term excluded), mean over the step's mini-batches"),
    "train/kl": ("nats / token", "the kl_estimator's estimate of KL(policy || reference) per "
                                 "response token, mean over the step's tokens; 0 when kl_coef "
                                 "is 0"),
    "train/clip_fraction": ("fraction", "share of response tokens whose clipped PPO term was "
                                        "the smaller one"),
    "train/inert_fraction": ("fraction", "share of the step's samples whose gradient is exactly "
                                         "zero (a GRPO advantage of 0, as in a group that "
                                         "scored alike, and no KL term): counted in the loss's "
                                         "normalisation, passed through no model"),
    "train/grad_norm": ("L2 norm", "largest gradient norm of the step's optimizer steps, "
                                   "before clipping"),
    "train/value_loss": ("squared reward", "PPO's clipped value loss as loss_agg_mode "
                                           "aggregates it, mean over the step's mini-batches; "
                                           "null with GRPO"),
    "train/value_clip_fraction": ("fraction", "share of response tokens whose clipped value "
                                              "error was the larger one; null with GRPO"),
    "train/explained_variance": ("fraction", "1 - Var(returns - values) / Var(returns) over "
                                             "the step's tokens, the critic before its update "
                                             "(1: perfect, <= 0: no better than a constant); "
                                             "null with GRPO or constant returns"),
    "train/logprob_gap": ("nats", "largest |recomputed - rollout| log-prob over the first "
                                  "mini-batch's tokens, before any update; ~0 because "
                                  "speculative decoding is lossless (a silent SD bug shows "
                                  "here)"),
    "eval/reward": ("reward", "mean reward of the held-out prompts' samples, the policy after "
                              "this step's update; null in steps without an evaluation"),
    **{f"eval/pass@{k}": ("fraction", f"pass@{k} on the held-out prompts (unbiased estimator "
                                      f"from eval_samples samples; a pass: reward >= "
                                      f"pass_threshold); null without an evaluation or when "
                                      f"eval_samples < {k}")
       for k in PASS_AT_K},
    "eval/time_s": ("s", "wall time of the evaluation (not part of train/step_s); null without "
                         "one"),
}

# name: what it is, and why it is not a TensorBoard (or wandb) scalar
RECORD_FIELDS: dict[str, str] = {
    "step": "the step index, from 0: the global step of every scalar above, not a series",
    "drafter_event": "the watchdog's verdict on the rollout's drafter: \"ok\", \"rolled_back\" "
                     "or \"sd_disabled\" (text; null without a drafter)",
    "first_reward_error": "the first reward-function error's message (text; null when none)",
    "response_lengths": "generated tokens of every sample (a list; TensorBoard and wandb get it "
                        "as the histogram `response_lengths`)",
    "trace_time_s": "end of each decode step of the rollout, in seconds (a list: the running-"
                    "batch plot of the report)",
    "trace_running": "rows decoding during each of those steps (a list)",
    "trace_speculative": "whether each of those steps was speculative (a list of booleans: the "
                         "report marks the SD steps on the running-batch plot)",
    "step_trace": "this rank's decode steps, round by round: a list of rows (round, step, "
                  "running batch, mean context, arm: \"plain\" or the draft plan's key, tokens "
                  "emitted, seconds, and of those the drafter's catch-up seconds); which arm "
                  "the adaptive loop chose where, and what it cost",
}

HISTOGRAMS = ("response_lengths",)  # lists of numbers TensorBoard and wandb show as histograms
JSONL_FILE = "metrics.jsonl"
TENSORBOARD_EVENTS = "events.out.tfevents.*"  # SummaryWriter's file names


def tensorboard_available() -> bool:
    """Whether torch.utils.tensorboard can write event files (the tensorboard package is
    installed)."""
    return importlib.util.find_spec("tensorboard") is not None


def append_jsonl(path: Path, record: dict) -> None:
    """Appends `record` as one line of `path`, fsync'd; on an OSError the file is left as it
    was (module docstring) and the error names `path`."""
    data = (json.dumps(record) + "\n").encode("utf-8")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise failed_write(path, error) from error
    try:
        size = os.fstat(descriptor).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(descriptor, data[written:])
            os.fsync(descriptor)
        except OSError as error:
            with contextlib.suppress(OSError):  # the write's error is the one to report
                os.ftruncate(descriptor, size)  # no torn line for a reader or a resumed run
            raise failed_write(path, error) from error
    finally:
        os.close(descriptor)


def step_scalars(record: dict) -> dict[str, float]:
    """The scalars of METRICS that a step record holds a number for (null ones are skipped)."""
    return {name: record[name] for name in METRICS
            if isinstance(record.get(name), (int, float)) and not isinstance(record[name], bool)}


def step_histograms(record: dict) -> dict[str, list]:
    """The HISTOGRAMS that a step record holds a non-empty list for."""
    return {name: record[name] for name in HISTOGRAMS if record.get(name)}


def write_jsonl(path: Path, records: list[dict]) -> None:
    """`records`, one line each, as the file `path`, atomically."""
    with atomic_file(path) as temporary:
        temporary.write_text("".join(json.dumps(m) + "\n" for m in records), encoding="utf-8")


class MetricsWriter:
    """Writes a run's step records under `folder`: metrics.jsonl, TensorBoard event files when
    `tensorboard` is True, and a wandb run when `wandb` gives its settings (its files under
    `folder` too: tlt_core.outputs.wandb_logger).

    history: None starts a fresh run: a previous run's metrics.jsonl, TensorBoard event files
    and wandb files in the folder are removed (whether or not this run writes them). A resumed
    run passes its earlier records: they rewrite metrics.jsonl, TensorBoard hides the events an
    interrupted attempt wrote at steps >= len(history) (purge_step), and the wandb run whose id
    the folder holds continues.
    enabled: False writes nothing (the ranks other than 0 of a distributed run)."""

    def __init__(self, folder: str | Path, *, tensorboard: bool = False,
                 history: list[dict] | None = None, enabled: bool = True,
                 wandb: WandbSettings | None = None):
        self.folder = Path(folder)
        self.jsonl_path = self.folder / JSONL_FILE
        self.enabled = enabled
        self._tensorboard = None
        self._wandb = None
        if not enabled:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if history is None:  # a previous run's records would mix with this one's
            self.jsonl_path.unlink(missing_ok=True)
            for old in self.folder.glob(TENSORBOARD_EVENTS):
                old.unlink()
            remove_local_run(self.folder)
        else:
            write_jsonl(self.jsonl_path, history)
        if tensorboard:
            if not tensorboard_available():
                raise ImportError("tensorboard: the package is not installed; pip install "
                                  "tensorboard (or write metrics.jsonl only)")
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.folder),
                                              purge_step=len(history) if history else None)
        if wandb is not None:
            try:
                self._wandb = WandbLogger(
                    self.folder, wandb, history=None if history is None else
                    [(m["step"], step_scalars(m), step_histograms(m)) for m in history])
            except BaseException:
                self.close(failed=True)
                raise

    @property
    def tensorboard(self) -> bool:
        return self._tensorboard is not None

    @property
    def wandb(self) -> WandbLogger | None:
        """The wandb run written to (its id, mode, address), None without one."""
        return self._wandb

    def write(self, metrics: dict) -> None:
        if not self.enabled:
            return
        append_jsonl(self.jsonl_path, metrics)
        if self._tensorboard is None and self._wandb is None:
            return
        step, scalars, histograms = metrics["step"], step_scalars(metrics), step_histograms(metrics)
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
            for name, values in histograms.items():
                self._tensorboard.add_histogram(name, np.asarray(values), step)
            self._tensorboard.flush()  # a live TensorBoard sees every step; Ctrl-C loses none
        if self._wandb is not None:
            self._wandb.log(step, scalars, histograms)

    def close(self, *, failed: bool = False) -> None:
        """Closes the event files and finishes the wandb run (marked failed when `failed`)."""
        tensorboard, self._tensorboard = self._tensorboard, None
        wandb, self._wandb = self._wandb, None
        try:
            if tensorboard is not None:
                tensorboard.close()
        finally:
            if wandb is not None:
                wandb.close(failed=failed)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def render_markdown() -> str:
    """docs/metrics.md: the tables above, as Markdown."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "# Metrics of `tlt train`",
        "",
        "Generated from `tlt_core/outputs/metrics.py` by `render_markdown()`; a test checks that "
        "this page, the tables there and what `tlt_core/rl/driver.py` emits agree.",
        "",
        "Every RL step appends one JSON object to `metrics.jsonl` in the run folder "
        "(`baseline/metrics.jsonl` for the SD-off run of `--compare`). When the `tensorboard` "
        "package is installed, the scalars below are also written as TensorBoard scalars with "
        "the same names, at global step `step`, next to `metrics.jsonl` (`tensorboard --logdir "
        "runs/tlt-train` shows the TLT run and, with `--compare`, the baseline side by side); "
        "a null value is not written. With `--wandb-project NAME`, the same scalars and the "
        "`response_lengths` histogram also go to a Weights & Biases run, at wandb step `step` "
        "(`--wandb-mode offline` writes it under the run folder for `wandb sync`; `--compare`'s "
        "baseline is a second run in the same group). In a multi-process run rank 0 writes, "
        "and timings, trace and speculation counters are rank 0's own, while rewards, lengths "
        "and losses cover every rank's samples.",
        "",
        "## Scalars",
        "",
        "| name | unit | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{name}` | {cell(unit)} | {cell(meaning)} |"
              for name, (unit, meaning) in METRICS.items()]
    lines += ["", "## Other fields of a step record", "", "| name | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {cell(text)} |" for name, text in RECORD_FIELDS.items()]
    return "\n".join(lines) + "\n"
