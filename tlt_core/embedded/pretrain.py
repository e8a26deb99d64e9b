"""Supervised pre-training of the embedded model on the embedded task, and how good it is.

Contract: a seed in, a trained `Transformer` (and a report of how good it is) out; the same
seed and config give the same weights on the same machine and torch build (another CPU or
thread count may round differently, and training amplifies rounding). RL needs a policy
that is right sometimes but not always (30-80% at temperature 1), so pre-training is short: a
fixed number of AdamW steps on reference solutions (tlt_core.embedded.task), loss on response
tokens only (tlt_core.embedded.pretrain_data). Where the weights are kept: tlt_core.embedded.
workload.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tlt_core.embedded.architecture import EMBEDDED_MODEL_CONFIG
from tlt_core.embedded.pretrain_data import make_batches
from tlt_core.embedded.task import (CharTokenizer, Problem, TaskConfig, check_answer,
                                    generate_problems, length_stats)
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, Rollout, SamplingParams
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.optim.schedule import learning_rate


@dataclass(frozen=True)
class PretrainConfig:
    seed: int = 0
    steps: int = 1000  # ~2M tokens; measured 57-67% correct at T=1 with a similar probe
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 100  # linear ramp, then cosine to lr / 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    problems_per_epoch: int = 8192
    task: TaskConfig = field(default_factory=TaskConfig)

    def __post_init__(self):
        for name in ("steps", "batch_size", "problems_per_epoch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps: must be in [0, steps], got {self.warmup_steps}")


@dataclass(frozen=True)
class PretrainReport:
    steps: int
    tokens_seen: int
    final_loss: float  # mean over the last 50 steps, nats per response token
    train_seconds: float
    accuracy_t1: float  # share of held-out problems answered right, sampled at temperature 1
    token_entropy: float  # mean per-token entropy (nats) of the policy on its own samples
    response_length: dict  # length_stats of the sampled responses (tokens, <eos> included)


def _init_weights(model: Transformer) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    torch.manual_seed(0)
    scale = 1 / math.sqrt(2 * model.config.num_layers)
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2:
            std = 0.02 * (scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            torch.nn.init.normal_(parameter, std=std)


def pretrain(config: PretrainConfig = PretrainConfig(),
             model_config: ModelConfig = EMBEDDED_MODEL_CONFIG, *, progress: bool = True
             ) -> tuple[Transformer, list[float], int, float]:
    """Trains from scratch; returns (model, per-step losses, tokens seen, seconds)."""
    torch.manual_seed(config.seed)
    tokenizer = CharTokenizer()
    model = Transformer(model_config)
    _init_weights(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    losses, tokens_seen, epoch = [], 0, 0
    start = time.perf_counter()
    bar = tqdm(total=config.steps, disable=not progress, unit="step",
               desc="pre-training the embedded model")
    while len(losses) < config.steps:
        task = TaskConfig(**{**asdict(config.task), "seed": config.task.seed + 1000 + epoch,
                             "num_problems": config.problems_per_epoch})
        for input_ids, loss_mask in make_batches(generate_problems(task), tokenizer,
                                                 config.batch_size, seed=config.seed + epoch):
            if len(losses) == config.steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(len(losses), lr=config.lr, steps=config.steps,
                                            warmup_steps=config.warmup_steps,
                                            scheduler="cosine", min_lr_ratio=0.1)
            positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
            logits = model(input_ids[:, :-1], positions[:, :-1]).logits  # (B, T-1, V)
            targets = loss_mask[:, 1:]  # (B, T-1): logits at t predict token t + 1
            loss = F.cross_entropy(logits[targets], input_ids[:, 1:][targets])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            tokens_seen += input_ids.numel()
            bar.update()
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
        epoch += 1
    bar.close()
    return model.eval(), losses, tokens_seen, time.perf_counter() - start


def sample_responses(model: Transformer, problems: list[Problem], *,
                     temperature: float = 1.0) -> list[Rollout]:
    """The model's responses (engine Rollouts, in problem order) to task problems."""
    tokenizer = CharTokenizer()
    max_tokens = max(len(tokenizer.response_ids(p.solution)) for p in problems) + 8
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            stop_ids=(tokenizer.eos_id,))
    requests = [Request(tokenizer.prompt_ids(p.prompt), params) for p in problems]
    prompt_len = max(len(r.prompt_ids) for r in requests)
    engine = RolloutEngine(model, EngineConfig(max_batch=64, max_len=prompt_len + max_tokens))
    return engine.generate(requests).rollouts


@torch.inference_mode()
def evaluate(model: Transformer, *, num_problems: int = 512, seed: int = 12345,
             task: TaskConfig = TaskConfig()) -> tuple[float, float, dict]:
    """(accuracy at temperature 1, mean per-token entropy, response length stats) on held-out
    problems, generated with the rollout engine."""
    tokenizer = CharTokenizer()
    problems = generate_problems(TaskConfig(**{**asdict(task), "seed": seed,
                                               "num_problems": num_problems}))
    correct, entropy_sum, entropy_count, lengths = 0.0, 0.0, 0, []
    for rollout, problem in zip(sample_responses(model, problems), problems):
        correct += check_answer(problem, tokenizer.decode_response(rollout.tokens.tolist()))
        lengths.append(len(rollout.tokens))
        ids = torch.tensor([list(rollout.prompt_ids) + rollout.tokens.tolist()])
        logits = model(ids, torch.arange(ids.shape[1])[None]).logits[0, len(rollout.prompt_ids) - 1:-1]
        logp = torch.log_softmax(logits, -1)  # (T_gen, V)
        entropy_sum += float(-(logp.exp() * logp).sum())
        entropy_count += logp.shape[0]
    return correct / len(problems), entropy_sum / max(1, entropy_count), length_stats(lengths)
