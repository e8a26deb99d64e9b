"""Batched speculative decoding in a Hugging Face transformers loop, with tlt_core's fused
verification kernel deciding what each row accepts.

transformers' own assisted decoding (`generate(assistant_model=...)`) runs batch 1 only. This
loop runs any batch: a small draft model proposes a chain of k tokens per row, the target scores
all of them in one forward, `tlt_core.ops.verify_tree_greedy` (T = 0) or
`tlt_core.ops.verify_tree_sampling` (T > 0; a chain is a tree whose parents are i - 1) decides
each row's accepted prefix and its bonus / corrected token, and `tlt_core.ops.compact_kv_` moves
the accepted entries of both models' `DynamicCache`s into place. Rows accept different numbers
of tokens and finish at different times.

    python examples/hf_batched_verify.py                        # tiny random Llama pair, seconds
    python examples/hf_batched_verify.py --models embedded      # the pre-trained embedded model
                                                                # and a 2-layer assistant (that
                                                                # one trained and cached on first
                                                                # use, minutes)
    python examples/hf_batched_verify.py --target PATH --draft PATH --prompt "..." --prompt "..."

What it proves (asserted; a failure exits non-zero):

1. Greedy (T = 0) is exact: every row's output equals `target.generate(do_sample=False)` for
   that prompt alone, token for token, with ragged prompts, rows accepting different lengths
   and rows finishing early.
2. Sampling (T > 0) is a valid sampler, checked cheaply here (the kernel's exhaustive
   losslessness tests are tests/test_lossless.py): `--check-rows` rows with one prompt and their
   own seeds take one speculative step; the first emitted token, which the rejection sampler
   decides from the draft model's sampled proposal, is tested against the target's probabilities
   by a chi-square test (p-value must exceed 1e-3). As a control, the same test is run on the
   draft model's own proposals: with the tiny pair (total variation between p and q about 0.4)
   it rejects them (p-value below 1e-3; tests/test_examples.py asserts it), so the check can
   tell q_draft from p_target.
3. The acceptance length (tokens each row emits per verification: accepted drafts + 1) is
   measured and printed; SD steps and target forwards are counted.

The cache design (why compaction): both caches hold, per row b, its committed tokens except
the last (the root) in slots [0, cache_len[b]), then holes up to the shared width. Each step
appends the chain [root, d_1 .. d_k] at slots [width, width + k + 1) of every row; the kernel's
verdict says row b keeps nodes 0 .. a_b, and `compact_kv_` copies them to slots cache_len[b] ..
cache_len[b] + a_b (the same call serves trees). The caches are then cropped to the longest row;
shorter rows keep holes there, masked out by the 2-D attention mask, and every token gets its
own explicit position id (cache_len[b] + i), so RoPE sees each row's true positions. This keeps
every row exact without recomputing anything, and the caches grow only by what rows accept
(holes are bounded by the spread between rows' lengths). Cropping to the shortest row and
re-feeding the others would recompute tokens every step; left padding would shift every row's
cache each step. Finished rows leave the batch (`DynamicCache.batch_select_indices`).

Notation: B running rows, k draft tokens per step, N = k + 1 chain nodes, V vocabulary,
T the caches' shared width. p = target distribution, q = draft distribution.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

import tlt_core.ops as ops
from tlt_core.ops.reference import processed_target_probs


@dataclass(frozen=True)
class DecodeConfig:
    draft_tokens: int = 4  # k: draft tokens per row per step
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    eos_id: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens: must be >= 1, got {self.draft_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not (0 <= self.temperature < math.inf):
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class DecodeStats:
    steps: int = 0  # speculative steps (one target forward each, after the prefill)
    row_steps: int = 0  # sum over steps of the running rows
    emitted: int = 0  # tokens emitted by verification, before cutting at eos / max_new_tokens
    accepted: int = 0  # draft tokens accepted
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens a row emits per verification: accepted drafts + the bonus / corrected one."""
        return self.emitted / max(self.row_steps, 1)


# ---- the caches ------------------------------------------------------------------------------


