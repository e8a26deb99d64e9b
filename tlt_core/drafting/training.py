"""Training the drafter: the data record, the loss (EAGLE's, plus a term for sampled
drafting), one train step, the optimizer.

A `DraftRecord` is one sequence as the target saw it: its token ids and, at every position t,
the target's outputs at the drafter's feature layers plus its last layer. Records come from a
target pass the rollout already made (the harvest, tlt_core.workers.harvest) or, offline, from
one pass over the target's own responses (`collect_records`). Pairing is by position, never by
guesswork: the drafter's input at t is (f_t, x_{t+1}); its output f'_{t+1} is trained
- to regress onto the target's last-layer hidden state at t + 1 (smooth L1; after the final
  norm for a form-"eagle" drafter, `Drafter.feature_target`), and
- to give, through the drafter's logits (the target's frozen head), the target's own
  distribution of x_{t+2} (cross-entropy against the soft target distribution),
weighted 1.0 and 0.1 as in EAGLE (regression_weight 0 drops the first term, as EAGLE-3 trains
a drafter on fused features: its output need not be any one layer's feature), and
- to be accepted when sampled: the rejection term 1 - sum_x min(p(x), q(x)) (the total variation
  distance between the target's distribution p and the drafter's q) is the probability that a
  token drafted from q is rejected by the lossless sampled check (tlt_core.drafting.sampled_chain),
  which cross-entropy only bounds. Weighted REJECTION_WEIGHT; 0 is EAGLE's loss.
Only the drafter's own tensors are optimised; the target's embedding and head are used detached
(tlt_core.drafting.drafter). p and q are over the draft vocabulary (the target's distribution
renormalised onto it, tlt_core.drafting.drafter), as the token term's are.

That is `eagle_loss`, teacher-forced: every input holds the target's feature. Drafting feeds the
drafter's own outputs back from its second level on, so `unrolled_loss` adds the training-time
test (EAGLE-3): `unroll` steps, step k drafting from step k - 1's output at each root t
(tlt_core.drafting.unrolled, which attends exactly as the drafter cache does during a draft)
and scored by the same terms against the target at t + k, weighted STEP_DECAY ** (k - 1).
unroll = 1 is `eagle_loss`.

`train_step(..., matmul_dtype=torch.bfloat16)` runs the loss's matmuls in bf16 under autocast
while the weights and AdamW's state stay float32: a step 1.5x faster on a CPU with bf16
instructions (avx512_bf16; SmolLM2's shape, 4096 positions: bench/drafter_step.py), whose
updates are still applied to float32 weights, so they are not rounded away.

Shapes: B records in a batch, T positions, F feature layers, H hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.unrolled import check_unroll, unrolled_forward
from tlt_core.model.transformer import Transformer

REGRESSION_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE's weights for its two loss terms
# the rejection term's weight (module docstring): on SmolLM2's responses it raised the expected
# sampled acceptance of drafting levels 1-3 at T = 1 by 1.3-2.1% each, and cost no greedy
# acceptance (docs/results.md, "Drafter objective")
REJECTION_WEIGHT = 1.0
STEP_DECAY = 0.8  # unrolled step k weighs STEP_DECAY ** (k - 1), as EAGLE-3 weighs its steps


def check_loss_weight(name: str, weight: object) -> float:
    """`weight` if it is a number >= 0 (0 drops its term), else a ValueError naming it `name`:
    a negative weight would train the drafter away from the target."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ValueError(f"{name}: must be a number >= 0, got {weight!r}")
    return weight


@dataclass(frozen=True)
class DraftRecord:
    """One sequence for drafter training, exactly as the target computed it."""

    tokens: torch.Tensor  # (T,) int64: x_0 .. x_{T-1}
    features: torch.Tensor  # (T, F, H): target outputs at the drafter's feature layers
    last_hidden: torch.Tensor  # (T, H): target's last-layer output (pre-norm) at each t

    def __post_init__(self):
        T = self.tokens.shape[0]
        if self.tokens.dim() != 1 or T < 2:
            raise ValueError(f"tokens: need a (T,) sequence with T >= 2, got {tuple(self.tokens.shape)}")
        if self.features.dim() != 3 or self.features.shape[0] != T:
            raise ValueError(f"features: expected ({T}, F, H), got {tuple(self.features.shape)}")
        if self.last_hidden.shape != (T, self.features.shape[2]):
            raise ValueError(f"last_hidden: expected ({T}, {self.features.shape[2]}), got "
                             f"{tuple(self.last_hidden.shape)}")


