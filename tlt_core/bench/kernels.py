"""`tlt bench kernels`: each fused kernel against its PyTorch reference (tlt_core.ops.reference),
side by side in one run, on EAGLE-shaped draft trees with realistic acceptance.

Cases: B in {1, 4, 16, 64}, N in {8, 32, 64}, V in {32000, 151936}; a case whose logits would
exceed 1 GiB is skipped. The V-independent ops (select_tree on EAGLE-2 candidates, tree_metadata,
compact_kv_ on a bfloat16 (8, 2, B, 4, 256 + N, 64) cache) are timed once per (B, N), with V = 0. Each row of the result: op, B, N, V, fused_us, reference_us, speedup
(reference_us / fused_us), mean_accepted (the acceptance the walk saw, so a silent regression in
the tree shape cannot pass for a speedup).

The reference transforms every node's distribution with vectorised PyTorch (temperature,
sort-based top-k / top-p, softmax) and then walks the tree in Python; the fused kernel touches
only the nodes its walk visits. With device="cuda" the fused kernel runs on the GPU and the reference
(the oracle, CPU-only) on the CPU, so those ratios compare a GPU kernel with a CPU baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm import tqdm

import tlt_core.ops as ops
from tlt_core.config_flags import add_dataclass_arguments, int_list, option
from tlt_core.ops import reference

BATCHES = (1, 4, 16, 64)
NODES = (8, 32, 64)
VOCABS = (32000, 151936)
LOGITS_LIMIT_BYTES = 1 << 30
# Sampling settings of the benchmark: a common RL rollout / evaluation setting.
TEMPERATURE, TOP_K, TOP_P = 0.7, 0, 0.9


@dataclass(frozen=True)
class KernelCase:
    op: str
    B: int
    N: int
    V: int
    fused_us: float  # tlt_core's kernel on `device`
    reference_us: float  # the baseline: the PyTorch reference, or the CPU kernel
    speedup: float  # reference_us / fused_us
    mean_accepted: float  # draft tokens the walk accepted per row
    device: str
    baseline: str  # "reference" (tlt_core.ops.reference) or "cpu_fused" (our CPU kernel)


# V-independent ops: timed once per (B, N), reported with V = 0.
TREE_OPS = ("select_tree", "tree_metadata", "compact_kv_")


@dataclass(frozen=True)
class KernelsOptions:
    """`tlt bench kernels`: what is timed, where, against what."""
    json: Path | None = option("write the result rows (op, B, N, V, fused_us, reference_us, "
                               "speedup, mean_accepted, device, baseline) as a JSON list", None,
                               metavar="FILE")
    batch: tuple[int, ...] = option("batch sizes B, comma-separated", BATCHES, parse=int_list,
                                    metavar="B,...")
    nodes: tuple[int, ...] = option("tree sizes N, comma-separated", NODES, parse=int_list,
                                    metavar="N,...")
    vocab: tuple[int, ...] = option("vocabulary sizes V, comma-separated", VOCABS,
                                    parse=int_list, metavar="V,...")
    ops: str = option("kernels to time, comma-separated",
                      ",".join(("verify_tree_sampling", "verify_tree_greedy") + TREE_OPS),
                      metavar="OP,...")
    reference_reps: int = option("timed runs of the (slow) reference per case; the median is "
                                 "kept", 1)
    quick: bool = option("a 1-minute smoke run: B in {1,4}, N in {8}, V in {32000}", False)
    device: str = option("where the fused kernels run (the reference always runs on cpu)",
                         "cpu", choices=("cpu", "cuda"))
    baseline: str = option("what the fused kernel is compared with: the PyTorch reference, or "
                           "(with --device cuda) our CPU kernel", "reference",
                           choices=("reference", "cpu_fused"))
    no_progress: bool = option("hide the progress bar", False)


CLI_OPTIONS = (KernelsOptions,)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench kernels`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)

# KV cache of the compaction benchmark: a small model's (layers, 2, B, H_kv, T, head_dim).
CACHE_LAYERS, CACHE_HEADS, CACHE_HEAD_DIM, CACHE_PREFIX = 8, 4, 64, 256


@dataclass(frozen=True)
class BenchInputs:
    logits: torch.Tensor  # (B, N, V) float32
    tokens: torch.Tensor  # (B, N) int64
    parents: torch.Tensor  # (B, N) int32
    uniforms: torch.Tensor  # (B, N) float32
    candidates: tuple  # select_tree's inputs: (B, M) tokens, scores, parents and (B,) roots


def eagle_candidates(batch: int, num_nodes: int, generator: torch.Generator) -> tuple:
    """Per-depth top-K expansions as EAGLE-2 produces them (depth-D, top-K)."""
    depth, topk = (4, 2) if num_nodes <= 8 else (6, 8)
    tokens, scores, parents = [], [], []
    for _ in range(batch):
        row_tokens, row_scores, row_parents, frontier = [], [], [], [(-1, 0.0)]
        for _ in range(depth):
            level = []
            for parent, score in frontier:
                logq = torch.log_softmax(torch.randn(topk + 4, generator=generator) * 2, -1)
                logq = logq.sort(descending=True).values[:topk]
                for t in range(topk):
                    level.append((len(row_tokens), score + float(logq[t])))
                    row_tokens.append(0)  # token ids are drawn later, per vocabulary
                    row_scores.append(score + float(logq[t]))
                    row_parents.append(parent)
            level.sort(key=lambda item: (-item[1], item[0]))
            frontier = level[:topk]
        tokens.append(row_tokens)
        scores.append(row_scores)
        parents.append(row_parents)
    return (torch.tensor(tokens), torch.tensor(scores, dtype=torch.float32),
            torch.tensor(parents, dtype=torch.int32), torch.zeros(batch, dtype=torch.int64))


def make_inputs(batch: int, num_nodes: int, vocab: int, buffer: torch.Tensor,
                seed: int = 0) -> BenchInputs:
    """Logits view into a shared random buffer; at each node the target strongly prefers its
    first child's token 80% of the time, so walks accept 2-3 tokens, as trained drafters do."""
    g = torch.Generator().manual_seed(seed)
    candidates = eagle_candidates(batch, num_nodes, g)
    tree = ops.select_tree(*candidates, num_nodes=num_nodes)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=g)
    tokens[:, 0] = 0
    logits = buffer[: batch * num_nodes * vocab].view(batch, num_nodes, vocab).clone()
    for b in range(batch):
        for node in range(num_nodes):
            kids = (tree.parents[b] == node).nonzero().flatten()
            if len(kids) and float(torch.rand(1, generator=g)) < 0.8:
                logits[b, node, tokens[b, int(kids[0])]] = 12.0
    uniforms = torch.rand(batch, num_nodes, generator=g)
    return BenchInputs(logits, tokens, tree.parents, uniforms, candidates)


