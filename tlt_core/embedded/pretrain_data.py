"""Supervised pre-training data: task problems as padded token batches for a tiny causal LM.

Contract: problems and a tokenizer in, batches of token ids and a loss mask out; knows nothing
about models or optimisers. A sequence is `<bos> prompt ? response <eos>`, right-padded with
<pad> to the longest sequence of its batch. `loss_mask[b, t]` is True exactly where
`input_ids[b, t]` is a response token or the <eos> that ends it: the tokens the model must learn
to write. With the usual shift, logits[:, t] predict input_ids[:, t + 1] and are weighted by
loss_mask[:, t + 1]; the prompt and the padding are never targets.

Batching. Lengths are heavy-tailed (see tlt_core.embedded.task), so a batch of random problems
is mostly padding: with the default task, random batches of 32 hold 3.8 tokens for every real
one, and length-bucketed ones (the default window of 64 batches) 1.07.
Problems are shuffled, then taken in windows of `bucket_batches * batch_size`; each window is
sorted by length, cut into batches, and its batches shuffled. Every problem appears once per
call (one epoch; the last batch may be smaller), in an order fixed by `seed`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from tlt_core.embedded.task import CharTokenizer, Problem


class PretrainBatch(NamedTuple):
    input_ids: torch.Tensor  # (B, T) int64, right-padded with tokenizer.pad_id
    loss_mask: torch.Tensor  # (B, T) bool, True at response tokens and their <eos>


def make_batches(problems: Sequence[Problem], tokenizer: CharTokenizer, batch_size: int, *,
                 seed: int, bucket_batches: int = 64) -> Iterator[PretrainBatch]:
    """One epoch over `problems` as PretrainBatch(input_ids, loss_mask), deterministic given
    `seed`; `bucket_batches` = 1 turns length bucketing off (random batches)."""
    for name, value in (("batch_size", batch_size), ("bucket_batches", bucket_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: must be an int, got {type(seed).__name__}")
    if len(problems) == 0:
        raise ValueError("problems: must not be empty")
    for index, problem in enumerate(problems):
        if not isinstance(problem, Problem):
            raise TypeError(f"problems: element {index} is a {type(problem).__name__}, "
                            "not a tlt_core.embedded.task.Problem")
    return _batches(problems, tokenizer, batch_size, seed, bucket_batches)


def _batches(problems, tokenizer, batch_size, seed, bucket_batches):
    # Tokenize up front, so a bad problem fails before training starts.
    examples = [(tokenizer.prompt_ids(p.prompt), tokenizer.response_ids(p.solution))
                for p in problems]
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = batch_size * bucket_batches
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window],
                       key=lambda i: len(examples[i][0]) + len(examples[i][1]))
        batches = [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        for rows in batches:
            yield _collate([examples[i] for i in rows], tokenizer.pad_id)


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> PretrainBatch:
    length = max(len(prompt) + len(response) for prompt, response in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.int64)  # (B, T)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.bool)  # (B, T)
    for row, (prompt, response) in enumerate(examples):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response, dtype=torch.int64)
        loss_mask[row, len(prompt):end] = True
    return PretrainBatch(input_ids, loss_mask)
