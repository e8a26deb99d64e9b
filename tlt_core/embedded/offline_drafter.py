"""Offline training of the embedded model's drafter: EAGLE's loss on the target's own sampled
responses to task prompts, before any RL step.

The training set is `num_problems` task prompts answered by the target at temperature 1, one
target pass over each full sequence for its features (`tlt_core.drafting.collect_records`);
then `steps` AdamW steps on random batches of those records, the learning rate on a cosine from
lr to lr / 10, in the warm-up's training loop (tlt_core.warmup.training_loop.train_steps).
Deterministic for a seed on one machine, like pre-training.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from dataclasses import dataclass

import torch

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.training import collect_records, make_batch, make_optimizer
from tlt_core.embedded.pretrain import sample_responses
from tlt_core.embedded.task import TaskConfig, generate_problems
from tlt_core.model.transformer import Transformer
from tlt_core.optim.schedule import learning_rate
from tlt_core.warmup.training_loop import train_steps


@dataclass(frozen=True)
class OfflineDrafterConfig:
    seed: int = 0
    num_problems: int = 768  # task prompts whose target responses form the training set
    # teacher-forced top-1 agreement: 0.80 at 300 steps, 0.95 at 1500, 0.97 at 3000
    steps: int = 2500
    batch_size: int = 32
    lr: float = 3e-3
    feature_layers: tuple[int, ...] = (-1,)
    form: str = "eagle"  # DrafterConfig.form; part of the cache key, like every field


@dataclass(frozen=True)
class OfflineDrafterReport:
    steps: int
    train_seconds: float
    final_loss: float  # mean over the last 50 steps
    final_top1: float  # mean teacher-forced top-1 agreement over the last 50 steps


def train_offline_drafter(target: Transformer,
                          config: OfflineDrafterConfig = OfflineDrafterConfig(), *,
                          progress: bool = True) -> tuple[Drafter, OfflineDrafterReport]:
    """A drafter for the embedded target, trained on the target's own sampled responses
    (temperature 1) to task prompts."""
    torch.manual_seed(config.seed)
    problems = generate_problems(TaskConfig(seed=config.seed + 777,
                                            num_problems=config.num_problems))
    rollouts = sample_responses(target, problems)
    records = collect_records(target, [list(r.prompt_ids) + r.tokens.tolist() for r in rollouts],
                              config.feature_layers)
    drafter = Drafter(target, DrafterConfig(config.feature_layers, config.form))
    order = random.Random(config.seed)
    batches = (make_batch(order.sample(records, config.batch_size)) for _ in itertools.count())
    lr_at = functools.partial(learning_rate, lr=config.lr, steps=config.steps,
                              scheduler="cosine", min_lr_ratio=0.1)
    start = time.perf_counter()
    # EAGLE's loss alone (no rejection term): the shipped drafter, whose folder this config's
    # hash names, was trained with it, and training the same config again must give it back
    history = train_steps(drafter, make_optimizer(drafter, config.lr), batches,
                          steps=config.steps, lr_at=lr_at, progress=progress,
                          desc="training the embedded drafter", rejection_weight=0.0)
    tail = history[-50:]
    report = OfflineDrafterReport(config.steps, time.perf_counter() - start,
                                  sum(h["loss"] for h in tail) / len(tail),
                                  sum(h["top1"] for h in tail) / len(tail))
    return drafter.eval(), report
