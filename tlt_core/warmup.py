"""Supervised warm-up of the embedded model on the embedded task, and its on-disk cache.

Contract: a seed in, a trained `Transformer` (and a report of how good it is) out; the same
seed and config give the same weights on the same machine. RL needs a policy that is right
sometimes but not always (30-80% at temperature 1), so the warm-up is short: a fixed number of
AdamW steps on reference solutions (tlt_core.task), loss on response tokens only
(tlt_core.warmup_data). The result is cached as a Hugging Face checkpoint folder under
$TLT_CACHE_DIR (default ~/.cache/tlt_core), keyed by a hash of the configs, and reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tlt_core.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.embedded import EMBEDDED_MODEL_CONFIG
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model import ModelConfig, Transformer
from tlt_core.task import CharTokenizer, TaskConfig, check_answer, generate_problems, length_stats
from tlt_core.warmup_data import make_batches


@dataclass(frozen=True)
class WarmupConfig:
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
class WarmupReport:
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


def _learning_rate(config: WarmupConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(config: WarmupConfig = WarmupConfig(), model_config: ModelConfig = EMBEDDED_MODEL_CONFIG,
          *, progress: bool = True) -> tuple[Transformer, list[float], int, float]:
    """Trains from scratch; returns (model, per-step losses, tokens seen, seconds)."""
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    tokenizer = CharTokenizer()
    model = Transformer(model_config)
    _init_weights(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    losses, tokens_seen, epoch = [], 0, 0
    start = time.perf_counter()
    bar = tqdm(total=config.steps, disable=not progress, desc="warm-up", unit="step")
    while len(losses) < config.steps:
        task = TaskConfig(**{**asdict(config.task), "seed": config.task.seed + 1000 + epoch,
                             "num_problems": config.problems_per_epoch})
        for input_ids, loss_mask in make_batches(generate_problems(task), tokenizer,
                                                 config.batch_size, seed=config.seed + epoch):
            if len(losses) == config.steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(config, len(losses))
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


def sample_responses(model: Transformer, problems: list, *, temperature: float = 1.0) -> list:
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


def cache_dir(config: WarmupConfig, model_config: ModelConfig) -> Path:
    key = json.dumps({"warmup": asdict(config), "model": model_config.to_hf_config()},
                     sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt_core"))
    return root / f"embedded-{digest}"


def load_or_train(config: WarmupConfig = WarmupConfig(),
                  model_config: ModelConfig = EMBEDDED_MODEL_CONFIG, *,
                  progress: bool = True, eval_problems: int = 512
                  ) -> tuple[Transformer, WarmupReport]:
    """The warm embedded model: from the cache if this config was trained before, else
    trained now (a few minutes on 2 cores), evaluated, and cached."""
    folder = cache_dir(config, model_config)
    report_path = folder / "warmup_report.json"
    if report_path.is_file():
        return load_checkpoint(folder).eval(), WarmupReport(**json.loads(report_path.read_text()))
    model, losses, tokens_seen, seconds = train(config, model_config, progress=progress)
    accuracy, entropy, lengths = evaluate(model, num_problems=eval_problems, task=config.task)
    tail = losses[-50:]
    report = WarmupReport(len(losses), tokens_seen, sum(tail) / len(tail), seconds, accuracy,
                          entropy, lengths)
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, folder)
    report_path.write_text(json.dumps(asdict(report), indent=1) + "\n")
    return model, report
