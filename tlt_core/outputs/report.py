"""The report of a `tlt train` run: a summary and plots, from the runs' per-step metrics.

Plots (PNG, next to report.md): reward per step (TLT against the SD-off baseline when both ran),
the held-out evaluation's reward and pass@k (when the run evaluated), step time split into
rollout and training, the running batch over the last step's rollout, acceptance length per
step, and the response-length histogram.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def summarize(history: list[dict]) -> dict:
    if not history:
        return {}
    time_total = sum(m["train/step_s"] for m in history)
    acceptance = [m["spec/acceptance_length"] for m in history
                  if m.get("spec/acceptance_length")]
    return {"steps": len(history), "time_s": time_total,
            "mean_step_s": time_total / len(history),
            "rollout_s": sum(m["rollout/time_s"] for m in history),
            "update_s": sum(m["train/update_s"] for m in history),
            "tail_s": sum(m["rollout/tail_s"] for m in history),
            "reward_first": history[0]["train/reward"],
            "reward_last": history[-1]["train/reward"],
            "reward_mean": statistics.mean(m["train/reward"] for m in history),
            "acceptance_length": statistics.mean(acceptance) if acceptance else None,
            "sd_step_share": statistics.mean(m["spec/sd_step_share"] for m in history),
            "max_logprob_gap": max(m["train/logprob_gap"] for m in history),
            **_last_evaluation(history)}


def _last_evaluation(history: list[dict]) -> dict:
    """The newest evaluation's reward and pass@k (the largest k it has), if any."""
    evaluated = [m for m in history if m.get("eval/reward") is not None]
    if not evaluated:
        return {}
    last = evaluated[-1]
    k = max((key for key in last if key.startswith("eval/pass@") and last[key] is not None),
            key=lambda key: int(key.rsplit("@", 1)[1]))
    return {"eval_reward_last": last["eval/reward"], "eval_pass@1_last": last["eval/pass@1"],
            f"eval_{k.split('/')[1]}_last": last[k]}