def _attention_mask(cache_len: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """(B, total) int64 over the cache's slots after a forward: row b's committed slots
    [0, cache_len[b]) and the step's chain slots [width, total); 0 on the holes between."""
    slots = torch.arange(total)  # (total,)
    return ((slots[None, :] < cache_len[:, None]) | (slots[None, :] >= width)).long()


def _forward(model, tokens: torch.Tensor, cache, cache_len: torch.Tensor, width: int,
             fed: int = 0) -> torch.Tensor:
    """Feeds tokens (B, n) as chain nodes fed .. fed + n - 1 of each row (the chain starts at
    slot `width`, position cache_len[b]); returns float32 logits (B, n, V). The cache appends
    them at slots [width + fed, width + fed + n)."""
    n = tokens.shape[1]
    positions = cache_len[:, None] + fed + torch.arange(n)  # (B, n): each row's own positions
    out = model(input_ids=tokens, attention_mask=_attention_mask(cache_len, width, width + fed + n),
                position_ids=positions, use_cache=True, **_cache_argument(model, cache))
    return out.logits.float()  # (B, n, V)


def _cache_argument(model, cache) -> dict:
    """transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns
    until 5.40); older releases know only `past_key_values`."""
    names = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in names else {"past_key_values": cache}


def _compact(cache, accept_index: torch.Tensor, num_accepted: torch.Tensor,
             cache_len: torch.Tensor, width: int) -> None:
    """Moves each row's accepted nodes (chain slots width + accept_index[b, j]) to slots
    cache_len[b] + j in every layer's keys and values, in place."""
    # compact_kv_ copies slot cache_len[b] + s[b, j] to cache_len[b] + j: the chain sits at
    # `width`, not at cache_len[b], so shift the source index by each row's hole
    source = accept_index.clamp(min=0).long() + (width - cache_len)[:, None]  # (B, N)
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):  # (B, H_kv, T, d): compact_kv_'s default layout
            # torch.cat in DynamicLayer.update leaves them contiguous; the kernel needs it
            assert tensor.is_contiguous()
            ops.compact_kv_(tensor, source, num_accepted, cache_len)


# ---- one speculative step ----------------------------------------------------------------------


def _propose(draft, cache, roots: torch.Tensor, cache_len: torch.Tensor, width: int,
             config: DecodeConfig, generator: torch.Generator):
    """A chain per row: tokens (B, N) = [root, d_1 .. d_k] and, at T > 0, q_draft (B, N, V)
    (row i: the distribution d_{i+1} was sampled from). Feeds d_k too, so the draft cache holds
    every node the target may accept (one extra small forward; its q row is valid and unused)."""
    chain, q_rows = [roots], []
    for i in range(config.draft_tokens + 1):
        logits = _forward(draft, chain[-1][:, None], cache, cache_len, width, i)[:, 0]  # (B, V)
        if i == config.draft_tokens:
            if config.temperature > 0:
                q_rows.append(_probs(logits, config))
            break
        if config.temperature == 0:
            chain.append(logits.argmax(-1))  # (B,)
        else:
            q = _probs(logits, config)  # (B, V)
            q_rows.append(q)
            chain.append(torch.multinomial(q, 1, generator=generator)[:, 0])
    tokens = torch.stack(chain, dim=1)  # (B, N)
    return tokens, (torch.stack(q_rows, dim=1).contiguous() if q_rows else None)  # (B, N, V)


def _probs(logits: torch.Tensor, config: DecodeConfig) -> torch.Tensor:
    """q_draft after temperature / top-p, with verify.h's exact float conventions (the
    reference oracle's; one copy of that math)."""
    w, s = processed_target_probs(logits, config.temperature, 0, config.top_p)  # (B, V), (B,)
    return w / s[:, None]


@dataclass
class _Running:
    """The rows still decoding. Both caches hold row b's committed tokens but the root in slots
    [0, cache_len[b]) and holes from there to `width`, the caches' shared length."""

    rows: torch.Tensor  # (B,) int64: each row's prompt index
    roots: torch.Tensor  # (B,) int64: the last committed token, not yet in the caches
    cache_len: torch.Tensor  # (B,) int64
    width: int
    target_cache: object  # transformers DynamicCache
    draft_cache: object

    @property
    def caches(self) -> tuple:
        return self.target_cache, self.draft_cache

    def crop(self, width: int) -> None:
        for cache in self.caches:
            cache.crop(width - cache.get_seq_length())  # negative: tokens to remove
        self.width = width


def _prefill(target, draft, prompts: list[list[int]]) -> _Running:
    """Both models read every prompt but its last token (the first step's root), right-padded:
    padding sits after each row's tokens, so causal attention never lets them see it."""
    from transformers import DynamicCache

    batch = len(prompts)
    cache_len = torch.tensor([len(p) - 1 for p in prompts])  # (B,)
    width = int(cache_len.max())
    body = torch.zeros(batch, width, dtype=torch.int64)  # (B, T)
    for b, p in enumerate(prompts):
        body[b, :len(p) - 1] = torch.tensor(p[:-1])
    positions = torch.arange(width).expand(batch, width)  # (B, T)
    caches = []
    for model in (target, draft):
        cache = DynamicCache(config=model.config)
        model(input_ids=body, attention_mask=(positions < cache_len[:, None]).long(),
              position_ids=positions, use_cache=True, **_cache_argument(model, cache))
        caches.append(cache)
    return _Running(torch.arange(batch), torch.tensor([p[-1] for p in prompts]), cache_len,
                    width, *caches)