@torch.no_grad()
def collect_records(target: Transformer, sequences: Sequence[Sequence[int]],
                    feature_layers: Sequence[int]) -> list[DraftRecord]:
    """Records for full token sequences (prompt + response), from one target pass each."""
    layers = list(feature_layers) + [-1]
    device = target.lm_head.weight.device
    records = []
    for sequence in sequences:
        ids = torch.tensor([list(sequence)], dtype=torch.int64, device=device)
        out = target(ids, torch.arange(ids.shape[1], device=device)[None], hidden_layers=layers)
        hidden = out.hidden_states
        records.append(DraftRecord(ids[0].cpu(), torch.stack(hidden[:-1], dim=2)[0].cpu(),
                                   hidden[-1][0].cpu()))
    return records


@dataclass(frozen=True)
class DraftBatch:
    tokens: torch.Tensor  # (B, T) int64, right-padded
    features: torch.Tensor  # (B, T, F, H)
    last_hidden: torch.Tensor  # (B, T, H)
    mask: torch.Tensor  # (B, T - 1) bool: position t is a real training pair (t + 1 < length)

    def to(self, device: torch.device) -> DraftBatch:
        """Records live on the CPU; a batch moves to the drafter's device to train."""
        if self.tokens.device == device:
            return self
        return DraftBatch(*(t.to(device, non_blocking=True) for t in
                            (self.tokens, self.features, self.last_hidden, self.mask)))


def make_batch(records: Sequence[DraftRecord]) -> DraftBatch:
    width = max(r.tokens.shape[0] for r in records)
    B, (_, nf, H) = len(records), records[0].features.shape
    tokens = torch.zeros(B, width, dtype=torch.int64)
    features = torch.zeros(B, width, nf, H, dtype=records[0].features.dtype)
    last = torch.zeros(B, width, H, dtype=records[0].last_hidden.dtype)
    mask = torch.zeros(B, width - 1, dtype=torch.bool)
    for b, r in enumerate(records):
        n = r.tokens.shape[0]
        tokens[b, :n], features[b, :n], last[b, :n] = r.tokens, r.features, r.last_hidden
        mask[b, :n - 1] = True
    return DraftBatch(tokens, features, last, mask)


def eagle_loss(drafter: Drafter, batch: DraftBatch, token_weight: float = TOKEN_WEIGHT,
               rejection_weight: float = REJECTION_WEIGHT,
               regression_weight: float = REGRESSION_WEIGHT) -> tuple[torch.Tensor, dict]:
    """The loss over every real pair of the batch, teacher-forced with the target's features.
    Returns (loss, {"regression", "token", "rejection", "top1", "accept"}): top1 is the share of
    pairs where the drafter's argmax equals the target's (greedy drafting's acceptance of one
    level), accept = 1 - rejection (the expected share of tokens sampled from the drafter that
    the sampled check accepts at T = 1)."""
    tokens, mask = batch.tokens, batch.mask
    B, T = tokens.shape
    features = drafter.features(batch.features[:, :-1].unbind(dim=2))  # (B, T-1, H): f_t
    positions = torch.arange(T - 1, device=tokens.device)[None].expand(B, T - 1)
    predicted = drafter(tokens[:, 1:], features, positions)  # (B, T-1, H): f'_{t+1}
    truth = drafter.feature_target(batch.last_hidden[:, 1:])  # (B, T-1, H): target's at t + 1
    with torch.no_grad():
        target_probs = torch.softmax(drafter.logits(truth[mask]), -1)  # (M, V)
    terms = _pair_terms(drafter, predicted[mask], truth[mask], target_probs)
    return (_weighted(terms, regression_weight, token_weight, rejection_weight),
            _step_metrics(terms, 1))


def unrolled_loss(drafter: Drafter, batch: DraftBatch, unroll: int,
                  token_weight: float = TOKEN_WEIGHT, step_decay: float = STEP_DECAY,
                  rejection_weight: float = REJECTION_WEIGHT,
                  regression_weight: float = REGRESSION_WEIGHT) -> tuple[torch.Tensor, dict]:
    """The loss's terms (module docstring) at each of `unroll` drafting steps, summed with
    weight step_decay ** (k - 1). Step k scores root t when t is a real pair and t + k < the
    sequence's length (the target's feature at t + k exists, and so its distribution of
    x_{t+k+1}). Returns (loss, eagle_loss's metrics of step 1, the teacher-forced ones, plus
    "top1_step{k}" and "accept_step{k}" for k = 2..unroll: step k's agreement with the target's
    argmax and its sampled acceptance, those of a level-k draft given the levels before were
    accepted). A step with no root to score (no sequence long enough) adds nothing and reports
    NaN."""
    check_unroll(unroll)
    tokens, mask = batch.tokens, batch.mask  # (B, T), (B, P)
    B, P = mask.shape
    features = drafter.features(batch.features[:, :-1].unbind(dim=2))  # (B, P, H): f_t
    outputs = unrolled_forward(drafter, tokens, features, unroll)  # unroll x (B, P, H)
    truth = drafter.feature_target(batch.last_hidden[:, 1:])  # (B, P, H): target's at t + 1
    # The target's distributions once, at every position step 1 scores: every later step's
    # targets are among them (step k's at root t is step 1's at root t + k - 1).
    with torch.no_grad():
        scored = torch.softmax(drafter.logits(truth[mask]), -1)  # (M, V)
        target_probs = scored.new_zeros(B, P, scored.shape[-1])  # (B, P, V)
        target_probs[mask] = scored
    loss, metrics = torch.zeros((), device=tokens.device), {}
    for step, predicted in enumerate(outputs, start=1):
        ahead = torch.cat((mask[:, step - 1:], mask.new_zeros(B, step - 1)), 1)  # (B, P)
        rows, roots = (mask & ahead).nonzero(as_tuple=True)  # pair t real, t + step < length
        if rows.numel() == 0:
            metrics.update(_step_metrics(None, step))
            continue
        at = roots + step - 1  # where step 1 scored the target at t + step
        terms = _pair_terms(drafter, predicted[rows, roots], truth[rows, at],
                            target_probs[rows, at])
        loss = loss + step_decay ** (step - 1) * _weighted(terms, regression_weight,
                                                           token_weight, rejection_weight)
        metrics.update(_step_metrics(terms, step))
    return loss, metrics


