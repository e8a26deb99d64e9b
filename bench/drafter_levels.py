"""Each drafter's expected sampled acceptance per drafting level at T = 1, on the same fresh
responses of the model, side by side: the comparison of drafter objectives without sampling
noise (`tlt drafter train --rejection-weight`).

    python bench/drafter_levels.py --model DIR --drafter A --drafter B --prompts 24 \
        --json bench/results/drafter_levels_....json

The model answers `--prompts` arithmetic word problems no drafter was trained on (`tlt data
arithmetic`'s of --seed: 1 by default, for drafters trained on seed 0's; choose another for a
drafter that saw seed 1's) at T = 1, one pass over the answers keeps its hidden states, and
every drafter then drafts from every response position teacher-forced for level 1 and from
its own outputs for the levels after (the unrolled pass drafting runs,
tlt_core.drafting.unrolled). A level's number is the mean over positions of
sum_x min(p(x), q(x)), p the model's distribution of the token and q the drafter's: the
probability that the sampled check accepts a token drafted from q, given the levels before it
were accepted. A chain's acceptance length follows roughly as 1 + a1 + a1 a2 + ...; unlike
`tlt bench speculative`'s acceptance, these have no sampling noise for a given set of responses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.training import collect_records
from tlt_core.drafting.unrolled import unrolled_forward
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.prompt_format import load_prompt_format
from tlt_core.tasks.arithmetic_problems import generate_problems
from tlt_core.warmup.work_folder import IMPLIED_SETTINGS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True,
                        help="a Hugging Face checkpoint folder")
    parser.add_argument("--drafter", type=Path, action="append", required=True,
                        help="a drafter folder for --model; repeat to compare several")
    parser.add_argument("--prompts", type=int, default=24, help="fresh problems answered")
    parser.add_argument("--seed", type=int, default=1,
                        help="which problems: a seed no drafter was trained on")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest response")
    parser.add_argument("--levels", type=int, default=3, help="drafting levels measured")
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.prompts < 1 or args.levels < 1:
        parser.error("--prompts and --levels must be >= 1")

    target = load_checkpoint(args.model, dtype=args.dtype).eval()
    prompt_format = load_prompt_format(args.model)
    prompts = [prompt_format.encode(row["question"])
               for row in generate_problems(args.prompts, args.seed)]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                            stop_ids=tuple(prompt_format.tokenizer.eos_ids))
    engine = RolloutEngine(target, EngineConfig(max_batch=len(prompts), max_len=max(map(
        len, prompts)) + args.max_tokens, seed=args.seed))
    rollouts = engine.generate([Request(p, params) for p in prompts]).rollouts
    sequences = [list(r.prompt_ids) + r.tokens.tolist() for r in rollouts]
    records_by_layers = {}  # feature layers -> records, one target pass per layer set
    rows = []
    with torch.no_grad():
        for folder in args.drafter:
            drafter = Drafter.load(folder, target).eval()
            layers = tuple(drafter.config.feature_layers)
            if layers not in records_by_layers:
                records_by_layers[layers] = collect_records(target, sequences, layers)
            records = records_by_layers[layers]
            accepted = [[] for _ in range(args.levels)]
            for record, prompt in tqdm(list(zip(records, prompts)), desc=folder.name):
                for level, values in enumerate(level_acceptance(
                        target, drafter, record, len(prompt), args.levels)):
                    accepted[level] += values
            rows.append({"drafter": str(folder), "model": args.model.name, "dtype": args.dtype,
                         "temperature": 1.0, "prompts": args.prompts, "seed": args.seed,
                         "positions": len(accepted[0]),
                         "rejection_weight": _rejection_weight(folder),
                         **{f"level{k + 1}": round(sum(v) / len(v), 4)
                            for k, v in enumerate(accepted)}})
    for row in rows:
        print(json.dumps(row))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def level_acceptance(target, drafter: Drafter, record, prompt_length: int, levels: int
                     ) -> list[list[float]]:
    """sum_x min(p, q) at every response root t (t >= prompt_length - 1, as the warm-up scores
    them) for levels 1..`levels`: level k drafts from root t's pair and guesses x_{t+k+1}; a
    root counts while the model's distribution of that token exists (t + k < the record's
    length)."""
    tokens = record.tokens[None].to(target.lm_head.weight.device)
    T, dtype = tokens.shape[1], target.lm_head.weight.dtype
    features = drafter.features(record.features[None, :-1].to(dtype).unbind(dim=2))
    outputs = unrolled_forward(drafter, tokens, features, levels)
    hidden = target.model.norm(record.last_hidden.to(dtype))
    p = torch.softmax(target.lm_head(hidden).float(), -1)  # (T, V): x_{t+1} given x_<=t
    accepted = []
    for level, output in enumerate(outputs, start=1):
        q = torch.softmax(drafter.logits(output[0]), -1)  # (T-1, V'): x_{t+level+1}
        full = q.new_zeros(q.shape[0], p.shape[1])
        full[:, drafter.to_target_ids(torch.arange(q.shape[1]))] = q
        roots = list(range(max(prompt_length - 1, 0), T - level))
        accepted.append(torch.minimum(p[[t + level for t in roots]], full[roots])
                        .sum(-1).tolist())
    return accepted


def _rejection_weight(folder: Path) -> float | None:
    """The warm-up's rejection weight (a warm-up record without one trained EAGLE's loss
    alone: tlt_core.warmup.work_folder.IMPLIED_SETTINGS); None for a drafter not trained by
    the warm-up."""
    offline = json.loads((folder / "drafter_config.json").read_text()).get(
        "metadata", {}).get("offline")
    if offline is None:
        return None
    return offline.get("rejection_weight", IMPLIED_SETTINGS["rejection_weight"])


if __name__ == "__main__":
    main()