def _verify(logits: torch.Tensor, tokens: torch.Tensor, q_draft: torch.Tensor | None,
            seeds: torch.Tensor, generated: torch.Tensor, config: DecodeConfig) -> ops.VerifyOutput:
    """The fused kernel on the chains: logits (B, N, V) at each node, tokens (B, N); seeds and
    generated (B,) give each row its own Philox stream, offset by the tokens it has."""
    batch, N = tokens.shape
    parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(batch, N)  # a chain: i - 1
    if config.temperature == 0:
        return ops.verify_tree_greedy(logits, tokens, parents)
    return ops.verify_tree_sampling(logits, tokens, parents, temperature=config.temperature,
                                    top_p=config.top_p, draft_probs=q_draft, seed=seeds,
                                    offset=generated)


def _accept(running: _Running, verdict: ops.VerifyOutput) -> None:
    """Compacts both caches to the accepted paths, crops them to the longest row and makes each
    row's last emitted token its next root."""
    for cache in running.caches:  # the same layout, the same moves
        _compact(cache, verdict.accept_index, verdict.num_accepted, running.cache_len,
                 running.width)
    counts = verdict.num_accepted.long() + 1  # (B,) tokens each row emits
    running.cache_len = running.cache_len + counts  # the root and the accepted drafts
    running.crop(int(running.cache_len.max()))
    running.roots = verdict.emitted_tokens.gather(1, (counts - 1)[:, None])[:, 0]  # (B,)


def _commit(running: _Running, verdict: ops.VerifyOutput, outputs: list[list[int]],
            config: DecodeConfig) -> None:
    """Appends each row's emitted tokens (up to eos or the budget: what a step emits past
    either is dropped) and drops finished rows from the batch and the caches."""
    keep = []
    for i, (row, count, emitted) in enumerate(zip(running.rows.tolist(),
                                                  (verdict.num_accepted + 1).tolist(),
                                                  verdict.emitted_tokens.tolist())):
        for token in emitted[:count]:
            outputs[row].append(token)
            if token == config.eos_id or len(outputs[row]) >= config.max_new_tokens:
                break
        else:
            keep.append(i)
    if len(keep) == running.rows.numel():
        return
    index = torch.tensor(keep, dtype=torch.int64)
    for cache in running.caches:
        cache.batch_select_indices(index)
    running.rows, running.roots = running.rows[index], running.roots[index]
    running.cache_len = running.cache_len[index]
    if keep:
        running.crop(int(running.cache_len.max()))


def speculative_generate(target, draft, prompts: list[list[int]], config: DecodeConfig,
                         seeds: list[int] | None = None) -> tuple[list[list[int]], DecodeStats]:
    """Generates up to max_new_tokens per prompt (fewer when eos_id comes), batched, speculative.
    Returns each prompt's new tokens (eos included) and the loop's statistics."""
    if any(len(p) < 2 for p in prompts):
        raise ValueError("prompts: each needs at least 2 tokens (the prefill feeds all but the "
                         "last, which is the first step's root)")
    seeds_t = torch.tensor(seeds if seeds is not None else
                           [config.seed * 1_000_003 + b for b in range(len(prompts))])  # (B,)
    generator = torch.Generator().manual_seed(config.seed)
    stats, start = DecodeStats(), time.perf_counter()
    outputs: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        running = _prefill(target, draft, prompts)
        while running.rows.numel():
            tokens, q_draft = _propose(draft, running.draft_cache, running.roots,
                                       running.cache_len, running.width, config,
                                       generator)  # (B, N), (B, N, V) or None
            logits = _forward(target, tokens, running.target_cache, running.cache_len,
                              running.width)  # (B, N, V)
            generated = torch.tensor([len(outputs[r]) for r in running.rows.tolist()])  # (B,)
            verdict = _verify(logits, tokens, q_draft, seeds_t[running.rows], generated, config)
            _accept(running, verdict)
            stats.steps += 1
            stats.row_steps += running.rows.numel()
            stats.accepted += int(verdict.num_accepted.sum())
            stats.emitted += int(verdict.num_accepted.sum()) + running.rows.numel()
            _commit(running, verdict, outputs, config)
    stats.seconds = time.perf_counter() - start
    return outputs, stats


