"""TRL's GRPOTrainer generating with tlt_core's rollout engine: speculative, adaptive, lossless.

The extension point (TRL 1.16, `GRPOTrainer(rollout_func=...)`, experimental there): before each
generation TRL calls `rollout_func(prompts, trainer)` with this process's prompts — TRL's
RepeatSampler has already repeated each prompt `num_generations` times, consecutively, so one
completion per entry is due — and takes back a dict with "prompt_ids", "completion_ids" and
"logprobs" (lists, one entry per prompt given; a log-prob per completion token). Other keys go to
the reward functions; `TLTRollout` adds none.

`TLTRollout` is such a function. Each call:
1. Weight sync: when `trainer.state.global_step` moved since the engine's weights were last
   copied, the trainer's model (unwrapped) is copied into the engine's target with
   `load_state_dict` (names map 1:1, as in tlt_core.model.checkpoint). That writes the
   parameters in place, so the engine's packed copy of them is rebuilt, and the drafter, which
   reads the target's embedding, norm and head, sees the new ones. The same moment TRL syncs
   vLLM. A PEFT LoRA model (GRPOTrainer's `peft_config`) is copied merged: base +
   B @ A * scaling per adapted layer, computed into new tensors by
   `peft_weights.merged_weights`, the trainer's adapters left unmerged.
2. Prompts are tokenized by TRL's own code (`trainer._tokenize_prompts`, chat template included),
   so the ids are the ones TRL's built-in generation would use.
3. Consecutive equal prompts become one `Request(n=run length)`, a GRPO group (siblings share
   suffix-match drafts), sampled at the trainer's temperature / top-k / top-p up to
   `max_completion_length` tokens or one of `trainer.eos_token_ids` (kept, as TRL keeps EOS).
   Seeds: (seed, process, call, request), so every call draws fresh samples.
4. `engine.generate(requests, strategy)`: None (plain decoding), a Strategy / SuffixMatch
   plan, a PlanPolicy or function of the batch size, or "adaptive" (AdaptivePolicy calibrated
   on the engine at first use).
5. Returns the rollouts' prompt ids, tokens and target log-probs; records a `RolloutCall` in
   `calls` and, where TRL offers it, logs `rollout/*` and `spec/*` metrics next to TRL's own.

Precision: the engine's log-probs are its target's dtype (float32 when built from the trainer's
model); TRL recomputes them under `accelerator.autocast()`, in bf16 with GRPOConfig's default
bf16=True. A warning at the first call names such a mismatch and the setting that removes it.

Log-probs, honestly: without vLLM, TRL 1.16 uses the returned log-probs only for its off-policy
mask (`off_policy_mask_threshold`); its importance-sampling correction and its
`sampling/sampling_logp_difference` metrics run only with `use_vllm=True`, which makes TRL build
and drive vLLM itself, so they cannot be turned on for another generator. `check_logprobs=True`
computes the same difference here: it runs TRL's own recomputation
(`trainer._get_per_token_logps_and_entropies`, the function that gives TRL's
`old_per_token_logps`) on the returned completions and logs `rollout/sampling_logp_difference/max`
and `/mean` (one extra forward over the batch). Speculative decoding is lossless, so with the
weights synced the gap is float noise (~1e-6); the engine's log-probs are of the distribution it
sampled from, after top-k / top-p, while TRL's recomputation applies the temperature only, so
the two agree where top_k = 0 and top_p = 1 (TRL's defaults).

Chosen from TRL's config: `trl_trainer.TLTGRPOConfig(use_tlt=True)` with `TLTGRPOTrainer`.

Not supported (a clear error at the first call): vLLM, tools / environments (TRL would continue
generation with its own model), images, `repetition_penalty` != 1, `min_p`,
`generation_kwargs`, DeepSpeed / FSDP (the model would need gathering before the copy), and
PEFT methods other than plain LoRA (DoRA, prompt / prefix tuning, LoRA on a tied embedding;
see peft_weights). The
drafter is not trained here: spot training needs tlt_core's worker group (tlt_core.workers);
with a fixed drafter, SD's acceptance drops as the policy drifts, never its correctness.

Private TRL attributes used (checked against TRL 1.16): `_tokenize_prompts`,
`_get_per_token_logps_and_entropies` (only with check_logprobs) and `_log_metric` (skipped when
absent).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.plan import DraftPlan
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.hooks import Speculation
from tlt_core.engine.records import Request, RolloutResult, SamplingParams
from tlt_core.engine.sampling import sample_seed
from tlt_core.integrations.engine_setup import calibrated_policy, default_plans, prompt_groups
from tlt_core.integrations.peft_weights import merged_weights
from tlt_core.integrations.weights import load_hf_weights
from tlt_core.model.transformer import ModelConfig, Transformer

__all__ = ["TLTRollout", "RolloutCall", "transformer_from_hf"]

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class RolloutCall:
    """One rollout_func call, as the adapter saw it."""

    global_step: int  # trainer.state.global_step at the call
    weights_step: int  # the global_step whose weights the engine generated with
    samples: int
    tokens: int  # completion tokens generated
    seconds: float  # engine.generate only
    acceptance_length: float | None  # tokens per speculative step and row; None: no SD step
    sd_steps: int  # speculative steps
    decode_steps: int  # all engine steps
    logprob_gap_max: float | None = None  # check_logprobs: max |ours - TRL's recomputation|
    logprob_gap_mean: float | None = None
    # acceptance_length per context bucket ("0-256", "256-1k", "1k+"), None where no row-step
    # fell: drafters lose acceptance deep into long responses, which the overall mean hides
    acceptance_by_position: dict[str, float | None] = field(default_factory=dict)


def transformer_from_hf(hf_model: torch.nn.Module) -> Transformer:
    """A tlt_core Transformer with hf_model's config and a copy of its weights (Llama, Qwen2 and
    Qwen3 families; a PEFT LoRA model's merged), on hf_model's device in float32."""
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    device = next(hf_model.parameters()).device
    with torch.device(device):
        model = Transformer(config)
    _copy_weights(merged_weights(hf_model), model)
    return model.eval()


def _copy_weights(weights: dict[str, torch.Tensor], target: Transformer) -> None:
    """weights (by transformers' names, as `merged_weights` gives them) into target's, in place
    (tlt_core.integrations.weights)."""
    load_hf_weights(target, weights, source="model: the trainer's model", strict=False)


class TLTRollout:
    """A `rollout_func` for TRL's GRPOTrainer backed by a tlt_core RolloutEngine.

    target: the engine's model, a tlt_core Transformer of the trainer's model's architecture (its
    weights are overwritten from the trainer's at the first call); None builds one from the
    trainer's model. drafter: a Drafter attached to target, a drafter folder (`Drafter.load`
    onto the target once it is built), or None.
    strategy: None, a Strategy / SuffixMatch plan, a PlanPolicy or function of the batch size,
    or "adaptive": an AdaptivePolicy over `plans` (default: DEFAULT_PLANS and SuffixMatch(8)),
    calibrated at the first call on up to max_batch rows.
    engine_config: None means max_batch = the first call's sample count (TRL's per-process
    generation batch); max_len grows as prompts need. seed: the base of every sample's seed.
    check_logprobs: compare with TRL's recomputation at every call (one extra forward)."""

    def __init__(self, target: Transformer | None = None, *,
                 drafter: Drafter | str | os.PathLike | None = None,
                 strategy: Speculation | str = ADAPTIVE, plans: Sequence[DraftPlan] | None = None,
                 engine_config: EngineConfig | None = None, seed: int = 0,
                 check_logprobs: bool = False):
        if isinstance(drafter, Drafter) and (target is None or drafter.target is not target):
            raise ValueError("drafter: must be attached to `target` (Drafter(target) or "
                             "Drafter.load(folder, target))")
        self.adaptive = isinstance(strategy, str)
        if self.adaptive and strategy != ADAPTIVE:
            raise ValueError(f"strategy: expected None, a plan, a callable or {ADAPTIVE!r}, "
                             f"got {strategy!r}")
        self.target, self.drafter, self.plans = target, drafter, plans
        self.engine_config, self.seed, self.check_logprobs = engine_config, seed, check_logprobs
        self.engine: RolloutEngine | None = None
        # what engine.generate gets; the adaptive policy is built with the engine
        self.policy: Speculation = None if self.adaptive else strategy
        self.calls: list[RolloutCall] = []
        self._weights_step: int | None = None

    # ---- the rollout_func ------------------------------------------------------------------

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if not self.calls:
            _check_supported(trainer)
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
        if images is not None:
            raise ValueError("prompts: images are not supported by TLTRollout")
        prompt_ids = [list(map(int, ids)) for ids in prompt_ids]
        model = trainer.accelerator.unwrap_model(trainer.model)
        max_tokens = int(trainer.max_completion_length)
        self._ensure_engine(model, max(map(len, prompt_ids)) + max_tokens, prompt_ids, trainer)
        step = int(trainer.state.global_step)
        if self._weights_step != step:
            _copy_weights(merged_weights(model), self.target)
            self._weights_step = step

        params = SamplingParams(temperature=float(trainer.temperature),
                                top_k=int(trainer.top_k or 0), top_p=float(trainer.top_p),
                                max_tokens=max_tokens, stop_ids=tuple(trainer.eos_token_ids))
        process = int(trainer.accelerator.process_index)
        requests = []
        for index, (ids, count) in enumerate(prompt_groups(prompt_ids)):
            seed = sample_seed(self.seed + 1_000_003 * process, len(self.calls), index)
            requests.append(Request(ids, replace(params, n=count, seed=seed)))
        result = self.engine.generate(requests, self.policy)
        completion_ids = [r.tokens.tolist() for r in result.rollouts]
        logprobs = [r.logprobs.tolist() for r in result.rollouts]
        expanded_prompts = [list(r.prompt_ids) for r in result.rollouts]
        gap = (self._logprob_gap(trainer, model, expanded_prompts, completion_ids, logprobs)
               if self.check_logprobs else None)
        self._record(trainer, step, result, gap)
        return {"prompt_ids": expanded_prompts, "completion_ids": completion_ids,
                "logprobs": logprobs}

    # ---- helpers -------------------------------------------------------------------------

    def _ensure_engine(self, model, need: int, prompt_ids: list[list[int]], trainer) -> None:
        """Builds the engine at the first call (and again, larger, when a prompt needs it)."""
        if self.engine is not None and need <= self.engine.config.max_len:
            return
        if self.target is None:
            self.target = transformer_from_hf(model)
        if self.drafter is not None and not isinstance(self.drafter, Drafter):
            self.drafter = Drafter.load(self.drafter, self.target)
        if self.engine is None:
            _warn_precision_gap(trainer, model, self.target)
        if self.engine_config is None:  # rows for a whole call: TRL's generation batch
            self.engine_config = EngineConfig(max_batch=len(prompt_ids))
        max_len = max(need, self.engine_config.max_len if self.engine is None
                      else 2 * self.engine.config.max_len)
        self.engine = RolloutEngine(self.target, replace(self.engine_config, max_len=max_len),
                                    self.drafter)
        if self.adaptive and self.policy is None:
            _copy_weights(merged_weights(model), self.target)  # calibrate on the trainer's
            self.policy = calibrated_policy(self.engine, self.plans or default_plans(),
                                            prompt_ids, float(trainer.temperature))

    def _logprob_gap(self, trainer, model, prompt_ids, completion_ids, logprobs):
        """max and mean |ours - TRL's recomputation| over completion tokens, with TRL's padding
        (prompts left, completions right) and TRL's function."""
        from trl.trainer.utils import pad

        device = next(model.parameters()).device
        pad_id = trainer._tokenizer.pad_token_id
        prompts = pad([torch.tensor(p) for p in prompt_ids], padding_value=pad_id,
                      padding_side="left")
        prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids],
                          padding_value=0, padding_side="left")
        completions = pad([torch.tensor(c) for c in completion_ids], padding_value=pad_id,
                          padding_side="right")
        completion_mask = pad([torch.ones(len(c), dtype=torch.long) for c in completion_ids],
                              padding_value=0, padding_side="right")
        ours = pad([torch.tensor(lp) for lp in logprobs], padding_value=0.0,
                   padding_side="right")
        with torch.no_grad():
            theirs, _, _ = trainer._get_per_token_logps_and_entropies(
                model, torch.cat([prompts, completions], 1).to(device),
                torch.cat([prompt_mask, completion_mask], 1).to(device), completions.shape[1])
        gap = (theirs.float().cpu() - ours).abs()[completion_mask.bool()]
        return float(gap.max()), float(gap.mean())

    def _record(self, trainer, step: int, result: RolloutResult,
                gap: tuple[float, float] | None) -> None:
        call = RolloutCall(
            global_step=step, weights_step=self._weights_step, samples=len(result.rollouts),
            tokens=sum(len(r.tokens) for r in result.rollouts), seconds=result.total_s,
            acceptance_length=result.acceptance_length, sd_steps=len(result.spec_steps),
            decode_steps=result.decode_steps,
            logprob_gap_max=None if gap is None else gap[0],
            logprob_gap_mean=None if gap is None else gap[1],
            acceptance_by_position=result.acceptance_by_position)
        self.calls.append(call)
        log = getattr(trainer, "_log_metric", None)
        if log is None:
            return
        log("rollout/time_s", call.seconds)
        log("spec/sd_step_share", call.sd_steps / max(call.decode_steps, 1))
        if call.acceptance_length is not None:
            log("spec/acceptance_length", call.acceptance_length)
        for bucket, length in call.acceptance_by_position.items():
            if length is not None:
                log(f"spec/acceptance_length/{bucket}", length)
        if gap is not None:
            log("rollout/sampling_logp_difference/max", gap[0])
            log("rollout/sampling_logp_difference/mean", gap[1])