def median_seconds(fn: Callable[[], object], min_time: float, max_reps: int,
                   untimed_first: bool = True, cuda: bool = False) -> float:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if untimed_first:
        fn()  # one-time costs: thread pool, scratch buffers, CUDA context
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (not times or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def on_device(inputs: BenchInputs, device: str) -> BenchInputs:
    return BenchInputs(*(t.to(device) for t in (inputs.logits, inputs.tokens, inputs.parents,
                                                inputs.uniforms)),
                       tuple(t.to(device) for t in inputs.candidates))


def compaction_problem(x: BenchInputs) -> tuple:
    """(cache, accept_index, num_accepted, cache_len) for the compaction benchmark, from the
    greedy verification of the case's tree."""
    B, N = x.tokens.shape
    out = ops.verify_tree_greedy(x.logits, x.tokens, x.parents)
    cache = torch.zeros(CACHE_LAYERS, 2, B, CACHE_HEADS, CACHE_PREFIX + N, CACHE_HEAD_DIM,
                        dtype=torch.bfloat16, device=x.logits.device)
    cache_len = torch.full((B,), CACHE_PREFIX, dtype=torch.int32, device=x.logits.device)
    return cache, out.accept_index, out.num_accepted, cache_len


def fused_call(op: str, x: BenchInputs) -> Callable[[], ops.VerifyOutput]:
    if op == "verify_tree_sampling":
        return lambda: ops.verify_tree_sampling(
            x.logits, x.tokens, x.parents, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
            uniforms=x.uniforms, validate=False)
    if op == "verify_tree_greedy":
        return lambda: ops.verify_tree_greedy(x.logits, x.tokens, x.parents, validate=False)
    if op == "select_tree":
        return lambda: ops.select_tree(*x.candidates, num_nodes=x.tokens.shape[1])
    if op == "tree_metadata":
        return lambda: ops.tree_metadata(x.parents)
    if op == "compact_kv_":
        problem = compaction_problem(x)
        return lambda: ops.compact_kv_(*problem)
    raise ValueError(f"op: unknown kernel benchmark {op!r}")


def reference_call(op: str, x: BenchInputs) -> Callable[[], object]:
    if op == "verify_tree_sampling":
        return lambda: reference.verify_tree_sampling(x.logits, x.tokens, x.parents, TEMPERATURE,
                                                      TOP_K, TOP_P, x.uniforms)
    if op == "select_tree":
        return lambda: reference.select_tree(*x.candidates, x.tokens.shape[1])
    if op == "tree_metadata":
        return lambda: reference.tree_metadata(x.parents)
    if op == "compact_kv_":
        cache, accept_index, num_accepted, cache_len = compaction_problem(x)
        planes = cache.view(-1, *cache.shape[2:])  # reference layout (P, B, G, T, E)
        return lambda: reference.compact_kv_(planes, accept_index, num_accepted, cache_len)
    return lambda: reference.verify_tree_greedy(x.logits, x.tokens, x.parents)


def time_case(op: str, inputs: BenchInputs, reference_reps: int, device: str = "cpu",
              baseline: str = "reference") -> KernelCase:
    """The fused kernel runs on `device`; the baseline on the CPU: the PyTorch reference (the
    oracle) or, with baseline="cpu_fused", our own CPU kernel (GPU-vs-CPU ratios)."""
    fast = on_device(inputs, device)
    fused = fused_call(op, fast)
    if baseline == "reference":
        slow = reference_call(op, inputs)
    elif baseline == "cpu_fused":
        slow = fused_call(op, inputs)
    else:
        raise ValueError(f"baseline: expected 'reference' or 'cpu_fused', got {baseline!r}")
    accepted = float(fused_call("verify_tree_greedy", fast)().num_accepted.float().mean())
    fused_s = median_seconds(fused, min_time=0.3, max_reps=50, cuda=device == "cuda")
    if baseline == "reference":
        # `reference_reps` runs, none untimed: the reference takes seconds on large cases.
        reference_s = median_seconds(slow, min_time=0.0, max_reps=reference_reps,
                                     untimed_first=False)
    else:
        reference_s = median_seconds(slow, min_time=0.3, max_reps=50)
    B, N, V = inputs.logits.shape
    V = 0 if op in TREE_OPS else V
    return KernelCase(op, B, N, V, fused_s * 1e6, reference_s * 1e6, reference_s / fused_s,
                      accepted, device, baseline)


def cases(batches: Iterable[int], nodes: Iterable[int], vocabs: Iterable[int]):
    for V in vocabs:
        for B in batches:
            for N in nodes:
                if B * N * V * 4 <= LOGITS_LIMIT_BYTES:
                    yield B, N, V


def run(ops_to_time: Iterable[str] = ("verify_tree_sampling", "verify_tree_greedy") + TREE_OPS,
        batches: Iterable[int] = BATCHES, nodes: Iterable[int] = NODES,
        vocabs: Iterable[int] = VOCABS, reference_reps: int = 1, progress: bool = True,
        device: str = "cpu", baseline: str = "reference") -> list[KernelCase]:
    plan = list(cases(batches, nodes, vocabs))
    ops_to_time = list(ops_to_time)
    results = []
    timed_tree_shapes = set()
    bar = tqdm(total=len(plan) * len(ops_to_time), disable=not progress, unit="case")
    buffers: dict[int, torch.Tensor] = {}
    for B, N, V in plan:
        if V not in buffers:
            largest = max(b * n for b, n, v in plan if v == V)
            buffers = {V: torch.randn(largest * V, generator=torch.Generator().manual_seed(V)) * 2}
        inputs = make_inputs(B, N, V, buffers[V], seed=B * 1000 + N)
        for op in ops_to_time:
            bar.update()
            if op in TREE_OPS and (op, B, N) in timed_tree_shapes:
                continue
            timed_tree_shapes.add((op, B, N))
            bar.set_description(f"{op} B={B} N={N} V={V}")
            results.append(time_case(op, inputs, reference_reps, device, baseline))
    bar.close()
    return results


def as_rows(results: list[KernelCase]) -> list[dict]:
    return [asdict(r) for r in results]


def format_table(results: list[KernelCase]) -> str:
    baseline = results[0].baseline if results else "reference"
    lines = [f"{'op':<22}{'B':>4}{'N':>4}{'V':>8}{'fused_us':>12}{baseline + '_us':>14}"
             f"{'speedup':>9}{'accepted':>9}"]
    for r in results:
        lines.append(f"{r.op:<22}{r.B:>4}{r.N:>4}{r.V:>8}{r.fused_us:>12.1f}"
                     f"{r.reference_us:>14.1f}{r.speedup:>8.1f}x{r.mean_accepted:>9.2f}")
    return "\n".join(lines)
