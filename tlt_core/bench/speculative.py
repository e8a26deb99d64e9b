"""`tlt bench speculative`: speculative rollout vs plain decoding, side by side, per batch size.

Workload: the pre-trained embedded model with its offline-trained drafter on held-out problems
of the embedded task, or a local checkpoint with its drafter (`--model DIR --drafter DIR`) on
arithmetic word problems in its chat template (tlt_core.bench.model_workload); at the given
temperature, each response ending at the model's stop ids as in RL rollouts.
For a batch size b the engine holds at most b running rows and gets `requests(b)` requests
(default max(2b, 16)), so the batch stays near b until the queue drains. Plain decoding and each
strategy run the same requests with the same seeds, interleaved (plain, strategies, plain, ...)
so machine noise hits them alike; each number is the median of `reps` runs. A row reports
generated tokens per second for both, speedup = sd / plain, and the acceptance length (tokens a
row emits per speculative step), overall and by context position. Greedy runs compare SD's
tokens with plain decoding's: in float32 they must be equal (a difference raises); in bf16 and
fp16 the two passes round differently (a tree pass vs a one-token pass), so a row may diverge
after a near-tie, and the row reports the share of responses equal token for token and the mean
position of the first difference among the others.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tqdm import tqdm

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.sampled_tree import SampledTree
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.bench.model_workload import EMBEDDED_LABEL, ModelOptions
from tlt_core.config_flags import add_dataclass_arguments, int_list, option
from tlt_core.engine.records import (Request, RolloutResult, SamplingParams,
                                     acceptance_by_position)
from tlt_core.model.transformer import Transformer

# (batch, temperature, seed) -> (requests, the engine's max_len)
RequestSource = Callable[[int, float, int], tuple[list[Request], int]]
DEFAULT_STRATEGIES = (Strategy(6, 1, 7), Strategy(8, 1, 9), Strategy(12, 1, 13),
                      Strategy(5, 4, 16), Strategy(6, 8, 32))


@dataclass(frozen=True)
class SpeculativeOptions:
    """`tlt bench speculative`: batch sizes, strategies and requests of the comparison."""
    json: Path | None = option("write rows (batch, plan, acceptance_length, sd_tok_s, "
                               "plain_tok_s, speedup_vs_plain, step_x_plain, ...) as JSON",
                               None, metavar="FILE")
    plot: Path | None = option("plot speedup against batch size per strategy", None,
                               metavar="PNG")
    batch: tuple[int, ...] = option("batch sizes (the engine's max running rows)",
                                    (1, 4, 16, 64), parse=int_list, metavar="B,...")
    strategy: list[str] | None = option(
        "a draft plan: a tree depth,topk,num_verify_tokens, a sampled chain sD or a sampled "
        "tree sD,K (K chains of D tokens from the root); repeatable (default: "
        + " ".join(f"{s.depth},{s.topk},{s.num_verify_tokens}" for s in DEFAULT_STRATEGIES)
        + ")", None, metavar="PLAN", parse=str, repeatable=True)
    temperature: float = option("sampling temperature (0: greedy, also checks SD == plain)", 1.0)
    reps: int = option("timed runs per case (median)", 3)
    requests: int = option("requests per batch size: max(2 x batch, N), so the batch stays near "
                           "its size until the queue drains", 16, metavar="N")
    max_tokens: int | None = option("longest response (default: the embedded task's longest "
                                    "reference, or 256 with --model)", None, metavar="N")
    no_progress: bool = option("hide the progress bar", False)


CLI_OPTIONS = (SpeculativeOptions, ModelOptions)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench speculative`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


@dataclass(frozen=True)
class SpeculativeCase:
    batch: int
    plan: str  # the draft plan's key
    acceptance_length: float
    sd_tok_s: float
    plain_tok_s: float
    speedup_vs_plain: float  # sd_tok_s / plain_tok_s
    temperature: float
    requests: int
    tokens: int  # generated per run (same for both under exact greedy)
    model: str = EMBEDDED_LABEL
    acceptance_by_position: dict = field(default_factory=dict)
    # greedy only: share of responses equal to plain decoding's token for token, and the mean
    # index of the first differing token among the others (None: all equal)
    greedy_equal: float | None = None
    first_divergence: float | None = None
    # the speculative step's profile (means over its steps, milliseconds): growing the draft
    # trees, the target's tree pass with the verification kernel, and the accept phase
    # (compaction, the drafter's catch-up, committing); plain_step_ms: a plain step's mean
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    accept_ms: float = 0.0
    plain_step_ms: float = 0.0
    # a speculative step (draft + verify + accept) in plain steps
    step_x_plain: float = 0.0
    dtype: str = "float32"  # the target's


def parse_strategy(text: str) -> DraftPlan:
    """"depth,topk,num_verify_tokens" -> Strategy; "sampled(D)" or "sD" -> SampledChain;
    "sampled(D,K)" or "sD,K" -> SampledTree."""
    sampled = re.fullmatch(r"s(?:ampled)?\(?(\d+)(?:,(\d+))?\)?", text.replace(" ", ""))
    if sampled and sampled.group(2) is not None:
        return SampledTree(int(sampled.group(1)), int(sampled.group(2)))
    if sampled:
        return SampledChain(int(sampled.group(1)))
    parts = text.replace("(", "").replace(")", "").split(",")
    if len(parts) != 3:
        raise ValueError(f"strategy: expected depth,topk,num_verify_tokens, got {text!r}")
    return Strategy(*(int(p) for p in parts))


def embedded_requests(count: int, temperature: float, seed: int, max_tokens: int | None
                      ) -> tuple[list[Request], int]:
    """(count embedded-task requests of the problem family `seed`, each ending at <eos> or
    max_tokens (None: room for the longest reference response), the engine max_len they need)."""
    tokenizer = CharTokenizer()
    task = TaskConfig(seed=seed, num_problems=count)
    problems = generate_problems(task)
    if max_tokens is None:
        max_tokens = 7 * task.max_steps + 16  # the longest reference response: 7 * max_steps + 7
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            stop_ids=(tokenizer.eos_id,), seed=None)
    requests = [Request(tokenizer.prompt_ids(p.prompt), params) for p in problems]
    return requests, max(len(r.prompt_ids) for r in requests) + max_tokens


def run(target: Transformer, drafter: Drafter, batches=(1, 4, 16, 64),
        strategies=DEFAULT_STRATEGIES, temperature: float = 1.0, reps: int = 3,
        seed: int = 4242, max_tokens: int | None = None, progress: bool = True,
        requests_for: RequestSource | None = None, label: str = EMBEDDED_LABEL
        ) -> list[SpeculativeCase]:
    """requests_for(batch, temperature, seed) -> (requests, engine max_len); default: the
    embedded task's (embedded_requests)."""
    if requests_for is None:
        def requests_for(batch, temperature, seed):
            return embedded_requests(max(2 * batch, 16), temperature, seed, max_tokens)
    exact = next(target.parameters()).dtype == torch.float32
    results = []
    bar = tqdm(total=len(batches) * len(strategies) * reps, disable=not progress,
               desc="speculative", unit="run")
    for batch in batches:
        requests, max_len = requests_for(batch, temperature, seed + batch)
        engine = RolloutEngine(target, EngineConfig(max_batch=batch, max_len=max_len, seed=seed),
                               drafter)
        plain_result = engine.generate(requests)  # untimed (one-time costs); the greedy reference
        plain_tokens = sum(len(r.tokens) for r in plain_result.rollouts)
        for strategy in strategies:
            engine.generate(requests, strategy=strategy)  # untimed: one-time costs
            plain_times, sd_times, sd_tokens, runs, plain_steps = [], [], 0, [], 0
            for _ in range(reps):
                t0 = time.perf_counter()
                plain_steps = engine.generate(requests).decode_steps
                plain_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                result = engine.generate(requests, strategy=strategy)
                sd_times.append(time.perf_counter() - t0)
                sd_tokens = sum(len(r.tokens) for r in result.rollouts)
                runs.append(result)
                bar.update()
            equal = divergence = None
            if temperature == 0:
                equal, divergence = greedy_agreement(plain_result, runs[-1])
                if exact and equal != 1.0:
                    raise AssertionError(f"greedy SD output differs from plain decoding in "
                                         f"float32 (batch {batch}, strategy {strategy})")
            plain_s, sd_s = statistics.median(plain_times), statistics.median(sd_times)
            plain_rate, sd_rate = plain_tokens / plain_s, sd_tokens / sd_s
            steps = [step for r in runs for step in r.spec_steps]
            profile = {name: 1e3 * statistics.mean(getattr(step, name + "_s") for step in steps)
                       for name in ("draft", "verify", "accept")}
            plain_step_ms = 1e3 * plain_s / max(plain_steps, 1)
            results.append(SpeculativeCase(
                batch, strategy.key, statistics.mean(r.acceptance_length for r in runs),
                sd_rate, plain_rate, sd_rate / plain_rate, temperature, len(requests),
                sd_tokens, label, acceptance_by_position(steps), equal, divergence,
                profile["draft"], profile["verify"], profile["accept"], plain_step_ms,
                sum(profile.values()) / plain_step_ms,
                str(next(target.parameters()).dtype).removeprefix("torch.")))
    bar.close()
    return results