def write_report(folder: Path, runs: dict[str, list[dict]]) -> Path:
    """runs: {"tlt": history, "baseline": history (optional)} -> folder/report.md + plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figures = []  # (title, file name) of the plots drawn
    for name, title, draw in _DRAWINGS:
        fig = draw(plt, runs)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        figures.append((title, name))
    path = folder / "report.md"
    path.write_text("\n".join(_markdown(runs, figures)))
    return path


def _markdown(runs: dict[str, list[dict]], figures: list[tuple[str, str]]) -> list[str]:
    """report.md's lines: the runs' summaries side by side, the speedup, then the plots."""
    lines = ["# tlt train report", ""]
    summaries = {name: summarize(history) for name, history in runs.items()}
    keys = ["steps", "time_s", "mean_step_s", "rollout_s", "update_s", "tail_s", "reward_first",
            "reward_last", "reward_mean", "acceptance_length", "sd_step_share",
            "max_logprob_gap"]
    keys += sorted({key for s in summaries.values() for key in s if key.startswith("eval_")})
    lines.append("| metric | " + " | ".join(summaries) + " |")
    lines.append("|---|" + "---:|" * len(summaries))
    for key in keys:
        cells = [_fmt(s.get(key)) for s in summaries.values()]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if "baseline" in summaries and "tlt" in summaries:
        speedup = summaries["baseline"]["time_s"] / summaries["tlt"]["time_s"]
        lines += ["", f"End-to-end speedup (baseline time / TLT time): **{speedup:.2f}x**"]
    lines.append("")
    for title, name in figures:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    return lines


# ---- the plots: each draws a figure from the runs (`plt` is matplotlib.pyplot), or None -----

def _plot_reward(plt, runs: dict[str, list[dict]]):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, history in runs.items():
        ax.plot([m["step"] for m in history], [m["train/reward"] for m in history], marker="o",
                label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.legend()
    return fig


def _plot_evaluation(plt, runs: dict[str, list[dict]]):
    evaluated = {name: [m for m in history if m.get("eval/reward") is not None]
                 for name, history in runs.items()}
    if not any(evaluated.values()):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, points in evaluated.items():
        if not points:
            continue
        steps = [m["step"] for m in points]
        ax.plot(steps, [m["eval/reward"] for m in points], marker="o",
                label=f"{name}: mean reward")
        ks = [key for key in points[-1] if key.startswith("eval/pass@")
              and points[-1][key] is not None]
        for key in ks[:1] + ks[-1:] if len(ks) > 1 else ks:
            ax.plot(steps, [m[key] for m in points], marker=".", linestyle="--",
                    label=f"{name}: {key.split('/')[1]}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step (policy after its update)")
    ax.set_ylabel("held-out reward / pass rate")
    ax.legend(fontsize="small")
    return fig


def _plot_step_time(plt, runs: dict[str, list[dict]]):
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False,
                             sharey=True)
    for ax, (name, history) in zip(axes[0], runs.items()):
        steps = [m["step"] for m in history]
        rollout = [m["rollout/time_s"] for m in history]
        ax.bar(steps, rollout, label="rollout")
        ax.bar(steps, [m["train/update_s"] for m in history], bottom=rollout, label="update")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend()
    return fig


def _plot_running_batch(plt, runs: dict[str, list[dict]]):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, history in runs.items():
        last = history[-1]
        ax.step(last["trace_time_s"], last["trace_running"], where="pre", label=name)
        speculative = [(t, b) for t, b, sd in zip(last["trace_time_s"], last["trace_running"],
                                                  last.get("trace_speculative", ())) if sd]
        if speculative:
            ax.scatter(*zip(*speculative), s=8, color="tab:orange", zorder=3,
                       label=f"{name}: speculative steps")
    ax.set_xlabel("seconds into the rollout (last step)")
    ax.set_ylabel("running batch")
    ax.legend()
    return fig


def _plot_sd_by_batch(plt, runs: dict[str, list[dict]]):
    """The adaptive loop's switch as it ran: per running batch, the share of decode steps that
    were speculative, over every step's rollout."""
    steps: dict[int, list[bool]] = {}
    for m in runs.get("tlt", []):
        for batch, sd in zip(m["trace_running"], m.get("trace_speculative", ())):
            steps.setdefault(batch, []).append(sd)
    if not any(sd for decided in steps.values() for sd in decided):
        return None
    batches = sorted(steps)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([str(b) for b in batches], [sum(steps[b]) / len(steps[b]) for b in batches])
    ax.set_xlabel("running batch (rows decoding)")
    ax.set_ylabel("share of steps speculative")
    ax.set_ylim(0, 1.05)
    ax.tick_params(axis="x", labelsize="x-small", labelrotation=90)
    return fig


def _plot_acceptance(plt, runs: dict[str, list[dict]]):
    tlt = runs.get("tlt", [])
    if not any(m.get("spec/acceptance_length") for m in tlt):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in tlt], [m["spec/acceptance_length"] or 0 for m in tlt],
            marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per speculative step")
    return fig


def _plot_response_lengths(plt, runs: dict[str, list[dict]]):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, history in runs.items():
        lengths = [n for m in history for n in m["response_lengths"]]
        ax.hist(lengths, bins=40, alpha=0.6, label=name)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses")
    ax.set_yscale("log")
    ax.legend()
    return fig


# (file name, title, drawing), in the report's order
_DRAWINGS = (("reward.png", "Reward per step", _plot_reward),
             ("evaluation.png", "Held-out evaluation", _plot_evaluation),
             ("step_time.png", "Step time: rollout and training", _plot_step_time),
             ("running_batch.png", "Running batch over the last step's rollout",
              _plot_running_batch),
             ("sd_by_batch.png", "SD on by running batch (the adaptive switch)",
              _plot_sd_by_batch),
             ("acceptance.png", "Acceptance length per step", _plot_acceptance),
             ("response_lengths.png", "Response lengths", _plot_response_lengths))

# Every plot a report may hold (next to report.md), so that a replaced run leaves none behind.
PLOTS = tuple(name for name, _, _ in _DRAWINGS)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
