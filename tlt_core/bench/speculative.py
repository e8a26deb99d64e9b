"""`tlt bench speculative`: speculative rollout vs plain decoding, side by side, per batch size.

Workload: held-out problems of the embedded task, answered by the pre-trained embedded model
with its offline-trained drafter, at the given temperature, each response ending at <eos> as in RL rollouts.
For a batch size b the engine holds at most b running rows and gets max(2b, 16) requests, so
the batch stays near b until the queue drains. Plain decoding and each strategy run the same
requests with the same seeds, interleaved (plain, strategies, plain, ...) so machine noise hits
them alike; each number is the median of `reps` runs. A row reports generated tokens per second
for both, speedup = sd / plain, and the acceptance length (tokens a row emits per speculative
step). Greedy runs also check that SD produced exactly the plain tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.transformer import Transformer

DEFAULT_STRATEGIES = (Strategy(6, 1, 7), Strategy(8, 1, 9), Strategy(12, 1, 13),
                      Strategy(5, 4, 16), Strategy(6, 8, 32))


@dataclass(frozen=True)
class SpeculativeCase:
    batch: int
    strategy: str
    acceptance_length: float
    sd_tok_s: float
    plain_tok_s: float
    speedup: float
    temperature: float
    requests: int
    tokens: int  # generated per run (same for both under greedy)


def parse_strategy(text: str) -> Strategy:
    """"depth,topk,num_verify_tokens" -> Strategy."""
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
        seed: int = 4242, max_tokens: int | None = None, progress: bool = True
        ) -> list[SpeculativeCase]:
    results = []
    bar = tqdm(total=len(batches) * len(strategies) * reps, disable=not progress,
               desc="speculative", unit="run")
    for batch in batches:
        requests, max_len = embedded_requests(max(2 * batch, 16), temperature, seed + batch,
                                              max_tokens)
        engine = RolloutEngine(target, EngineConfig(max_batch=batch, max_len=max_len, seed=seed),
                               drafter)
        plain_result = engine.generate(requests)  # untimed (one-time costs); the greedy reference
        plain_tokens = sum(len(r.tokens) for r in plain_result.rollouts)
        for strategy in strategies:
            engine.generate(requests, strategy=strategy)  # untimed: one-time costs
            plain_times, sd_times, sd_tokens, acceptance = [], [], 0, []
            for _ in range(reps):
                t0 = time.perf_counter()
                engine.generate(requests)
                plain_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                result = engine.generate(requests, strategy=strategy)
                sd_times.append(time.perf_counter() - t0)
                sd_tokens = sum(len(r.tokens) for r in result.rollouts)
                acceptance.append(result.acceptance_length)
                if temperature == 0:
                    same = all(a.tokens.tolist() == b.tokens.tolist()
                               for a, b in zip(plain_result.rollouts, result.rollouts))
                    if not same:
                        raise AssertionError(f"greedy SD output differs from plain decoding "
                                             f"(batch {batch}, strategy {strategy})")
                bar.update()
            plain_s, sd_s = statistics.median(plain_times), statistics.median(sd_times)
            plain_rate, sd_rate = plain_tokens / plain_s, sd_tokens / sd_s
            results.append(SpeculativeCase(batch, strategy.key, statistics.mean(acceptance),
                                           sd_rate, plain_rate, sd_rate / plain_rate,
                                           temperature, len(requests), sd_tokens))
    bar.close()
    return results


def as_rows(results: list[SpeculativeCase]) -> list[dict]:
    return [asdict(r) for r in results]


def format_table(results: list[SpeculativeCase]) -> str:
    lines = [f"{'batch':>6} {'strategy':>12}{'accept':>8}{'sd_tok_s':>10}{'plain_tok_s':>12}"
             f"{'speedup':>9}"]
    for r in results:
        lines.append(f"{r.batch:>6} {r.strategy:>12}{r.acceptance_length:>8.2f}"
                     f"{r.sd_tok_s:>10.0f}{r.plain_tok_s:>12.0f}{r.speedup:>8.2f}x")
    return "\n".join(lines)


def plot(results: list[SpeculativeCase], path: Path) -> None:
    """Speedup over plain decoding against batch size, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in dict.fromkeys(r.strategy for r in results):
        rows = [r for r in results if r.strategy == strategy]
        ax.plot([r.batch for r in rows], [r.speedup for r in rows], marker="o", label=strategy)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (running rows)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Speculative rollout, embedded model, T={results[0].temperature}")
    ax.legend(title="(depth,topk,N)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