def greedy_agreement(plain: RolloutResult, sd: RolloutResult) -> tuple[float, float | None]:
    """(share of responses equal token for token, mean index of the first difference among
    those that differ, or None)."""
    firsts = []
    for a, b in zip(plain.rollouts, sd.rollouts, strict=True):
        x, y = a.tokens.tolist(), b.tokens.tolist()
        if x != y:
            firsts.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q),
                               min(len(x), len(y))))
    equal = 1 - len(firsts) / len(plain.rollouts)
    return equal, (statistics.mean(firsts) if firsts else None)


def as_rows(results: list[SpeculativeCase]) -> list[dict]:
    return [asdict(r) for r in results]


def format_table(results: list[SpeculativeCase]) -> str:
    lines = [f"model: {results[0].model}, T={results[0].temperature}" if results else "",
             f"{'batch':>6} {'plan':>12}{'accept':>8}{'sd_tok_s':>10}{'plain_tok_s':>12}"
             f"{'speedup':>9}{'greedy=':>9}   step ms: draft verify accept | plain"
             f" | x plain"]
    for r in results:
        equal = "" if r.greedy_equal is None else f"{r.greedy_equal:.0%}"
        lines.append(f"{r.batch:>6} {r.plan:>12}{r.acceptance_length:>8.2f}"
                     f"{r.sd_tok_s:>10.0f}{r.plain_tok_s:>12.0f}{r.speedup_vs_plain:>8.2f}x"
                     f"{equal:>9}"
                     f"{r.draft_ms:>17.1f}{r.verify_ms:>7.1f}{r.accept_ms:>7.1f} |"
                     f"{r.plain_step_ms:>6.1f} |{r.step_x_plain:>7.2f}")
    return "\n".join(lines)


def plot(results: list[SpeculativeCase], path: Path) -> None:
    """Speedup over plain decoding against batch size, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for plan in dict.fromkeys(r.plan for r in results):
        rows = [r for r in results if r.plan == plan]
        ax.plot([r.batch for r in rows], [r.speedup_vs_plain for r in rows], marker="o",
                label=plan)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (running rows)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Speculative rollout, {results[0].model}, T={results[0].temperature}",
                 fontsize=9)
    ax.legend(title="(depth,topk,N)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