def _pair_terms(drafter: Drafter, predicted: torch.Tensor, truth: torch.Tensor,
                target_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"regression", "token", "rejection", "top1"} over M scored pairs: predicted (M, H)
    drafter outputs, truth (M, H) the target's features they guess (Drafter.feature_target),
    target_probs (M, V) the target's distributions of the token after."""
    logits = drafter.logits(predicted)  # (M, V)
    log_q = torch.log_softmax(logits, -1)
    accepted = torch.minimum(target_probs, log_q.exp()).sum(-1)  # (M,): sum_x min(p, q)
    return {"regression": F.smooth_l1_loss(predicted, truth),
            "token": -(target_probs * log_q).sum(-1).mean(),
            "rejection": 1 - accepted.mean(),
            "top1": (logits.argmax(-1) == target_probs.argmax(-1)).float().mean()}


def _weighted(terms: dict[str, torch.Tensor], regression_weight: float, token_weight: float,
              rejection_weight: float) -> torch.Tensor:
    return (regression_weight * terms["regression"] + token_weight * terms["token"]
            + rejection_weight * terms["rejection"])


def _step_metrics(terms: dict[str, torch.Tensor] | None, step: int) -> dict[str, float]:
    """A step's reported metrics, read from the device in one transfer: at step 1 every term
    and the sampled acceptance "accept" (1 - rejection), at step k > 1 "top1_step{k}" and
    "accept_step{k}"; each NaN when `terms` is None (a step with nothing to score)."""
    read = ("regression", "token", "rejection", "top1") if step == 1 else ("rejection", "top1")
    if terms is None:
        values = dict.fromkeys(read, float("nan"))
    else:
        values = dict(zip(read, torch.stack([terms[name].detach().float()
                                             for name in read]).tolist()))
    if step == 1:
        return {**values, "accept": 1 - values["rejection"]}
    return {f"top1_step{step}": values["top1"], f"accept_step{step}": 1 - values["rejection"]}


def train_step(drafter: Drafter, optimizer: torch.optim.Optimizer, batch: DraftBatch,
               grad_clip: float = 1.0, token_weight: float = TOKEN_WEIGHT,
               unroll: int = 1, matmul_dtype: torch.dtype | None = None,
               rejection_weight: float = REJECTION_WEIGHT,
               regression_weight: float = REGRESSION_WEIGHT) -> dict:
    """One optimizer step on the unrolled loss (`unroll` = 1: teacher-forced; none when the
    batch has no pair to score); the metrics of unrolled_loss plus "loss". matmul_dtype: the
    loss's matmuls under autocast in that dtype (module docstring); None: in the weights' own."""
    check_unroll(unroll)
    check_loss_weight("rejection_weight", rejection_weight)
    check_loss_weight("regression_weight", regression_weight)
    device = drafter.fc.weight.device
    drafter.train()
    with torch.autocast(device.type, dtype=matmul_dtype, enabled=matmul_dtype is not None):
        loss, metrics = unrolled_loss(drafter, batch.to(device), unroll, token_weight,
                                      rejection_weight=rejection_weight,
                                      regression_weight=regression_weight)
    if loss.requires_grad:  # else the batch had no pair to score: nothing to learn from
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
        optimizer.step()
    drafter.eval()
    return {"loss": loss.item(), **metrics}


def make_optimizer(drafter: Drafter, lr: float) -> torch.optim.Optimizer:
    """AdamW over the drafter's own tensors (the target's are not among its parameters)."""
    return torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
