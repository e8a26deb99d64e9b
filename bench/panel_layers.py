"""The panel products alone on SmolLM2-135M's layer shapes (30 layers of q|k|v 960x576, o
576x576, gate|up 3072x576, down 576x1536; random weights, cold in cache each call), float32
against bfloat16 at each row count, best of 5 passes over all 120 matrices:

    python bench/panel_layers.py --rows 1,3,5,8,16,32

The evidence behind the kernel figures in docs/results.md and csrc/panel_matmul_cpu.cpp."""

from __future__ import annotations

import argparse
import time

import torch

from tlt_core.ops import pack_panels
from tlt_core.ops.panel_matmul import launch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def pass_ms(dtype: torch.dtype, rows: int, reps: int = 5) -> float:
    panels = [pack_panels(torch.randn(n, k).to(dtype)) for n, k in SHAPES]
    xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
    outs = [torch.empty(rows, n, dtype=dtype) for n, _ in SHAPES]
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for (n, k), packed, out in zip(SHAPES, panels, outs):
            launch(xs[k], packed, n, None, None, out)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,3,5,8,16,32", help="row counts, comma-separated")
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        f32, bf16 = pass_ms(torch.float32, rows), pass_ms(torch.bfloat16, rows)
        print(f"{rows:>4} rows: float32 {f32:6.2f} ms  bfloat16 {bf16:6.2f} ms  "
              f"({f32 / bf16:.2f}x)")


if __name__ == "__main__":
    main()