def _check_supported(trainer: Any) -> None:
    """What TLTRollout cannot honour, named before anything is generated."""
    problems = []
    if getattr(trainer, "use_vllm", False):
        problems.append("use_vllm=True (TRL then drives vLLM itself; drop it)")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        problems.append("tools / environment_factory (TRL would continue generation with "
                        "its own model)")
    if float(getattr(trainer, "repetition_penalty", 1.0) or 1.0) != 1.0:
        problems.append("repetition_penalty != 1 (the engine samples the model's distribution)")
    if getattr(trainer, "min_p", None) is not None:
        problems.append("min_p (the engine supports temperature, top_k and top_p)")
    if getattr(trainer.args, "generation_kwargs", None):
        problems.append("generation_kwargs (the engine ignores transformers' generation options)")
    if any(getattr(trainer, name, False) for name in ("is_deepspeed_enabled", "is_fsdp_enabled")):
        problems.append("DeepSpeed / FSDP (sharded parameters would need gathering to sync)")
    if problems:
        raise ValueError("TLTRollout: unsupported GRPOConfig setting(s): " +
                                  "; ".join(problems))
    if float(trainer.top_p) < 1 or int(trainer.top_k or 0) > 0:
        warnings.warn("TLTRollout: with top_k / top_p on, the engine's log-probs are those of "
                      "the truncated distribution it sampled from; TRL's recomputation applies "
                      "the temperature only, so the two differ by the log of the kept mass",
                      stacklevel=3)


