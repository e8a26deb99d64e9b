"""tlt's verify kernels in vLLM's rejection-sampler layout, inside a torch.compile'd sampler step.

    python examples/vllm_rejection_sample.py
    python examples/vllm_rejection_sample.py --requests 4000 --spec-len 4 --vocab 64

A vLLM engine verifies linear drafts flattened request after request (SpecDecodeMetadata:
draft_token_ids, cu_num_draft_tokens) against target probabilities it has already put through
temperature / top-k / top-p, and reads (B, max_spec_len + 1) output token ids with -1 after
each request's tokens. `sampler_step` below is such a step: it builds target_probs the way
vLLM's RejectionSampler does, then calls `tlt_core.integrations.vllm_ops.rejection_sample`,
the custom op `torch.ops.tlt.vllm_rejection_sample`. The whole step is compiled with
torch.compile(fullgraph=True) (backend "aot_eager" here, to stay quick on a CPU). vLLM itself is
not needed (nor installed: it requires a CUDA build of torch).

What it proves (each is an assert; the script exits non-zero when one fails):

1. The compiled step and the eager step give the same output token ids.
2. Greedy requests (temperature 0) emit the target's argmax: each emitted token before the last
   equals its draft and the argmax there.
3. Lossless: over all random requests, the first emitted token is distributed as
   target_probs at the first draft position (chi-square p-value > 1e-3), although the drafts
   come from another distribution; the drafts themselves, emitted unverified, fail that test.
4. Each request's output is its accepted drafts, then one more token, then -1: parsed as
   vLLM's RejectionSampler.parse_output does, the mean number of tokens per request is between
   1 and spec_len + 1 and is printed (the acceptance length).
"""

from __future__ import annotations

import argparse
import sys

import torch
from scipy import stats

from tlt_core.integrations import vllm_ops


def sampler_step(target_logits: torch.Tensor, temperature: torch.Tensor, top_k: int,
                 draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                 uniform_probs: torch.Tensor, recovery_uniforms: torch.Tensor,
                 spec_len: int) -> torch.Tensor:
    """One verification step in vLLM's layout. target_logits (T, V), temperature (B,) with 0
    for greedy requests, draft tensors as vLLM's SpecDecodeMetadata holds them."""
    counts = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))  # (B,)
    is_greedy = temperature == 0  # (B,)
    per_token = torch.repeat_interleave(torch.where(is_greedy, 1.0, temperature), counts,
                                        output_size=target_logits.shape[0])  # (T,)
    scaled = target_logits / per_token[:, None]  # (T, V)
    kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (T, 1)
    target_probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)  # (T, V)
    output = torch.full((counts.shape[0], spec_len + 1), vllm_ops.PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int32, device=target_logits.device)  # (B, K + 1)
    return vllm_ops.rejection_sample(draft_token_ids, cu_num_draft_tokens, draft_probs,
                                     target_probs, bonus_token_ids, output, is_greedy=is_greedy,
                                     uniform_probs=uniform_probs,
                                     recovery_uniforms=recovery_uniforms, validate=False)


def parse_output(output_token_ids: torch.Tensor, vocab: int) -> list[list[int]]:
    """vLLM's RejectionSampler.parse_output: each request's tokens without placeholders."""
    return [[t for t in row if t != vllm_ops.PLACEHOLDER_TOKEN_ID and t < vocab]
            for row in output_token_ids.tolist()]


