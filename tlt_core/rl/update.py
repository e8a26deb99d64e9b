"""One RL update's bookkeeping, carved the way the engine's speculative step is: a plan of
which sequences each rank passes through the models (`UpdatePlan`), the numbers taken before
any update (`BeforeUpdate`), what one micro-batch pass needs (`MicroBatch`) and the update's
loss totals, reduced over the ranks in one collective (`UpdateTotals`). The passes themselves
run in the driver, which owns the models, their DDP wrappers and the optimizers.

Shapes: B sequences of a micro-batch, L their padded prompt + response length, T their
longest response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tlt_core.rl.losses import LossParts, token_weights


@dataclass(frozen=True)
class UpdatePlan:
    """Mini-batches of similar lengths (little padding: the long tail's sequences would
    otherwise pad every mini-batch they land in), in a seeded random order. Rank r takes the
    sequences j of a mini-batch with j mod world == r, as micro-batches of at most
    `micro_batch_tokens` padded tokens; every rank can work out every share because all hold
    every rollout, so all run the same number of passes per mini-batch (DDP's reductions are
    collectives).

    Inert sequences (`plan_update`'s `inert`: every token's gradient exactly zero, as a GRPO
    sample's with an advantage of 0 when no KL term is in the loss) stay in their mini-batch,
    whose token and sequence counts normalise the loss, but in no micro-batch: a pass would
    add zeros to the gradient. A mini-batch whose sequences are all inert still gets one pass
    (a zero-gradient one, the driver's), so that its optimizer step sees zero gradients: AdamW
    moves the weights on its moments and decay even then."""
    minibatches: list[list[int]]  # rollout indices, in training order
    micro_batches: list[list[list[int]]]  # this rank's micro-batches of each mini-batch
    passes: list[int]  # per mini-batch: the most micro-batches any rank has (at least 1)
    counted: list[bool]  # per rollout: its tokens are in the loss (not masked as truncated)
    inert: list[list[int]]  # this rank's inert sequences of each mini-batch

    @property
    def mine(self) -> list[int]:
        """This rank's rollout indices that pass through the models, over all mini-batches."""
        return sorted(j for micros in self.micro_batches for micro in micros for j in micro)


def plan_update(rollouts, *, minibatch_size: int, micro_batch_tokens: int,
                mask_truncated: bool, seed: int, step: int, rank: int, world: int,
                inert: frozenset[int] = frozenset()) -> UpdatePlan:
    """inert: rollout indices whose gradient is exactly zero (see UpdatePlan)."""
    by_length = sorted(range(len(rollouts)), key=lambda j: (len(rollouts[j].tokens), j))
    minibatches = [by_length[first:first + minibatch_size]
                   for first in range(0, len(by_length), minibatch_size)]
    random.Random(f"{seed}/{step}/minibatches").shuffle(minibatches)
    shares = [[_micro_batches(rollouts, [j for j in batch[r::world] if j not in inert],
                              micro_batch_tokens)
               for r in range(world)] for batch in minibatches]
    counted = [not (mask_truncated and r.finish_reason == "length") for r in rollouts]
    return UpdatePlan(minibatches, [share[rank] for share in shares],
                      [max(1, *map(len, share)) for share in shares], counted,
                      [[j for j in batch[rank::world] if j in inert] for batch in minibatches])


def _micro_batches(rollouts, indices: list[int], budget: int) -> list[list[int]]:
    """`indices` (into rollouts) split into consecutive groups in order of total length, each at
    most `budget` padded tokens (a longer sequence goes alone)."""
    order = sorted(indices, key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].tokens))
    micros, current, width = [], [], 0
    for i in order:
        length = len(rollouts[i].prompt_ids) + len(rollouts[i].tokens)
        if current and (len(current) + 1) * max(width, length) > budget:
            micros.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    return micros + [current] if current else micros


