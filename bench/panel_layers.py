"""The products of a decode step alone, on SmolLM2-135M's layer shapes (30 layers of q|k|v
960x576, o 576x576, gate|up 3072x576, down 576x1536; random weights, cold in cache each call),
every product this CPU has side by side at each row count, best of 5 passes over all 120
matrices, interleaved:

    python bench/panel_layers.py --rows 1,2,3,4,8,16,32 --json bench/results/panel_layers.json

- float32 panels and bfloat16 panels (the AVX2 chain, a bfloat16 weight widened on load);
- bfloat16 pairs (AVX512-BF16's dot product; only where the CPU has it);
- oneDNN's prepacked bfloat16 product (`_linear_pointwise`, the "onednn" layout; where torch's
  oneDNN multiplies bfloat16 on this CPU).

Each row gives milliseconds per pass, the bytes of weights read per second, and each product's
speed relative to oneDNN's (or to the bfloat16 panels where oneDNN has no bfloat16 product).
The evidence behind the kernel figures in docs/results.md, csrc/panel_matmul_cpu.cpp and
tlt_core/model/weight_layout.py."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tlt_core.model.weight_layout import onednn_supports
from tlt_core.ops.panel_matmul import launch, pack_panels, pairs_vectorised

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def products(rows: int) -> dict:
    """name -> a function running one pass of that product over SHAPES at `rows` rows."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    found = {}
    for dtype, name in ((torch.float32, "float32 panels"), (torch.bfloat16, "bf16 panels")):
        found[name] = _panel_pass([pack_panels(w.to(dtype)) for w in weights], rows, dtype)
    if pairs_vectorised():
        found["bf16 pairs"] = _panel_pass(
            [pack_panels(w.bfloat16(), pairs=True) for w in weights], rows, torch.bfloat16)
    if onednn_supports(torch.bfloat16):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in weights]
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}

        def onednn():
            for (_, k), matrix in zip(SHAPES, packed):
                torch.ops.mkldnn._linear_pointwise(xs[k], matrix, None, "none", [], "")
        found["bf16 oneDNN"] = onednn
    return found


def _panel_pass(panels: list[torch.Tensor], rows: int, dtype: torch.dtype):
    xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
    outs = [torch.empty(rows, n, dtype=dtype) for n, _ in SHAPES]

    def run():
        for (n, k), packed, out in zip(SHAPES, panels, outs):
            launch(xs[k], packed, n, None, None, out)
    return run


def measure(rows: int, reps: int) -> dict:
    """Best-of-`reps` milliseconds per pass of each product, the products interleaved."""
    found = products(rows)
    best = {name: float("inf") for name in found}
    for _ in range(reps):
        for name, run in found.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    weight_bytes = sum(n * k for n, k in SHAPES)  # per byte of element: scaled below
    baseline = "bf16 oneDNN" if "bf16 oneDNN" in best else "bf16 panels"
    row = {"rows": rows, "baseline": baseline, "products": {}}
    for name, seconds in best.items():
        element = 4 if name.startswith("float32") else 2
        row["products"][name] = {
            "ms": round(seconds * 1e3, 3),
            "weights_gb_per_s": round(weight_bytes * element / seconds / 1e9, 1),
            "speedup_vs_baseline": round(best[baseline] / seconds, 3)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,8,16,32", help="row counts, comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="passes per product (the best is kept)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    for count in (int(r) for r in args.rows.split(",")):
        row = measure(count, args.reps)
        rows.append(row)
        print(f"{count:>4} rows: " + "  ".join(
            f"{name} {p['ms']:6.2f} ms ({p['speedup_vs_baseline']:.2f}x)"
            for name, p in row["products"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bench": "panel_layers", "shapes": "SmolLM2-135M's 30 layers",
                       "cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
