"""A drafting level's sampling on the CPU: the one kernel call (tlt_core.ops.sample_draft,
what `sampled_chain.draw` runs on the CPU) against the same math in tensor ops
(`sampled_chain.draw_tensor_ops`, what a GPU's captured level runs), side by side in one run:

    python bench/draft_sample.py --json bench/results/draft_sample_avx2_cpu.json

Each case: B rows of R nodes, float32 drafter logits over V' draft tokens spread over V target
ids, one draw per node, temperature 1 (half the rows greedy with --greedy). Both sides write
the (B, R, V) q the verifier reads and return the ids; they draw the same ids (checked). Times
are medians of --repeats calls, alternating the two sides."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tlt_core.drafting import sampled_chain


class _Drafter:
    """What draw reads of a drafter: its draft-to-target map."""

    def __init__(self, draft_to_target: torch.Tensor):
        self.draft_to_target = draft_to_target

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[index]


def run_case(batch: int, nodes: int, draft_vocab: int, vocab: int, greedy_rows: bool,
             repeats: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    drafter = _Drafter(torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values)
    logits = torch.randn(batch, nodes, draft_vocab, generator=g) * 3
    uniforms = torch.rand(batch, nodes + 1, generator=g)[:, 1:, None]  # a level's column view
    greedy = torch.arange(batch) % 2 == 1 if greedy_rows else torch.zeros(batch, dtype=torch.bool)
    scale = torch.ones(batch)
    outs = [torch.empty(batch, nodes, vocab) for _ in range(2)]
    sides = [lambda: sampled_chain.draw(drafter, logits, uniforms, greedy, scale, outs[0]),
             lambda: sampled_chain.draw_tensor_ops(drafter, logits, uniforms, greedy, scale,
                                                   outs[1])]
    same_ids = torch.equal(sides[0](), sides[1]())
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for side, call in enumerate(sides):
            start = time.perf_counter()
            call()
            times[side].append(time.perf_counter() - start)
    kernel_ms, tensor_ops_ms = (1e3 * statistics.median(t) for t in times)
    return {"B": batch, "R": nodes, "V_draft": draft_vocab, "V": vocab, "greedy_rows": greedy_rows,
            "kernel_ms": kernel_ms, "tensor_ops_ms": tensor_ops_ms,
            "speedup": tensor_ops_ms / kernel_ms, "same_ids": same_ids,
            "q_max_abs_diff": float((outs[0] - outs[1]).abs().max())}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=_ints, default=[1, 4, 16], help="B values")
    parser.add_argument("--nodes", type=_ints, default=[1, 4], help="R values (nodes a row)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="V' (SmolLM2's drafter)")
    parser.add_argument("--vocab", type=int, default=49152, help="V (SmolLM2's)")
    parser.add_argument("--greedy", action="store_true", help="every other row greedy")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls a side")
    parser.add_argument("--json", type=Path, help="write {config, rows} here")
    args = parser.parse_args(argv)
    if not 1 <= args.draft_vocab <= args.vocab or args.repeats < 1:
        parser.error("need 1 <= --draft-vocab <= --vocab and --repeats >= 1")
    rows = [run_case(b, r, args.draft_vocab, args.vocab, args.greedy, args.repeats)
            for b in args.batch for r in args.nodes]
    print(f"{'B':>3} {'R':>2} {'kernel ms':>9} {'tensor ops ms':>13} {'speedup':>7} same ids")
    for row in rows:
        print(f"{row['B']:3d} {row['R']:2d} {row['kernel_ms']:9.3f} {row['tensor_ops_ms']:13.3f} "
              f"{row['speedup']:6.2f}x {row['same_ids']}")
    if args.json:
        config = {"draft_vocab": args.draft_vocab, "vocab": args.vocab, "greedy": args.greedy,
                  "repeats": args.repeats, "torch": torch.__version__}
        args.json.write_text(json.dumps({"config": config, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
