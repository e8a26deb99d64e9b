"""Phase 3 of the warm-up: training the drafter, resumable, and the training loop the embedded
drafter shares.

`train_steps` is the loop: one AdamW step of the drafter's loss unrolled over `unroll` drafting
steps (tlt_core.drafting.training; 1: teacher-forced) per batch, the learning rate set per step
from a schedule (tlt_core.optim.schedule), every step's metrics kept. `train_drafter` runs it
over the response positions of every sequence, in batches of at most `batch_tokens` padded
positions grouped by length, the learning rate warmed up then on a cosine to a tenth; each
epoch's order is a function of the seed and the epoch alone. Checkpointed every
`checkpoint_every` steps (`work/train/step-N/`: weights, optimizer and the history, a
checkpoint_io folder), so an interrupted run resumes where it stopped with the same
batches; a checkpoint that does not read back is reported, deleted, and training resumes from
the one before, or from the start. The drafter's weights train in float32 against a float32 twin of
the target (`float32_twin`: the same weights, widened exactly), whatever dtype the target
decodes in, so that AdamW's small updates are not rounded away; for a bf16 target the loss's
matmuls run in bf16 under autocast by default (OfflineConfig.matmul_dtype).
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.training import (REGRESSION_WEIGHT, REJECTION_WEIGHT, DraftBatch,
                                        DraftRecord, make_batch, make_optimizer, train_step)
from tlt_core.model.transformer import Transformer, rope_inv_freq
from tlt_core.optim.schedule import learning_rate
from tlt_core.persistence.checkpoint_io import read_state, step_folders, write_checkpoint
from tlt_core.warmup.config import OfflineConfig
from tlt_core.warmup.work_folder import discard

logger = logging.getLogger(__name__)


def float32_twin(target: Transformer) -> Transformer:
    """The same model in float32 on the same device: its weights widened exactly (every bf16
    or fp16 value is a float32 one), for training a drafter against what the target computes.
    The target itself when it is float32 already."""
    if target.lm_head.weight.dtype == torch.float32:
        return target
    device = target.lm_head.weight.device
    with torch.device("meta"):
        twin = Transformer(target.config)
    state = {name: tensor.detach().float() for name, tensor in target.state_dict().items()}
    twin.load_state_dict(state, strict=True, assign=True)
    twin.tie_weights()
    twin.model.rotary_emb.inv_freq = rope_inv_freq(target.config, device)
    return twin.eval()


def train_steps(drafter: Drafter, optimizer: torch.optim.Optimizer,
                batches: Iterator[DraftBatch], *, steps: int, lr_at: Callable[[int], float],
                first_step: int = 0, history: list[dict] | None = None,
                after_step: Callable[[int, list[dict]], None] | None = None,
                progress: bool = True, desc: str = "training the drafter",
                unroll: int = 1, matmul_dtype: torch.dtype | None = None,
                rejection_weight: float = REJECTION_WEIGHT,
                regression_weight: float = REGRESSION_WEIGHT) -> list[dict]:
    """Steps `first_step` to `steps` - 1: each takes the next of `batches` at the learning rate
    `lr_at(step)`, trains on the loss unrolled over `unroll` steps (its rejection and regression
    terms weighted rejection_weight and regression_weight, its matmuls in matmul_dtype:
    train_step's), and appends its metrics to
    `history` (returned); `after_step(steps done, history)` runs after each."""
    history = [] if history is None else history
    bar = tqdm(total=steps, initial=first_step, disable=not progress, unit="step", desc=desc)
    for step in range(first_step, steps):
        batch = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        metrics = train_step(drafter, optimizer, batch, unroll=unroll,
                             matmul_dtype=matmul_dtype, rejection_weight=rejection_weight,
                             regression_weight=regression_weight)
        history.append(metrics)
        bar.update()
        deeper = {f"top1@{k}": f"{metrics[f'top1_step{k}']:.3f}" for k in range(2, unroll + 1)}
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.3f}",
                        accept=f"{metrics['accept']:.3f}", **deeper)
        if after_step is not None:
            after_step(step + 1, history)
    bar.close()
    return history


def train_drafter(drafter: Drafter, records: list[DraftRecord], prompt_lengths: list[int],
                  directory: Path, config: OfflineConfig, progress: bool,
                  target_dtype: torch.dtype = torch.float32) -> list[dict]:
    """AdamW steps on the drafter's loss unrolled over config.unroll drafting steps, over response
    positions; resumes from the newest step checkpoint in `directory` that reads back (a damaged
    one is reported and deleted); its matmuls in the dtype config chooses for a target
    decoding in target_dtype. Returns every step's metrics (resumed steps' included)."""
    optimizer, step, history = _resume(drafter, directory, config)
    device = drafter.fc.weight.device
    batches = (_float_batch(batch, device)
               for batch in _epoch_batches(records, prompt_lengths, config, step))

    def checkpoint(done: int, history: list[dict]) -> None:
        if done % config.checkpoint_every == 0 or done == config.steps:
            write_checkpoint(directory, done, {"drafter": drafter.state_dict(),
                                               "optimizer": optimizer.state_dict(),
                                               "step": done, "history": history}, keep=1)

    lr_at = functools.partial(learning_rate, lr=config.lr, steps=config.steps,
                              warmup_steps=config.warmup, scheduler="cosine", min_lr_ratio=0.1)
    return train_steps(drafter, optimizer, batches, steps=config.steps, lr_at=lr_at,
                       first_step=step, history=history, after_step=checkpoint,
                       progress=progress, unroll=config.unroll,
                       matmul_dtype=config.matmul_torch_dtype(target_dtype, device),
                       rejection_weight=config.rejection_weight,
                       regression_weight=config.regression_weight)


def _resume(drafter: Drafter, directory: Path, config: OfflineConfig
            ) -> tuple[torch.optim.Optimizer, int, list[dict]]:
    """(the optimizer, steps done, their history) from the newest step checkpoint in
    `directory` that reads back, loaded into `drafter`; the fresh ones when there is none."""
    initial = {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}
    optimizer = make_optimizer(drafter, config.lr)
    for saved_step, folder in reversed(step_folders(directory).items()):
        try:
            state = read_state(folder)
            _check_train_state(state, folder, saved_step)
            try:
                drafter.load_state_dict(state["drafter"])
                optimizer.load_state_dict(state["optimizer"])
            except (KeyError, RuntimeError, TypeError) as error:
                raise ValueError(f"out: {folder}: its drafter or optimizer state does not fit "
                                 f"this drafter ({str(error).splitlines()[0]})") from None
        except (FileNotFoundError, ValueError) as error:
            logger.warning("training: %s; deleting %s and resuming from the checkpoint before "
                           "it, or from the start", error, folder)
            discard(folder)
            drafter.load_state_dict(initial)  # a failed load may have copied part of it
            optimizer = make_optimizer(drafter, config.lr)
            continue
        return optimizer, saved_step, list(state["history"])
    return optimizer, 0, []


def _check_train_state(state: dict, folder: Path, step: int) -> None:
    """A ValueError naming `folder` unless `state` is a step checkpoint of `step` steps."""
    missing = sorted({"drafter", "optimizer", "step", "history"} - state.keys())
    if missing:
        raise ValueError(f"out: {folder} lacks {', '.join(missing)}")
    if state["step"] != step or not isinstance(state["history"], list) \
            or len(state["history"]) != step:
        raise ValueError(f"out: {folder} does not hold the state after {step} steps with their "
                         "history")


def _epoch_batches(records: list[DraftRecord], prompt_lengths: list[int], config: OfflineConfig,
                   skip: int):
    """Batches forever, epoch after epoch, each epoch's order a function of the seed and the
    epoch alone; the first `skip` batches are passed over (a resumed run)."""
    # the pairs (f_t, x_{t+1}) scored: t >= prompt length - 1, the ones a rollout drafts from
    # (its first draft follows the prompt's last position)
    masked = [(r, max(p - 1, 0)) for r, p in zip(records, prompt_lengths)]
    produced, epoch = 0, 0
    while True:
        rng = random.Random(config.seed * 1_000_003 + epoch)
        order = sorted(range(len(masked)), key=lambda i: masked[i][0].tokens.shape[0])
        groups, current, width = [], [], 0
        for i in order:  # by length, so each batch pads little
            n = masked[i][0].tokens.shape[0]
            if current and max(width, n) * (len(current) + 1) > config.batch_tokens:
                groups.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, n)
        if current:
            groups.append(current)
        rng.shuffle(groups)
        for group in groups:
            produced += 1
            if produced > skip:
                yield _masked_batch([masked[i] for i in group])
        epoch += 1


def _masked_batch(items: list[tuple[DraftRecord, int]]) -> DraftBatch:
    batch = make_batch([record for record, _ in items])
    for b, (_, first) in enumerate(items):
        batch.mask[b, :first] = False
    return batch


def _float_batch(batch: DraftBatch, device: torch.device) -> DraftBatch:
    """The batch on the drafter's device, its hidden states widened to float32."""
    return DraftBatch(batch.tokens.to(device), batch.features.to(device, torch.float32),
                      batch.last_hidden.to(device, torch.float32), batch.mask.to(device))
