"""Exporting a drafter trained by tlt_core for vLLM and SGLang, on the CPU, and checking that the
export is the drafter: read back, it drafts and rolls out exactly what the drafter did.

    python examples/export_for_vllm.py                       # the embedded model's drafter
    python examples/export_for_vllm.py --out exports/        # keep the folders
    python examples/export_for_vllm.py --drafter DIR --target DIR   # yours, or a published
                                                                    # EAGLE-3 drafter

What it proves (each is an assert; the script exits non-zero when one fails):

1. The embedded model's drafter (a tlt_core EAGLE-1 drafter, the one `tlt train` spot-trains)
   exports to the EAGLE-1 layout (`--to eagle`): config.json lists the architecture names
   vLLM's and SGLang's model registries map to their EAGLE drafters, and every file is mode
   0644.
2. The same drafter over a reduced draft vocabulary (the V' token ids the task's reference
   responses use most, FR-Spec's choice and `tlt drafter train --draft-vocab`'s) exports with
   speculative_token_map.pt, SGLang's `--speculative-token-map` (vLLM has no such option: it
   serves the same folder drafting over the whole vocabulary, still lossless, but other drafts).
3. Each export, read back with `load_drafter` (what every `--drafter` flag uses), rolls out
   the same tokens with the same acceptance length as the drafter it came from (greedy, a
   (5, 1, 6) chain, held-out task problems).
4. With `--drafter` naming a published EAGLE-3 drafter (SpecForge, SGLang, vLLM or
   speculators layout), it exports to `--to eagle3` and `--to speculators` (with d2t/t2d for
   its reduced vocabulary) and both read back as the same drafter, checked the same way.

It prints the commands that serve each export. The embedded target is a Llama checkpoint
folder, so vLLM and SGLang load it as they load any Llama; the drafters' math is what their
EAGLE and EAGLE-3 models run (docs/export.md).
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.drafting.export import export_drafter, load_drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.embedded.workload import load_embedded
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint

PROBLEMS, SEED = 8, 777  # held-out problems of the embedded task
DRAFT_VOCAB = 16  # V' of the reduced-vocabulary drafter
STRATEGY = Strategy(5, 1, 6)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Export a drafter for vLLM and SGLang and prove the export is the drafter.")
    parser.add_argument("--out", type=Path, help="folder for the exports (default: a temporary "
                                                 "one, removed at the end)")
    parser.add_argument("--drafter", type=Path, help="a drafter folder any --drafter flag reads "
                                                     "(default: the embedded drafter)")
    parser.add_argument("--target", type=Path, help="its target, a Hugging Face checkpoint "
                                                    "folder (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens per rollout")
    return parser.parse_args(argv)


def reduced_vocabulary_drafter(drafter: Drafter, responses: list[list[int]]) -> Drafter:
    """`drafter` scoring only the DRAFT_VOCAB token ids the responses use most."""
    counts = Counter(token for response in responses for token in response)
    ids = sorted(token for token, _ in counts.most_common(DRAFT_VOCAB))
    reduced = Drafter(drafter.target, DrafterConfig(form="eagle", draft_vocab=len(ids)), ids)
    state = {**drafter.state_dict(), "draft_to_target": reduced.draft_to_target}
    reduced.load_state_dict(state)
    return reduced.eval()


def rollouts(target, drafter, requests) -> tuple[list[list[int]], float]:
    """(tokens of each rollout, acceptance length): greedy, speculative with STRATEGY."""
    max_len = max(len(r.prompt_ids) for r in requests) + requests[0].params.max_tokens
    engine = RolloutEngine(target, EngineConfig(max_batch=len(requests), max_len=max_len),
                           drafter)
    result = engine.generate(requests, strategy=STRATEGY)
    return [r.tokens.tolist() for r in result.rollouts], result.acceptance_length


def export_and_check(drafter, to: str, out: Path, target, requests, target_path: str) -> dict:
    """Exports `drafter` to `out` in layout `to`, asserts every file is 0644 and that the
    export read back rolls out the drafter's tokens; returns what it found."""
    folder = export_drafter(drafter, out, to, {"rl_step": None, "acceptance_length": None,
                                               "target_name_or_path": target_path})
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    again = load_drafter(folder, target).eval()
    tokens, acceptance = rollouts(target, drafter, requests)
    tokens_again, acceptance_again = rollouts(target, again, requests)
    assert tokens == tokens_again, f"{to}: the export rolls out other tokens"
    assert acceptance == acceptance_again, f"{to}: {acceptance} != {acceptance_again}"
    config = json.loads((folder / "config.json").read_text())
    return {"folder": str(folder), "files": sorted(modes), "acceptance_length": acceptance,
            "architectures": config.get("architectures")}


