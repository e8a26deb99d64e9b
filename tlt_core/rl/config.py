"""The RL driver's configuration: every option of `tlt train` (and of a config file) as a field
of `TrainConfig`, its help beside it (the flags are derived from the fields,
tlt_core.config_flags), validated in `__post_init__` with messages that name the field.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tlt_core.config_flags import option
from tlt_core.rl.advantages import REWARD_SCALINGS
from tlt_core.rl.losses import KL_ESTIMATORS, LOSS_AGG_MODES
from tlt_core.optim.schedule import LR_SCHEDULERS

OLD_LOGPROBS = ("auto", "rollout", "recompute")
ALGORITHMS = ("grpo", "ppo")
KL_PLACEMENTS = ("loss", "reward")

# The options with a fixed set of values (the CLI offers them as choices).
CHOICES = {"algorithm": ALGORITHMS, "scale_rewards": REWARD_SCALINGS,
           "loss_agg_mode": LOSS_AGG_MODES, "kl_placement": KL_PLACEMENTS,
           "kl_estimator": KL_ESTIMATORS, "lr_scheduler_type": LR_SCHEDULERS,
           "old_logprobs": OLD_LOGPROBS}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option("RL steps (rollout, update, refresh)", 16)
    prompts_per_step: int = option("prompts per step (each sampled samples_per_prompt times)", 8)
    samples_per_prompt: int = option("samples per prompt (the GRPO group; PPO may use 1)", 16)
    max_new_tokens: int = option("most tokens per response", 256)
    temperature: float = option("sampling temperature of the rollout (and of the log-probs "
                                "trained on)", 1.0)
    algorithm: str = option("grpo (group-relative advantages) or ppo (GAE over a critic: a copy "
                            "of the policy's decoder with a value head, its own optimizer)",
                            "grpo")
    # the policy's optimizer and schedule (tlt_core.optim.schedule)
    lr: float = option("AdamW learning rate (the peak of the schedule); the default suits the "
                       "embedded model, a pre-trained LLM wants about 1e-6 to 1e-5", 2e-4)
    lr_scheduler_type: str = option("learning-rate schedule after the warm-up: constant or "
                                    "cosine, per RL step", "constant")
    warmup_steps: int = option("RL steps of linear learning-rate warm-up", 0)
    min_lr_ratio: float = option("cosine: the final learning rate as a fraction of lr", 0.0)
    # the clipped surrogate: ratios outside [1 - epsilon_low, 1 + epsilon_high] stop the
    # gradient (DAPO's clip-higher: epsilon_high > epsilon_low)
    epsilon_low: float = option("clip range below: ratios under 1 - epsilon_low stop the gradient"
                                " of a negative advantage", 0.2)
    epsilon_high: float = option("clip range above: ratios over 1 + epsilon_high stop the "
                                 "gradient of a positive advantage (clip-higher: larger than "
                                 "epsilon_low, e.g. 0.28)", 0.2)
    scale_rewards: str = option("GRPO advantages (r - group mean) divided by: group (the group's "
                                "std), batch (the step's std) or none (Dr. GRPO)", "group")
    loss_agg_mode: str = option("token weights: token-mean (every token alike), seq-mean-token-"
                                "mean (every sequence alike), seq-mean-token-sum, seq-mean-token-"
                                "sum-norm (sum / max_new_tokens, Dr. GRPO)", "token-mean")
    kl_coef: float = option("KL penalty to the frozen initial policy; 0 turns it off", 0.0)
    kl_placement: str = option("the KL as a loss term (loss) or subtracted from the reward "
                               "(reward)", "loss")
    kl_estimator: str = option("per-token KL estimate: k1 (log ratio), k2 (half its square), k3 "
                               "(exp(d) - d - 1, low variance)", "k3")
    dynamic_sampling: bool = option("drop groups whose rewards are all equal and refill the step "
                                    "with new prompts (DAPO)", False)
    max_refill_rounds: int = option("dynamic sampling: most refill rounds per step (then the step"
                                    " trains on the groups it kept)", 2)
    mask_truncated_completions: bool = option("leave responses cut at max_new_tokens out of the "
                                              "loss (DAPO's overlong filtering)", False)
    overlong_buffer_len: int = option("soft overlong penalty over the last N tokens before "
                                      "max_new_tokens, growing linearly to "
                                      "-overlong_penalty_factor; 0: off", 0)
    overlong_penalty_factor: float = option("the soft overlong penalty at max_new_tokens (as a "
                                            "reward)", 1.0)
    # PPO: GAE, the critic and its optimizer (the schedule is the policy's)
    gamma: float = option("PPO: discount of GAE", 1.0)
    lam: float = option("PPO: lambda of GAE (1: Monte Carlo returns, 0: one-step TD)", 0.95)
    cliprange_value: float = option("PPO: the critic's values move at most this far from the "
                                    "rollout's before the value loss stops their gradient", 0.2)
    critic_lr: float | None = option("PPO: the critic's learning rate (none: lr; same schedule)",
                                     None)
    critic_layers: int | None = option("PPO: the critic's decoder layers, the policy's first N "
                                       "(none: all)", None)
    whiten_advantages: bool = option("PPO: advantages whitened over the step's tokens", True)
    minibatch_size: int = option("sequences per optimizer step", 128)
    micro_batch_tokens: int = option("padded tokens per forward/backward (a mini-batch runs as "
                                     "length-sorted micro-batches under this budget; same update,"
                                     " less padding)", 2048)
    ppo_epochs: int = option("passes over the step's rollouts", 1)
    max_grad_norm: float = option("gradient clipping norm", 1.0)
    seed: int = option("seed of prompts, sampling and mini-batches", 0)
    tlt: bool = option("TLT: adaptive speculative rollout and the spot-trained drafter (off: "
                       "plain decoding only, the SD-off baseline)", True)
    max_batch: int = option("engine rows per rank (the most samples decoding at once)", 64)
    suffix_drafts: bool = option("suffix-match drafts (copied from sibling and earlier responses)"
                                 " among the adaptive loop's plans", True)
    sampled_drafts: bool = option("at T > 0 the adaptive loop's plans are sampled chains: each "
                                  "draft token drawn from the drafter's distribution, accepted "
                                  "with 1 - TV(target, drafter), where the deterministic chains "
                                  "and trees it replaces are accepted with the target's "
                                  "probability of each token", False)
    drafter_unroll: int = option("drafting steps the spot trainer unrolls each position over "
                                 "(EAGLE-3's training-time test, as `tlt drafter train "
                                 "--unroll`); 1: teacher-forced only; a step costs about this "
                                 "many times more", 1)
    plans_from: Path | None = option("the adaptive loop's draft plans from a `tlt bench "
                                     "speculative --json` file: of its rows at this run's "
                                     "temperature, the plan with the highest speedup at each "
                                     "batch size it measured; its rates predict where "
                                     "calibration timed nothing (none: the built-in plans, "
                                     "with --sampled-drafts' chains)", None, metavar="FILE")
    calibration_cache: Path | None = option("a folder of cached calibrations: a run whose model "
                                            "shape, dtype, drafter form, plans, engine settings, "
                                            "calibration prompts and machine match an earlier "
                                            "run's reads its cost model instead of calibrating "
                                            "(none: calibrate every run)", None, metavar="DIR")
    # The log-probs PPO's ratio divides by: "rollout" (the engine's, free; exact in float32),
    # "recompute" (the trainer's own pass before the update, as veRL does), "auto" (recompute
    # when the policy is not float32: in bf16 the engine's fused inference pass and the
    # training pass round differently, by up to 0.4-0.6 nats at a token on SmolLM2-135M in
    # `tlt train --model` on the arithmetic set)
    old_logprobs: str = option("the log-probs PPO's ratio divides by: rollout (the engine's), "
                               "recompute (the trainer's own pass first), auto (recompute for "
                               "bf16/fp16 policies and forced lengths)", "auto")
    # held-out evaluation (tlt_core.rl.evaluation): every eval_every steps (0: never)
    eval_every: int = option("evaluate on the held-out prompts every N steps (0: never); the "
                             "embedded task has its own, --model needs --eval-data", 0)
    eval_samples: int = option("samples per held-out prompt (pass@k for k up to this)", 4)
    pass_threshold: float = option("a held-out sample passes when its reward is at least this",
                                   1.0)

    def as_record(self) -> dict:
        """Every field as JSON data (a checkpoint's config, a benchmark file's, wandb's): paths
        as text."""
        return {name: str(value) if isinstance(value, Path) else value
                for name, value in asdict(self).items()}

    @property
    def critic_peak_lr(self) -> float:
        """The critic's learning rate before the schedule: critic_lr, else the policy's."""
        return self.lr if self.critic_lr is None else self.critic_lr

    def __post_init__(self):
        positive = ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                    "minibatch_size", "micro_batch_tokens", "ppo_epochs", "max_batch",
                    "eval_samples", "drafter_unroll")
        for name in positive:
            _check_int(self, name, 1)
        for name in ("warmup_steps", "max_refill_rounds", "overlong_buffer_len", "eval_every"):
            _check_int(self, name, 0)
        for name in ("lr", "max_grad_norm", "temperature", "epsilon_high", "cliprange_value",
                     "overlong_penalty_factor") + (("critic_lr",) if self.critic_lr is not None
                                                   else ()):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        for name, low, high in (("epsilon_low", 0, 1), ("min_lr_ratio", 0, 1), ("gamma", 0, 1),
                                ("lam", 0, 1)):
            value = getattr(self, name)
            if not (_is_number(value) and low <= value <= high) or (
                    name == "epsilon_low" and value in (0, 1)):
                bounds = "(0, 1)" if name == "epsilon_low" else "[0, 1]"
                raise ValueError(f"{name}: must be in {bounds}, got {value!r}")
        if not (_is_number(self.kl_coef) and math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        if not _is_number(self.pass_threshold) or not math.isfinite(self.pass_threshold):
            raise ValueError(f"pass_threshold: must be a finite number, got "
                             f"{self.pass_threshold!r}")
        if self.critic_layers is not None:
            _check_int(self, "critic_layers", 1)
        if isinstance(self.plans_from, str):
            object.__setattr__(self, "plans_from", Path(self.plans_from))
        if self.plans_from is not None and not isinstance(self.plans_from, Path):
            raise ValueError(f"plans_from: a path to a `tlt bench speculative --json` file, got "
                             f"{self.plans_from!r}")
        if self.plans_from is not None and self.sampled_drafts:
            raise ValueError("sampled_drafts: with plans_from (--plans-from) the file's plans "
                             "are the adaptive loop's, sampled chains among them where they "
                             "measured best; leave sampled_drafts off")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {allowed}, got {getattr(self, name)!r}")
        if self.algorithm == "grpo" and self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt: GRPO compares samples of one prompt; need >= 2")
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt: dynamic sampling drops groups whose samples "
                             "all scored the same; need >= 2 samples per prompt")
        if self.overlong_buffer_len >= self.max_new_tokens:
            raise ValueError(f"overlong_buffer_len: must be below max_new_tokens "
                             f"({self.max_new_tokens}), got {self.overlong_buffer_len}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(config, name: str, least: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name}: must be an int >= {least}, got {value!r}")
