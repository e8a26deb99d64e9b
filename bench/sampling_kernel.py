"""The fused sampling verifier (tlt_core.ops.verify_tree_sampling) against the usual PyTorch
recipe, side by side in one run:

    python bench/sampling_kernel.py --device cuda --json sampling_kernel_cuda.json
    python bench/sampling_kernel.py --device cpu --vocab 4096

Each case is a batch of B rows, each a chain of N nodes (the root and N - 1 deterministic draft
tokens), bfloat16 target logits (B, N, V) at every node, temperature 0.7, top-p 0.9, top-k off;
B in {1, 4, 16, 64}, N in {1, 4}, V = 152,064 (Qwen2's vocabulary) on cuda and 4,096 on cpu.
At 80% of the nodes the target strongly prefers the next draft token, so walks accept about as
far as a trained drafter's do (`accepted` in each row).

ours      ops.verify_tree_sampling(validate=False): the fused kernel, no host syncs.
portable  (cpu) the same kernel with isa="portable": its scalar loops over V instead of the
          AVX2 passes, so `portable_ratio` is what those passes gain.
baseline  the PyTorch recipe, vectorised over every node of the chain: logits / T in float32,
          top-k by torch.topk (when set), softmax, top-p by sort + cumsum with renormalisation,
          the rejection test u < p(x) of each draft token, the accepted prefix, the residual at
          the first rejection (p without the rejected token, renormalised) and torch.multinomial
          for the final token. Same acceptance rule as ours (`baseline_accepted` checks it).

Timing: after --warmup calls, the median of --repeats, by CUDA events on cuda and
time.perf_counter on cpu. Modes: eager (each call dispatched from Python: includes the
wrapper's and PyTorch's per-op launch costs) and, on cuda, graph (each side captured once in a
CUDA graph and replayed: GPU time alone, as a captured rollout step runs it).
Each row: device, mode, dtype, B, N, V, ours_ms, baseline_ms, ratio (baseline_ms / ours_ms),
portable_ms and portable_ratio (portable_ms / ours_ms; null on cuda), accepted and
baseline_accepted (mean draft tokens accepted per row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

import tlt_core.ops as ops

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Settings:
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class ChainInputs:
    logits: torch.Tensor  # (B, N, V) the target's logits at each node
    tokens: torch.Tensor  # (B, N) int64: root, then the draft tokens
    parents: torch.Tensor  # (B, N) int32: a chain, parents[:, i] = i - 1
    uniforms: torch.Tensor  # (B, N) float32: u[:, i] tests draft i, u[:, 0] draws the final token


@dataclass(frozen=True)
class Row:
    device: str
    mode: str  # eager | graph
    dtype: str
    B: int
    N: int
    V: int
    ours_ms: float
    baseline_ms: float
    ratio: float  # baseline_ms / ours_ms
    portable_ms: float | None  # the CPU kernel's scalar loops (None on cuda)
    portable_ratio: float | None  # portable_ms / ours_ms
    accepted: float  # mean draft tokens our kernel accepted per row
    baseline_accepted: float


def make_chain_inputs(batch: int, nodes: int, vocab: int, dtype: torch.dtype,
                      device: torch.device, seed: int) -> ChainInputs:
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, nodes, vocab, generator=g, device=device) * 2.0  # (B, N, V)
    tokens = torch.randint(0, vocab, (batch, nodes), generator=g, device=device)  # (B, N)
    tokens[:, 0] = 0
    rows = torch.arange(batch, device=device)
    for node in range(nodes - 1):
        prefer = torch.rand(batch, generator=g, device=device) < 0.8  # (B,)
        logits[rows[prefer], node, tokens[prefer, node + 1]] = 12.0
    parents = (torch.arange(nodes, device=device, dtype=torch.int32) - 1).expand(batch, nodes)
    uniforms = torch.rand(batch, nodes, generator=g, device=device)  # (B, N)
    return ChainInputs(logits.to(dtype), tokens, parents.contiguous(), uniforms)


def ours(x: ChainInputs, s: Settings, isa: str = "auto") -> ops.VerifyOutput:
    return ops.verify_tree_sampling(x.logits, x.tokens, x.parents, temperature=s.temperature,
                                    top_k=s.top_k, top_p=s.top_p, uniforms=x.uniforms,
                                    validate=False, isa=isa)


def baseline(x: ChainInputs, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted (B,), final token (B,)) from the PyTorch recipe (module docstring)."""
    B, N, _ = x.logits.shape
    z = x.logits.float() / s.temperature  # (B, N, V)
    if s.top_k > 0:
        kth = z.topk(s.top_k, dim=-1).values[..., -1:]  # (B, N, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)  # (B, N, V)
    if s.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, N, V)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, N, V)
        sorted_probs = sorted_probs.masked_fill(mass_before >= s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    rows = torch.arange(B, device=probs.device)
    if N == 1:
        num_accepted = torch.zeros(B, dtype=torch.int64, device=probs.device)  # (B,)
        final_probs = probs[:, 0]  # (B, V)
    else:
        drafts = x.tokens[:, 1:]  # (B, N - 1)
        p_draft = probs[:, :-1].gather(-1, drafts[..., None])[..., 0]  # (B, N - 1)
        accept = x.uniforms[:, 1:] < p_draft  # (B, N - 1)
        num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # (B,)
        final_probs = probs[rows, num_accepted]  # (B, V)
        rejected = num_accepted < N - 1  # (B,)
        rejected_token = drafts.gather(-1, num_accepted.clamp(max=N - 2)[:, None])  # (B, 1)
        residual = final_probs.scatter(-1, rejected_token, 0.0)  # (B, V)
        final_probs = torch.where(rejected[:, None], residual, final_probs)
    final_probs = final_probs / final_probs.sum(dim=-1, keepdim=True)
    return num_accepted, torch.multinomial(final_probs, 1)[:, 0]


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured once in a CUDA graph (after warm-up on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def median_ms(fn: Callable[[], object], cuda: bool, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(batch: int, nodes: int, args: argparse.Namespace, settings: Settings) -> list[Row]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    x = make_chain_inputs(batch, nodes, args.vocab, DTYPES[args.dtype], device, args.seed)
    accepted = float(ours(x, settings).num_accepted.float().mean())
    baseline_accepted = float(baseline(x, settings)[0].float().mean())
    rows = []
    for mode in args.modes:
        ours_fn = lambda: ours(x, settings)  # noqa: E731
        baseline_fn = lambda: baseline(x, settings)  # noqa: E731
        if mode == "graph":
            ours_fn, baseline_fn = graphed(ours_fn), graphed(baseline_fn)
        ours_ms = median_ms(ours_fn, cuda, args.warmup, args.repeats)
        baseline_ms = median_ms(baseline_fn, cuda, args.warmup, args.repeats)
        portable_ms = None if cuda else median_ms(lambda: ours(x, settings, "portable"), cuda,
                                                  args.warmup, args.repeats)
        rows.append(Row(device.type, mode, args.dtype, batch, nodes, args.vocab, ours_ms,
                        baseline_ms, baseline_ms / ours_ms, portable_ms,
                        None if cuda else portable_ms / ours_ms, accepted, baseline_accepted))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [f"{'device':6} {'mode':5} {'B':>3} {'N':>2} {'V':>7} {'ours_ms':>9} "
             f"{'baseline_ms':>11} {'ratio':>7} {'portable_ms':>11} {'ratio':>7} "
             f"{'accepted':>8}"]
    for r in rows:
        portable = ("-" * 11 + " " + "-" * 7 if r.portable_ms is None
                    else f"{r.portable_ms:11.3f} {r.portable_ratio:7.2f}")
        lines.append(f"{r.device:6} {r.mode:5} {r.B:3d} {r.N:2d} {r.V:7d} {r.ours_ms:9.3f} "
                     f"{r.baseline_ms:11.3f} {r.ratio:7.2f} {portable} {r.accepted:8.2f}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, help="V (default 152064 on cuda, 4096 on cpu)")
    parser.add_argument("--batch", type=_int_list, default=[1, 4, 16, 64], help="B values")
    parser.add_argument("--nodes", type=_int_list, default=[1, 4], help="chain lengths N")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=0.9, help="1.0: off")
    parser.add_argument("--modes", default=None,
                        help="comma-separated eager,graph (default: both on cuda, eager on cpu)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, help="timed calls per side (default 30 cuda, 5 cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write {config, rows} here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if cuda and not ops.built_with_cuda:
        parser.error("--device cuda: tlt_core._C was built without the CUDA kernels")
    args.vocab = args.vocab or (152064 if cuda else 4096)
    if args.vocab < 2:
        parser.error("--vocab: must be >= 2")
    args.modes = (args.modes or ("eager,graph" if cuda else "eager")).split(",")
    if any(m not in ("eager", "graph") for m in args.modes) or (
            not cuda and "graph" in args.modes):
        parser.error("--modes: eager and graph (graph needs --device cuda)")
    if not 0.0 < args.temperature or not 0.0 < args.top_p <= 1.0 or args.top_k < 0:
        parser.error("--temperature must be > 0, --top-p in (0, 1], --top-k >= 0")
    args.repeats = args.repeats or (30 if cuda else 5)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings(args.temperature, args.top_k, args.top_p)
    rows = [row for batch in args.batch for nodes in args.nodes
            for row in run_case(batch, nodes, args, settings)]
    print(format_table(rows))
    if args.json is not None:
        config = {"device": args.device, "vocab": args.vocab, "dtype": args.dtype,
                  "settings": asdict(settings), "warmup": args.warmup, "repeats": args.repeats,
                  "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
        args.json.write_text(json.dumps({"config": config, "rows": [asdict(r) for r in rows]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