def serve_commands(to: str, folder: str, target_path: str) -> list[str]:
    method = "eagle" if to == "eagle" else "eagle3"
    vllm = (f"vllm serve {target_path} --speculative-config "
            f"'{{\"method\": \"{method}\", \"model\": \"{folder}\", "
            f"\"num_speculative_tokens\": {STRATEGY.depth}}}'")
    if to == "speculators":  # vLLM reads the speculative config from the export itself
        return [vllm, f"vllm serve {folder}"]
    sglang = (f"python -m sglang.launch_server --model-path {target_path} "
              f"--speculative-algorithm {method.upper()} --speculative-draft-model-path {folder} "
              f"--speculative-num-steps {STRATEGY.depth} --speculative-eagle-topk 1 "
              f"--speculative-num-draft-tokens {STRATEGY.depth + 1}")
    token_map = Path(folder) / "speculative_token_map.pt"
    if token_map.is_file():
        sglang += f" --speculative-token-map {token_map}"
    return [vllm, sglang]


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tokenizer = CharTokenizer()
    problems = generate_problems(TaskConfig(seed=SEED, num_problems=PROBLEMS))
    if args.target is None:
        workload = load_embedded(with_drafter=args.drafter is None, progress=False)
        target, target_path = workload.target, str(workload.target_folder)
    else:
        target, target_path = load_checkpoint(args.target), str(args.target)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    requests = [Request(tokenizer.prompt_ids(p.prompt), params) for p in problems]
    if args.drafter is None:
        base = workload.drafter.eval()
        responses = [tokenizer.response_ids(p.solution) for p in generate_problems(
            TaskConfig(seed=SEED + 1, num_problems=64))]
        drafters = {"eagle": base,
                    "eagle-reduced-vocab": reduced_vocabulary_drafter(base, responses)}
        layouts = {"eagle": "eagle", "eagle-reduced-vocab": "eagle"}
    else:
        drafter = load_drafter(args.drafter, target).eval()
        if isinstance(drafter, Eagle3Drafter):
            drafters = {"eagle3": drafter, "speculators": drafter}
            layouts = {"eagle3": "eagle3", "speculators": "speculators"}
        else:
            drafters, layouts = {"eagle": drafter}, {"eagle": "eagle"}

    with tempfile.TemporaryDirectory() as scratch:
        root = args.out or Path(scratch)
        results = {}
        for name, drafter in drafters.items():
            with torch.no_grad():
                results[name] = export_and_check(drafter, layouts[name], root / name, target,
                                                 requests, target_path)
            results[name]["serve"] = serve_commands(layouts[name], results[name]["folder"],
                                                    target_path)
    if "eagle-reduced-vocab" in results:
        assert "speculative_token_map.pt" in results["eagle-reduced-vocab"]["files"]
    for name, result in results.items():
        print(f"{name}: {result['folder']} ({', '.join(result['files'])}; all 0644), "
              f"architectures {result['architectures']}; read back, the same rollouts, "
              f"acceptance length {result['acceptance_length']:.2f}")
        for command in result["serve"]:
            print(f"  {command}")
    return results


if __name__ == "__main__":
    main()
