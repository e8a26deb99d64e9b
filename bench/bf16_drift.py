"""How far a bfloat16 model's next-token distributions move from the same model's in float32, per
weight layout of the packed pass: what "bf16 decodes the same distribution up to rounding" means
in numbers, and the check that a layout of our own (the panel products) rounds no worse than
PyTorch's bfloat16 ops.

    python bench/bf16_drift.py --model DIR --tokens 128 --json FILE

One response is sampled at T = 1 from the float32 model (the prompt in the model's chat
template, or as plain text where it has none); then every variant scores exactly that sequence,
the prompt in one pass and each response token in a one-token decode step as the engine runs
it:

- "forward": the bfloat16 model's modules (Transformer.forward: PyTorch's bf16 ops, no cache);
- one row per bfloat16 weight layout of the packed pass that applies on this CPU (views: the
  parameters through F.linear; panels: tlt_core.ops.panel_matmul; onednn where oneDNN has bf16).

Each row: the mean and largest KL(float32 || variant) over the response positions, the share of
positions whose argmax agrees with float32's, and the largest logit difference.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tlt_core.model.tokenizer import CheckpointTokenizer
from tlt_core.model.weight_layout import onednn_supports
from tlt_core.ops.panel_matmul import vectorised as panels_vectorised

PROMPT = "Explain why the sky is blue, in two short paragraphs."


def prompt_ids(folder: str, text: str) -> list[int]:
    tokenizer = CheckpointTokenizer(folder)
    if tokenizer.chat_template is None:
        return tokenizer.encode(text)
    return tokenizer.encode_chat(text)


def decode_logits(model, sequence: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(len - prompt_len, V) float32: the next-token logits at each response position, the
    prompt prefilled in one pass, then one token per step."""
    c, total = model.config, sequence.shape[1]
    cache = KVCache(CacheShape(c.num_layers, 1, c.num_kv_heads, total, c.head_dim),
                    dtype=cache_dtype(model.lm_head.weight.dtype, "cpu"))
    positions = torch.arange(total)[None]
    with torch.no_grad():
        out = [model.step(sequence[:, :prompt_len], positions[:, :prompt_len],
                          cache).logits[0, -1].float()]
        cache.commit(torch.tensor([prompt_len]))
        for t in range(prompt_len, total - 1):
            out.append(model.step(sequence[:, t:t + 1], positions[:, t:t + 1],
                                  cache).logits[0, 0].float())
            cache.commit(torch.tensor([1]))
    return torch.stack(out)


def compare(name: str, logits: torch.Tensor, reference: torch.Tensor) -> dict:
    log_p, log_q = F.log_softmax(reference, -1), F.log_softmax(logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"variant": name, "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "argmax_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "max_logit_diff": (logits - reference).abs().max().item(),
            "positions": logits.shape[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--prompt", default=PROMPT, help="the user message")
    parser.add_argument("--tokens", type=int, default=128, help="response tokens scored")
    parser.add_argument("--seed", type=int, default=3, help="the float32 sample's seed")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    prompt = prompt_ids(args.model, args.prompt)
    full = load_checkpoint(args.model, dtype=torch.float32)
    engine = RolloutEngine(full, EngineConfig(max_batch=1, max_len=len(prompt) + args.tokens))
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=args.seed)
    response = engine.generate([Request(prompt, params)]).rollouts[0].tokens.tolist()
    sequence = torch.tensor([prompt + response])
    reference = decode_logits(full, sequence, len(prompt))
    half = load_checkpoint(args.model, dtype=torch.bfloat16)
    with torch.no_grad():
        forward = half(sequence, torch.arange(sequence.shape[1])[None]).logits[0].float()
    rows = [compare("forward", forward[len(prompt) - 1:-1], reference)]
    layouts = ["views"] + (["panels"] if panels_vectorised() else []) + (
        ["onednn"] if onednn_supports(torch.bfloat16) else [])
    for layout in layouts:
        half.inference_layout = layout
        rows.append(compare(f"step, {layout}", decode_logits(half, sequence, len(prompt)),
                            reference))
    for row in rows:
        print(f"{row['variant']:>14}: KL mean {row['kl_mean']:.2e} max {row['kl_max']:.2e}, "
              f"argmax agrees {row['argmax_agreement']:.3f}, largest logit difference "
              f"{row['max_logit_diff']:.3f} ({row['positions']} positions)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
