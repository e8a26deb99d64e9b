"""The RL update's micro-batch plan (tlt_core.rl.update.plan_update): every rank works out the
same mini-batches, each sequence of a mini-batch is passed by exactly one rank, every rank runs
the same number of passes per mini-batch, and a micro-batch stays within its token budget
unless a single sequence alone exceeds it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tlt_core.rl.update import UpdateTotals, pack_micro_batch, plan_update


@dataclass
class FakeRollout:
    prompt_ids: tuple[int, ...]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: str


def rollouts(lengths: list[int], prompt: int = 3) -> list[FakeRollout]:
    return [FakeRollout(tuple(range(1, prompt + 1)), torch.arange(n) + 10, -torch.rand(n),
                        "length" if n % 5 == 0 else "stop") for n in lengths]


def plans(data, world: int, **options):
    return [plan_update(data, rank=rank, world=world, seed=3, step=7, **options)
            for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("budget", [8, 40, 1000])
def test_every_sequence_is_passed_once_and_every_rank_runs_the_same_passes(world, budget):
    data = rollouts([1, 9, 4, 25, 5, 7, 2, 2, 13, 30, 6])
    per_rank = plans(data, world, minibatch_size=4, micro_batch_tokens=budget,
                     mask_truncated=True)
    first = per_rank[0]
    assert all(p.minibatches == first.minibatches and p.passes == first.passes
               for p in per_rank)
    assert sorted(j for batch in first.minibatches for j in batch) == list(range(len(data)))
    for number, batch in enumerate(first.minibatches):
        passed = [j for p in per_rank for micro in p.micro_batches[number] for j in micro]
        assert sorted(passed) == sorted(batch)
        assert first.passes[number] == max(len(p.micro_batches[number]) for p in per_rank)
        for p in per_rank:
            for micro in p.micro_batches[number]:
                width = max(len(data[j].prompt_ids) + len(data[j].tokens) for j in micro)
                assert len(micro) == 1 or len(micro) * width <= budget
    assert first.counted == [r.finish_reason != "length" for r in data]
    assert sorted(j for p in per_rank for j in p.mine) == list(range(len(data)))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_inert_sequences_keep_their_minibatch_but_no_pass(world):
    data = rollouts([1, 9, 4, 25, 5, 7, 2, 2, 13, 30, 6])
    options = dict(minibatch_size=4, micro_batch_tokens=40, mask_truncated=False)
    inert = frozenset({0, 3, 6, 7, 9})
    per_rank = plans(data, world, inert=inert, **options)
    plain = plans(data, world, **options)[0]
    first = per_rank[0]
    assert first.minibatches == plain.minibatches  # the loss's normalisation is unchanged
    for number, batch in enumerate(first.minibatches):
        passed = [j for p in per_rank for micro in p.micro_batches[number] for j in micro]
        skipped = [j for p in per_rank for j in p.inert[number]]
        assert sorted(passed) == sorted(set(batch) - inert)
        assert sorted(skipped) == sorted(set(batch) & inert)
        assert first.passes[number] == max(1, *(len(p.micro_batches[number])
                                                for p in per_rank))
    assert sorted(j for p in per_rank for j in p.mine) == sorted(set(range(len(data))) - inert)
    everything = plans(data, world, inert=frozenset(range(len(data))), **options)[0]
    assert everything.passes == [1] * len(everything.minibatches)  # a zero-gradient pass each
    assert everything.micro_batches == [[] for _ in everything.minibatches]


def test_a_packed_micro_batch_holds_its_rows_right_padded():
    data = rollouts([3, 1])
    micro = pack_micro_batch(data, [1, 0], "cpu")
    assert micro.sequences.tolist() == [[1, 2, 3, 10, 0, 0], [1, 2, 3, 10, 11, 12]]
    assert micro.mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert torch.equal(micro.rollout_logprobs[1], data[0].logprobs)
    assert micro.padded({0: torch.ones(3), 1: torch.full((1,), 2.0)}).tolist() == \
        [[2, 0, 0], [1, 1, 1]]


class SumOfTwoRanks:
    """A group whose all-reduce adds a fixed other rank's numbers."""

    def __init__(self, other: UpdateTotals):
        self.other = other

    def all_reduce_sum(self, tensor):
        other = self.other
        return tensor + torch.tensor(other.policy_losses + other.value_losses
                                     + [other.kl_sum, other.clipped_tokens, other.tokens,
                                        other.value_clipped_tokens], dtype=torch.float64)


def test_totals_reduce_per_minibatch_and_in_sum():
    mine = UpdateTotals([1.0, 2.0], [0.5, 0.25], 1.0, 2.0, 10.0, 1.0, [3.0], [0.1])
    other = UpdateTotals([4.0, 8.0], [1.0, 1.0], 2.0, 3.0, 20.0, 0.0, [3.0], [0.2])
    reduced = mine.reduced(SumOfTwoRanks(other))
    assert reduced.policy_losses == [5.0, 10.0] and reduced.value_losses == [1.5, 1.25]
    assert (reduced.kl_sum, reduced.clipped_tokens, reduced.tokens,
            reduced.value_clipped_tokens) == (3.0, 5.0, 30.0, 1.0)
    assert reduced.grad_norms == [3.0] and reduced.logprob_gaps == [0.1]