# ---- the checks --------------------------------------------------------------------------------


def greedy_reference(target, prompts: list[list[int]], config: DecodeConfig) -> list[list[int]]:
    """HF generate, greedy, one prompt at a time: what each row must equal."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=config.max_new_tokens,
                                  eos_token_id=config.eos_id,
                                  pad_token_id=0 if config.eos_id is None else config.eos_id)
        new = out[0, len(prompt):].tolist()
        if config.eos_id is not None and config.eos_id in new:
            new = new[:new.index(config.eos_id) + 1]  # generate pads after eos
        outputs.append(new)
    return outputs


def batched_generate_seconds(target, prompts: list[list[int]], config: DecodeConfig) -> float:
    """Wall time of HF generate, greedy, the whole batch at once (left-padded), no SD: the
    baseline a batched loop replaces. Timing only; single runs on a shared CPU vary."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):], mask[b, width - len(prompt):] = torch.tensor(prompt), 1
    start = time.perf_counter()
    with torch.inference_mode():
        target.generate(ids, attention_mask=mask, do_sample=False,
                        max_new_tokens=config.max_new_tokens, eos_token_id=config.eos_id,
                        pad_token_id=0 if config.eos_id is None else config.eos_id)
    return time.perf_counter() - start


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts (V,) against probs (V,); cells with expected count
    below 5 are pooled into one."""
    total = float(counts.sum())
    expected = probs.double() * total
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if float(expected[-1]) == 0:  # nothing pooled
        if float(observed[-1]) > 0:
            return 0.0  # a token of probability 0 was drawn
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(statistic, dof))
    except ImportError:  # Wilson-Hilferty: chi2(dof) / dof is about normal after a cube root
        z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def sampling_check(target, draft, prompt: list[int], rows: int, config: DecodeConfig) -> dict:
    """One speculative step for `rows` copies of prompt, each with its own seed: the first
    emitted token must follow p_target; the draft's own first proposals (q_draft) must not pass."""
    one_step = DecodeConfig(config.draft_tokens, 1, config.temperature, config.top_p, None,
                            config.seed)
    outputs, _ = speculative_generate(target, draft, [prompt] * rows, one_step)
    first = torch.tensor([o[0] for o in outputs])  # (rows,)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p_target = _probs(target(input_ids=ids).logits[:, -1].float(), config)[0]  # (V,)
        q_draft = _probs(draft(input_ids=ids).logits[:, -1].float(), config)[0]  # (V,)
    generator = torch.Generator().manual_seed(config.seed + 1)
    proposals = torch.multinomial(q_draft, rows, replacement=True, generator=generator)
    vocab = p_target.numel()
    return {"rows": rows,
            "p_value": chi_square_pvalue(torch.bincount(first, minlength=vocab), p_target),
            "control_p_value": chi_square_pvalue(torch.bincount(proposals, minlength=vocab),
                                                 p_target),
            "total_variation_p_q": float((p_target - q_draft).abs().sum() / 2)}


# ---- models ------------------------------------------------------------------------------------