def _trainer_compute_dtype(trainer: Any, model: torch.nn.Module) -> torch.dtype:
    """The dtype of TRL's log-prob forwards: accelerate's autocast dtype under GRPOConfig bf16 /
    fp16 (TRL wraps `_get_per_token_logps_and_entropies`'s forward in
    `accelerator.autocast()`), else the model's own parameter dtype."""
    args = getattr(trainer, "args", None)
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return next(model.parameters()).dtype


def _warn_precision_gap(trainer: Any, model: torch.nn.Module, target: Transformer) -> None:
    """Warns when the engine's log-probs and TRL's recomputation of them are computed in
    different dtypes: the two then differ by rounding (about 1e-2 per token in bf16), which TRL
    reads as off-policy drift, and TRL corrects for it (vllm_importance_sampling_correction)
    only on its vLLM path."""
    engine_dtype = next(target.parameters()).dtype
    trainer_dtype = _trainer_compute_dtype(trainer, model)
    if engine_dtype == trainer_dtype:
        return
    flag = next((name for name in ("bf16", "fp16")
                 if getattr(getattr(trainer, "args", None), name, False)), None)
    if flag is not None:
        default = " (TRL's default)" if flag == "bf16" else ""
        cause = (f"TRL recomputes them (old_per_token_logps and the loss's per_token_logps) "
                 f"under {trainer_dtype} autocast, as GRPOConfig {flag}=True{default} asks")
        fix = f"Set {flag}=False and load the model in float32 for equal log-probs"
    else:
        cause = f"TRL recomputes them with its {trainer_dtype} model"
        fix = f"Give TLTRollout a {trainer_dtype} target for equal log-probs"
    warnings.warn(f"TLTRollout: the engine computes log-probs in {engine_dtype} while {cause}; "
                  "the two differ by rounding, which TRL's off-policy mask and loss read as a "
                  f"policy change. {fix} (check_logprobs=True measures the gap)", stacklevel=4)
