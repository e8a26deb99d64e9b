"""One drafter training step with the loss's matmuls in float32 against bf16 under autocast
(`tlt drafter train --matmul-dtype`), side by side in one process: the evidence behind
OfflineConfig.matmul_dtype's "auto".

    python bench/drafter_step.py --model DIR --batch-tokens 4096 --reps 3

A fresh drafter over the checkpoint widened to float32 (as the warm-up trains it), the
target's draft vocabulary stand-in (--draft-vocab random ids), one batch of random token ids
and feature-scale random hidden states (a step's cost does not depend on their values). The two
precisions alternate rep by rep, each on its own optimizer; the best time of each is printed
with their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.training import DraftBatch, make_optimizer, train_step
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.warmup.training_loop import float32_twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--batch-tokens", type=int, default=4096,
                        help="positions in the batch (rows of 256)")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    twin = float32_twin(load_checkpoint(args.model, dtype="bfloat16"))
    ids = torch.randperm(twin.config.vocab_size)[:args.draft_vocab].sort().values
    rows, width, hidden = max(1, args.batch_tokens // 256), 256, twin.config.hidden_size
    batch = DraftBatch(torch.randint(0, twin.config.vocab_size, (rows, width)),
                       torch.randn(rows, width, 1, hidden), torch.randn(rows, width, hidden),
                       torch.ones(rows, width - 1, dtype=torch.bool))
    runs = {"float32": None, "bfloat16": torch.bfloat16}
    drafters = {name: Drafter(twin, DrafterConfig((-1,), "eagle", args.draft_vocab), ids)
                for name in runs}
    optimizers = {name: make_optimizer(drafter, 1e-3) for name, drafter in drafters.items()}
    best = dict.fromkeys(runs, float("inf"))
    for rep in range(args.reps + 1):  # the first rep is untimed: first-call costs
        for name, dtype in runs.items():
            start = time.perf_counter()
            train_step(drafters[name], optimizers[name], batch, matmul_dtype=dtype)
            if rep:
                best[name] = min(best[name], time.perf_counter() - start)
    print(f"drafter training step, {rows * width} positions, draft vocabulary "
          f"{args.draft_vocab}: float32 matmuls {best['float32']:.2f} s, bf16 matmuls "
          f"{best['bfloat16']:.2f} s ({best['float32'] / best['bfloat16']:.2f}x)")


if __name__ == "__main__":
    main()