def make_batch(requests: int, spec_len: int, vocab: int, seed: int) -> dict:
    """A batch whose first draft position has the same target logits in every request (so
    the lossless check can pool them), request 0 mod 4 greedy, counts in [1, spec_len]."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, spec_len + 1, (requests,), generator=g)
    total = int(counts.sum())
    cu = counts.cumsum(0).to(torch.int32)
    target_logits = torch.randn(total, vocab, generator=g) * 2  # (T, V)
    first = cu - counts.to(torch.int32)  # (B,) first draft position of each request
    target_logits[first.long()] = torch.randn(vocab, generator=g) * 2
    draft_logits = target_logits + torch.randn(total, vocab, generator=g)  # a drafter near p
    draft_probs = torch.softmax(draft_logits, -1)  # (T, V)
    temperature = torch.full((requests,), 0.8)
    temperature[::4] = 0.0
    return dict(
        target_logits=target_logits, temperature=temperature, top_k=max(2, vocab // 2),
        draft_token_ids=torch.multinomial(draft_probs, 1, generator=g).squeeze(1).to(torch.int32),
        cu_num_draft_tokens=cu, draft_probs=draft_probs,
        bonus_token_ids=torch.randint(0, vocab, (requests, 1), generator=g, dtype=torch.int32),
        uniform_probs=torch.rand(total, generator=g, dtype=torch.float64),
        recovery_uniforms=torch.rand(requests, generator=g, dtype=torch.float64),
        spec_len=spec_len)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--spec-len", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    batch = make_batch(args.requests, args.spec_len, args.vocab, args.seed)

    eager = sampler_step(**batch)
    compiled = torch.compile(sampler_step, fullgraph=True, backend="aot_eager")(**batch)
    assert torch.equal(eager, compiled), "compiled step differs from the eager step"

    counts = torch.diff(batch["cu_num_draft_tokens"], prepend=torch.zeros(1, dtype=torch.int32))
    starts = (batch["cu_num_draft_tokens"] - counts).tolist()
    tokens = parse_output(eager, args.vocab)
    greedy = (batch["temperature"] == 0).tolist()
    argmax = batch["target_logits"].argmax(-1)  # top-k and temperature keep the argmax
    for b in (b for b in range(args.requests) if greedy[b]):
        for j, token in enumerate(tokens[b][:-1]):  # the accepted drafts
            assert token == int(batch["draft_token_ids"][starts[b] + j]) == int(
                argmax[starts[b] + j]), f"greedy request {b} accepted a non-argmax draft"

    random_rows = [b for b in range(args.requests) if not greedy[b]]
    first_logits = batch["target_logits"][starts[random_rows[0]]] / 0.8
    kth = torch.topk(first_logits, batch["top_k"]).values[-1]
    p_first = torch.softmax(first_logits.masked_fill(first_logits < kth, float("-inf")), -1)
    observed = torch.bincount(torch.tensor([tokens[b][0] for b in random_rows]),
                              minlength=args.vocab).double()
    support = p_first > 0
    assert observed[~support].sum() == 0, "a token outside top-k was emitted"
    expected = p_first[support].double()
    p_value = float(stats.chisquare(observed[support], expected / expected.sum()
                                    * observed.sum()).pvalue)
    # Control: the drafts themselves, emitted unverified, must fail the same test.
    drafted = torch.bincount(batch["draft_token_ids"][[starts[b] for b in random_rows]].long(),
                             minlength=args.vocab).double()
    control = float(stats.chisquare(drafted + 1, (p_first.double() + 1e-3) / (
        p_first.double() + 1e-3).sum() * (drafted + 1).sum()).pvalue)
    assert p_value > 1e-3, f"first tokens do not follow target_probs (p = {p_value:.2g})"
    assert control < 1e-3, "the check cannot tell the draft distribution from the target's"

    lengths = [len(row) for row in tokens]
    assert all(1 <= n <= int(c) + 1 for n, c in zip(lengths, counts.tolist()))
    result = dict(requests=args.requests, mean_tokens_per_request=sum(lengths) / len(lengths),
                  p_value=p_value, control_p_value=control, compiled_equal=True)
    print(f"{args.requests} requests, {sum(lengths) / len(lengths):.2f} tokens per request "
          f"(spec_len {args.spec_len}); first-token chi-square p = {p_value:.3f} vs target, "
          f"{control:.2g} vs drafter; compiled step == eager step")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