def tiny_random_models(vocab: int = 48, seed: int = 0):
    """A 4-layer random Llama target and its layer-skip draft: the target's first 2 layers with
    its embedding, final norm and LM head (self-speculation, as in LayerSkip / Draft & Verify).
    Initialised with std 0.2 so distributions are peaked, not near-uniform (then p and q differ
    enough for the sampling check's control to bite). Random models agree poorly with their
    truncations: expect acceptance lengths near 1.5 greedy, 2.5 at T = 1; this pair is a
    correctness fixture, the embedded pair (--models embedded) shows real acceptance."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def config(layers: int):
        return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, initializer_range=0.2,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None)

    torch.manual_seed(seed)
    target = LlamaForCausalLM(config(4)).eval()
    draft = LlamaForCausalLM(config(2)).eval()
    missing = draft.load_state_dict(target.state_dict(), strict=False).missing_keys
    assert not missing, missing
    return target, draft


def embedded_models(progress: bool = True):
    """The pre-trained embedded target and the 2-layer assistant of `tlt bench peers` (trained
    and cached on first use), exported to HF checkpoints and loaded with transformers."""
    from transformers import AutoModelForCausalLM

    from tlt_core.bench.peers import assistant_model
    from tlt_core.model.checkpoint import save_checkpoint
    from tlt_core.embedded.workload import load_pretrained

    ours_target = load_pretrained(progress=progress)[0]
    ours_draft = assistant_model(progress)
    models = []
    for model in (ours_target, ours_draft):
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(model, folder)
            models.append(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return models


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", choices=("tiny", "embedded"), default="tiny",
                        help="tiny: random 4-layer Llama + its 2-layer layer-skip draft (default); "
                             "embedded: the pre-trained embedded model + its 2-layer assistant")
    parser.add_argument("--target", help="a local HF model folder (with its tokenizer); "
                                         "overrides --models")
    parser.add_argument("--draft", help="the draft model folder (same vocabulary) for --target")
    parser.add_argument("--prompt", action="append", default=[],
                        help="prompt text for --target (repeat for a batch)")
    parser.add_argument("--batch", type=int, default=6, help="prompts in the batch (default 6)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="for the sampling check (default 1.0); greedy always runs too")
    parser.add_argument("--check-rows", type=int, default=3000,
                        help="rows of the sampling check (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    eos_id = None
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not args.draft or not args.prompt:
            parser.error("--target needs --draft and at least one --prompt")
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target, draft = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                         for path in (args.target, args.draft))
        prompts = [tokenizer(text)["input_ids"] for text in args.prompt]
        eos_id = tokenizer.eos_token_id
    elif args.models == "embedded":
        from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems

        target, draft = embedded_models()
        tokenizer = CharTokenizer()
        prompts = [tokenizer.prompt_ids(p.prompt) for p in
                   generate_problems(TaskConfig(seed=4242, num_problems=args.batch))]
        eos_id = tokenizer.eos_id
    else:
        target, draft = tiny_random_models(seed=args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        vocab = target.config.vocab_size
        eos_id = vocab - 1  # random models emit it now and then: rows finish at different times
        prompts = [torch.randint(0, vocab - 1, (int(n),), generator=generator).tolist()
                   for n in torch.randint(2, 12, (args.batch,), generator=generator)]

    greedy = DecodeConfig(args.draft_tokens, args.max_new_tokens, 0.0, eos_id=eos_id,
                          seed=args.seed)
    ours, stats = speculative_generate(target, draft, prompts, greedy)
    start = time.perf_counter()
    theirs = greedy_reference(target, prompts, greedy)
    reference_s = time.perf_counter() - start
    for row, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"row {row}: speculative greedy {a} != HF generate {b}"
    lengths = [len(o) for o in ours]
    batched_s = batched_generate_seconds(target, prompts, greedy)
    print(f"greedy, batch {len(prompts)}, k = {args.draft_tokens}: every row equals HF generate "
          f"(batch 1) token for token; lengths {lengths}")
    print(f"  acceptance length {stats.acceptance_length:.2f} tokens per verification, "
          f"{stats.steps} target forwards for {sum(lengths)} tokens")
    print(f"  wall time (one run, not a benchmark): this loop {stats.seconds:.2f} s; HF generate "
          f"greedy, whole batch: {batched_s:.2f} s; one prompt at a time: {reference_s:.2f} s")
    result = {"batch": len(prompts), "greedy_equal": True, "lengths": lengths,
              "acceptance_length_greedy": stats.acceptance_length, "steps_greedy": stats.steps,
              "seconds_greedy": stats.seconds, "seconds_hf_generate": reference_s,
              "seconds_hf_generate_batched": batched_s}

    if args.temperature > 0:
        sampled = DecodeConfig(args.draft_tokens, args.max_new_tokens, args.temperature,
                               eos_id=eos_id, seed=args.seed)
        _, sampled_stats = speculative_generate(target, draft, prompts, sampled)
        print(f"sampling, T = {args.temperature:g}: acceptance length "
              f"{sampled_stats.acceptance_length:.2f}")
        result["acceptance_length_sampled"] = sampled_stats.acceptance_length
        if args.check_rows:
            check = sampling_check(target, draft, prompts[0], args.check_rows, sampled)
            print(f"  first emitted token over {check['rows']} seeds vs p_target: chi-square "
                  f"p = {check['p_value']:.3g} (must be > 1e-3); the draft's own proposals vs "
                  f"p_target (the control): p = {check['control_p_value']:.3g}, total "
                  f"variation between p and q {check['total_variation_p_q']:.2f}")
            assert check["p_value"] > 1e-3, "speculative sampling does not follow p_target"
            if check["control_p_value"] >= 1e-3:  # the control needs p and q to differ
                print("  (the control did not reject: p and q are too close at this prompt for "
                      f"{check['rows']} rows to tell apart)")
            result["sampling_check"] = check
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
