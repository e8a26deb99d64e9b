"""The settings of the drafter's offline warm-up (`OfflineConfig`): the RL sampling settings
the target's responses are drawn with, the drafter's form, the training's length, batch size,
learning rate, warm-up, unrolled steps, loss weights, matmul dtype and checkpoint interval, and
the held-out measurement's length. Validated at construction, with messages that name the
field; every phase reads what it needs from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_core.drafting.drafter import DrafterConfig
from tlt_core.drafting.training import REGRESSION_WEIGHT, REJECTION_WEIGHT, check_loss_weight
from tlt_core.drafting.unrolled import check_unroll
from tlt_core.model.placement import cpu_bf16_flag


MATMUL_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class OfflineConfig:
    # the RL sampling settings the responses are drawn with
    temperature: float = 1.0
    max_tokens: int = 512
    samples_per_prompt: int = 1
    # responses (and the held-out measurement's) run to max_tokens past the model's end of
    # turn, as a fixed-length benchmark decodes them (vLLM's --ignore-eos; `tlt bench
    # rollout`'s trace and no_tail workloads): a drafter for the text such a run verifies
    ignore_eos: bool = False
    rollout_batch: int = 64  # rows the engine runs at once (and prompts per response shard)
    held_out: int = 16  # the last prompts: never trained on, the acceptance measurement's
    # the drafter
    form: str = "eagle"
    feature_layers: tuple[int, ...] = (-1,)
    draft_vocab: int | None = 8192  # V'; None: the target's whole vocabulary
    # training
    steps: int = 400
    batch_tokens: int = 4096  # padded positions per batch
    lr: float = 2e-3
    warmup: int = 30
    # drafting steps each position trains on, step k from the drafter's own output of step
    # k - 1 (the training-time test, tlt_core.drafting.unrolled); 1: teacher-forced EAGLE
    # alone. A step costs about `unroll` teacher-forced ones (about 3x for 3 at SmolLM2's
    # shape on the CPU, which would double the default CPU run: hence the default of 1).
    unroll: int = 1
    # the weight of the loss's rejection term, the probability that a token sampled from the
    # drafter is rejected at T = 1 (tlt_core.drafting.training); 0: EAGLE's loss alone
    rejection_weight: float = REJECTION_WEIGHT
    # the weight of the loss's feature-regression term; 0 trains on tokens alone, as EAGLE-3
    # trains a drafter on fused features (feature_layers of several layers)
    regression_weight: float = REGRESSION_WEIGHT
    # the dtype of the loss's matmuls (the weights and AdamW stay float32): "auto" is bfloat16
    # for a bf16 target on hardware that multiplies bf16 natively (CUDA, or a CPU with
    # AMX-BF16 / AVX512-BF16: 1.5x a float32 step on avx512_bf16, bench/drafter_step.py; on an
    # AVX2-only CPU bf16 products are emulated and slower than float32), float32 for any other
    matmul_dtype: str = "auto"
    checkpoint_every: int = 100
    seed: int = 0
    # held-out acceptance (greedy and T = 1), as many rows at once
    eval_max_tokens: int = 256

    def decode_stop_ids(self, stop_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids a response ends at: the model's, or none under ignore_eos."""
        return () if self.ignore_eos else stop_ids

    def matmul_torch_dtype(self, target_dtype: torch.dtype,
                           device: torch.device = torch.device("cpu")) -> torch.dtype | None:
        """train_step's matmul_dtype for a target of target_dtype on `device` (None: float32
        throughout)."""
        if self.matmul_dtype == "auto":
            native = device.type == "cuda" or cpu_bf16_flag() is not None
            chosen = "bfloat16" if target_dtype == torch.bfloat16 and native else "float32"
        else:
            chosen = self.matmul_dtype
        return torch.bfloat16 if chosen == "bfloat16" else None

    def __post_init__(self):
        for name in ("max_tokens", "samples_per_prompt", "rollout_batch", "steps",
                     "batch_tokens", "checkpoint_every", "eval_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if not isinstance(self.held_out, int) or self.held_out < 1:
            raise ValueError(f"held_out: must be an int >= 1 (the acceptance is measured on "
                             f"them), got {self.held_out!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        check_unroll(self.unroll)
        check_loss_weight("rejection_weight", self.rejection_weight)
        check_loss_weight("regression_weight", self.regression_weight)
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype: must be one of {', '.join(MATMUL_DTYPES)}, got "
                             f"{self.matmul_dtype!r}")
        DrafterConfig(self.feature_layers, self.form, self.draft_vocab)  # validates those