@dataclass(frozen=True)
class BeforeUpdate:
    """This rank's rollouts' per-token numbers from before any update, keyed by rollout index;
    None where the configuration needs none."""
    old: dict[int, torch.Tensor] | None  # the policy's own log-probs, when recomputed
    ref: dict[int, torch.Tensor] | None  # the reference's, with a KL
    values: dict[int, torch.Tensor] | None  # the critic's, with PPO


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch packed for a pass: rollout indices `rows` and their tensors."""
    rows: list[int]
    sequences: torch.Tensor  # (B, L) prompt + response, right-padded
    prompt_lengths: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) real response tokens
    rollout_logprobs: torch.Tensor  # (B, T) the engine's log-probs

    def padded(self, per_rollout: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-rollout (T_j,) tensors as one right-padded (B, T) float tensor."""
        out = torch.zeros(len(self.rows), self.mask.shape[1])
        for b, j in enumerate(self.rows):
            out[b, :len(per_rollout[j])] = per_rollout[j]
        return out.to(self.mask.device)


def pack_micro_batch(rollouts, rows: list[int], device) -> MicroBatch:
    chosen = [rollouts[j] for j in rows]
    width = max(len(r.prompt_ids) + len(r.tokens) for r in chosen)
    T = max(len(r.tokens) for r in chosen)
    sequences = torch.zeros(len(chosen), width, dtype=torch.int64)
    mask, logprobs = torch.zeros(len(chosen), T), torch.zeros(len(chosen), T)
    for b, r in enumerate(chosen):
        sequence = list(r.prompt_ids) + r.tokens.tolist()
        sequences[b, :len(sequence)] = torch.tensor(sequence)
        mask[b, :len(r.tokens)] = 1
        logprobs[b, :len(r.tokens)] = r.logprobs
    lengths = torch.tensor([len(r.prompt_ids) for r in chosen])
    return MicroBatch(list(rows), sequences.to(device), lengths.to(device), mask.to(device),
                      logprobs.to(device))


def micro_batch_weights(micro: MicroBatch, plan: UpdatePlan, *, mode: str, batch_tokens: float,
                        batch_sequences: int, max_new_tokens: int) -> torch.Tensor:
    """(B, T) loss weights of a micro-batch's tokens (tlt_core.rl.losses.token_weights), from
    its whole mini-batch's counts; zero on masked sequences."""
    counted = torch.tensor([plan.counted[j] for j in micro.rows], device=micro.mask.device)
    return token_weights(micro.mask * counted[:, None], mode, batch_tokens=batch_tokens,
                         batch_sequences=batch_sequences, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class ValueParts:
    loss: torch.Tensor  # what to backpropagate: sum_t w_t l_t
    clipped_tokens: float  # counted tokens whose clipped error was the larger one


@dataclass
class UpdateTotals:
    """An update's loss numbers on this rank, then (`reduced`) over all ranks."""
    policy_losses: list[float] = field(default_factory=list)  # per mini-batch trained
    value_losses: list[float] = field(default_factory=list)  # per mini-batch trained
    kl_sum: float = 0.0
    clipped_tokens: float = 0.0
    tokens: float = 0.0
    value_clipped_tokens: float = 0.0
    grad_norms: list[float] = field(default_factory=list)  # this rank's; equal on every rank
    logprob_gaps: list[float] = field(default_factory=list)  # this rank's, before any update

    def start_minibatch(self) -> None:
        self.policy_losses.append(0.0)
        self.value_losses.append(0.0)

    def add_policy(self, part: LossParts) -> None:
        self.policy_losses[-1] += part.policy_loss
        self.kl_sum += part.kl_sum
        self.clipped_tokens += part.clipped_tokens
        self.tokens += part.tokens

    def add_value(self, part: ValueParts) -> None:
        self.value_losses[-1] += float(part.loss.detach())
        self.value_clipped_tokens += part.clipped_tokens

    def reduced(self, group) -> UpdateTotals:
        """The sums over every rank's shares, in one collective. The gradient norms are the
        same on every rank (DDP reduced the gradients); the log-prob gaps stay this rank's."""
        n = len(self.policy_losses)
        flat = torch.tensor(self.policy_losses + self.value_losses
                            + [self.kl_sum, self.clipped_tokens, self.tokens,
                               self.value_clipped_tokens], dtype=torch.float64)
        values = group.all_reduce_sum(flat).tolist()
        return UpdateTotals(values[:n], values[n:2 * n], *values[2 * n:],
                            grad_norms=list(self.grad_norms),
                            logprob_gaps=list(self.logprob_gaps))
