"""`tlt task lengths`: the embedded task's response-length distribution — of the reference
solutions and of the pre-trained model's own samples at temperature 1 — as numbers and, optionally, a
histogram. The long tail that speculative decoding has to tame, made visible."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.embedded.pretrain import sample_responses
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems, length_stats
from tlt_core.model.transformer import Transformer


@dataclass(frozen=True)
class LengthsOptions:
    """`tlt task lengths`: how many problems, and the histogram."""
    problems: int = option("reference problems to measure", 5000)
    model_problems: int = option("problems the pre-trained model answers (0: skip the model)",
                                 512)
    plot: Path | None = option("write a histogram image", None, metavar="PNG")


CLI_OPTIONS = (LengthsOptions,)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt task lengths`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


def reference_lengths(num_problems: int, seed: int = 0) -> list[int]:
    tokenizer = CharTokenizer()
    problems = generate_problems(TaskConfig(seed=seed, num_problems=num_problems))
    return [len(tokenizer.response_ids(p.solution)) for p in problems]


def model_lengths(model: Transformer, num_problems: int, seed: int = 12345) -> list[int]:
    """Response lengths of the embedded model sampled at temperature 1."""
    problems = generate_problems(TaskConfig(seed=seed, num_problems=num_problems))
    return [len(r.tokens) for r in sample_responses(model, problems)]


def plot_histogram(series: dict[str, list[int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.6), dpi=120)
    top = max(max(v) for v in series.values())
    bins = range(0, top + 8, 7)  # one bin per reasoning step (7 tokens)
    for label, lengths in series.items():
        stats = length_stats(lengths)
        axis.hist(lengths, bins=bins, alpha=0.55, density=True,
                  label=f"{label}: median {stats['median']:.0f}, p99 {stats['p99']:.0f} "
                        f"({stats['p99_over_median']:.1f}x)")
    axis.set_yscale("log")
    axis.set_xlabel("response length (tokens, <eos> included)")
    axis.set_ylabel("density (log scale)")
    axis.set_title("Embedded task: heavy-tailed response lengths")
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
