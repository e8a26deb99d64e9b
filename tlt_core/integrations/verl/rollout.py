"""veRL's rollout interface (0.9: `verl.workers.rollout.BaseRollout`) backed by tlt_core's
rollout engine: speculative, adaptive, lossless. Imports veRL; nothing else in tlt_core does.

veRL builds a rollout by name (`actor_rollout_ref.rollout.name: tlt`, looked up in its rollout
registry, see registration.py) as `cls(config=RolloutConfig, model_config=HFModelConfig,
device_mesh=...)` on each rollout worker, and drives it through:

- `generate_sequences(DataProto) -> DataProto`: prompts in veRL's layout (batch.py) become one
  engine call: consecutive equal prompts are one GRPO group (`Request(n=count)`), sampled as
  meta_info and the config say, seeds (config.seed, call, group); the output holds veRL's
  response tensors and the input's non-tensor fields and meta_info, plus `metrics` in
  meta_info under tlt_core's `rollout/` and `spec/` names (docs/metrics.md).
- `generate_token_requests(requests)`: the agent-loop requests a tlt server collected
  (server.py, token_requests.py) as one engine call, equal prompts with equal params one group.
- `update_weights(weights)`: the actor's (name, tensor) stream in Hugging Face naming, copied
  into the target in place (tlt_core.integrations.weights, the TRL adapter's mechanism); the
  drafter reads the target's embedding, norm and head, so it follows.
- `release()` (sleep): drops the engine, i.e. the KV cache, the drafter's per-row state and the
  suffix-match history; `resume(tags=["kv_cache"])` (wake) rebuilds it at the size it had.
  The target and drafter weights stay where they are: `resume(tags=["weights"])` has nothing to
  restore (SGLang's sleep level 1 behaves the same).

The engine is built at the first generation: max_batch = engine_kwargs.tlt.max_batch (more
rows queue: the engine batches continuously) or, unset, the batch's rows, max_len = the longest
prompt + response budget; it is rebuilt larger when a batch needs more (rows only while
max_batch is unset). "adaptive" calibrates its policy at the first build, on the weights of
that moment (options.py has the settings).

Not supported (an error at construction): tensor / pipeline parallel rollout
(tensor_model_parallel_size and pipeline_model_parallel_size must be 1), repetition_penalty
!= 1, LoRA adapters in update_weights (veRL's `lora.merge: true` sends merged weights, which
work), wire_format "delta_flush".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Generator, Iterable, Sequence

import torch
from tensordict import TensorDict
from verl import DataProto
from verl.workers.rollout.base import BaseRollout

from tlt_core.drafting.drafter import Drafter
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.hooks import Speculation
from tlt_core.engine.records import Request, RolloutResult, SamplingParams
from tlt_core.engine.sampling import sample_seed
from tlt_core.integrations.engine_setup import calibrated_policy, default_plans, prompt_groups
from tlt_core.integrations.verl.batch import read_prompts, read_sampling, response_tensors
from tlt_core.integrations.verl.options import ADAPTIVE, TLTRolloutOptions
from tlt_core.integrations.verl.token_requests import TokenRequest, TokenResult
from tlt_core.integrations.weights import load_hf_weights
from tlt_core.model.checkpoint import load_checkpoint

WEIGHTS, KV_CACHE = "weights", "kv_cache"
NAMED_TENSORS = "named_tensors"


class TLTVerlRollout(BaseRollout):
    """A veRL rollout generating with a tlt_core RolloutEngine (module docstring)."""

    def __init__(self, config, model_config, device_mesh=None, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        _check_supported(self.config)
        self.options = TLTRolloutOptions.from_engine_kwargs(self.config.engine_kwargs)
        device = self.options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        path = self.model_config.local_path or self.model_config.path
        self.target = load_checkpoint(path, dtype=self.config.dtype, device=device)
        self.drafter = (None if self.options.drafter is None else
                        Drafter.load(self.options.drafter, self.target).eval())
        plans = [self.options.fixed_plan(), *self.options.adaptive_plans()]
        if self.drafter is None and any(p is not None and p.uses_drafter for p in plans):
            raise ValueError("engine_kwargs.tlt.drafter: the strategy's plans need a learned "
                             "drafter; give its folder, or use suffix(D) plans")
        self.stop_ids, self.pad_token_id = model_token_ids(self.model_config)
        self.engine: RolloutEngine | None = None
        self.engine_config: EngineConfig | None = None  # the last engine's, kept while asleep
        self.policy: Speculation = self.options.fixed_plan()
        self.awake = True
        self.calls = 0  # generate_sequences calls, a component of the seeds
        self.weights_step: int | None = None  # global_steps of the last update_weights

    # ---- generation ------------------------------------------------------------------------

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """veRL's rollout output for prompts (batch.py has both layouts)."""
        batch = read_prompts(prompts.batch)
        sampling = read_sampling(prompts.meta_info, self.config, self.stop_ids,
                                 self.pad_token_id)
        params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                top_p=sampling.top_p, max_tokens=sampling.response_length,
                                stop_ids=sampling.stop_ids)
        result = self._generate(prompt_groups(batch.prompt_ids), params.temperature,
                                [params] * len(batch.prompt_ids), "generate_sequences")
        tensors = response_tensors(batch, [r.tokens for r in result.rollouts],
                                   [r.logprobs for r in result.rollouts],
                                   sampling.response_length, sampling.pad_token_id)
        meta_info = dict(prompts.meta_info)
        meta_info["metrics"] = {**meta_info.get("metrics", {}), **rollout_metrics(result)}
        return DataProto(batch=TensorDict(tensors, batch_size=len(batch.prompt_ids)),
                         non_tensor_batch=dict(prompts.non_tensor_batch), meta_info=meta_info)

    def generate_token_requests(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        """The agent-loop requests a tlt server collected (server.py), as one engine call;
        each one's result in the order given. Requests with equal prompts and params run as
        one group (`Request(n=count)`), as the n samples of a GRPO prompt arrive."""
        if not requests:
            raise ValueError("requests: empty; the server sends at least one")
        groups: dict[tuple, list[int]] = {}  # (prompt, params) -> positions in requests
        for position, request in enumerate(requests):
            groups.setdefault((request.prompt_ids, request.params), []).append(position)
        result = self._generate([(prompt, len(positions))
                                 for (prompt, _), positions in groups.items()],
                                requests[0].params.temperature,
                                [params for _, params in groups], "generate_token_requests")
        positions = list(groups.values())
        results: list[TokenResult | None] = [None] * len(requests)
        for rollout in result.rollouts:
            position = positions[rollout.request_index][rollout.sample_index]
            results[position] = TokenResult(rollout.tokens.tolist(), rollout.logprobs.tolist(),
                                            rollout.finish_reason, self.weights_step)
        return results

    def _generate(self, groups: list[tuple[tuple[int, ...], int]], temperature: float,
                  params: list[SamplingParams], caller: str) -> RolloutResult:
        """One engine call over (prompt, samples) groups, group i sampled with params[i] and
        seeds (config.seed, call, i)."""
        if not self.awake:
            raise RuntimeError(f"{caller}: the rollout is asleep (release() was called); "
                               "resume(tags=['kv_cache']) first")
        prompts = [prompt for prompt, _ in groups]
        need = max(len(prompt) + p.max_tokens for prompt, p in zip(prompts, params))
        self._ensure_engine(sum(count for _, count in groups), need, prompts, temperature)
        requests = [Request(prompt, replace(p, n=count,
                                            seed=sample_seed(self.config.seed, self.calls, index)))
                    for index, ((prompt, count), p) in enumerate(zip(groups, params))]
        result = self.engine.generate(requests, self.policy)
        self.calls += 1
        return result

    def _ensure_engine(self, rows: int, need: int, prompt_ids: list[tuple[int, ...]],
                       temperature: float) -> None:
        """Builds the engine at the first call, and again, larger, when a batch has more rows
        than it holds (unless max_batch is set) or longer sequences."""
        grow_rows = self.options.max_batch is None and self.engine is not None and \
            rows > self.engine.config.max_batch
        if self.engine is not None and need <= self.engine.config.max_len and not grow_rows:
            return
        if self.engine_config is None:
            self.engine_config = EngineConfig(max_batch=self.options.max_batch or rows,
                                              max_len=need, seed=self.config.seed)
        max_batch = self.engine_config.max_batch
        if self.options.max_batch is None:
            max_batch = max(max_batch, rows)
        self.engine_config = replace(self.engine_config, max_batch=max_batch,
                                     max_len=max(need, self.engine_config.max_len))
        self.engine = RolloutEngine(self.target, self.engine_config, self.drafter)
        if self.options.strategy == ADAPTIVE and self.policy is None:
            plans = self.options.adaptive_plans() or default_plans()
            self.policy = calibrated_policy(self.engine, plans, prompt_ids, temperature)

    # ---- weights and sleep -----------------------------------------------------------------

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None] |
                             Iterable[tuple[str, torch.Tensor]], wire_format: str = NAMED_TENSORS,
                             **kwargs: Any) -> None:
        """The actor's weights, (name, tensor) in Hugging Face naming, into the target."""
        if wire_format != NAMED_TENSORS:
            raise ValueError(f"wire_format: the tlt rollout takes {NAMED_TENSORS!r}, got "
                             f"{wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("peft_config: the tlt rollout takes full weights, not LoRA "
                             "adapters; set actor_rollout_ref.model.lora.merge=true")
        load_hf_weights(self.target, weights, source="weights")
        if kwargs.get("global_steps") is not None:
            self.weights_step = int(kwargs["global_steps"])

    async def release(self) -> None:
        """Sleep: frees the KV cache and the drafter's per-row state (the engine)."""
        self.drop_engine()

    async def resume(self, tags: list[str]) -> None:
        """Wake: "kv_cache" rebuilds the engine at its last size; "weights" has nothing to
        restore (release() keeps them)."""
        self.restore_engine(tags)

    # The two steps of release / resume, callable where no event loop can await them: a tlt
    # server runs them on the veRL worker that holds this rollout (server.py).

    def drop_engine(self) -> None:
        """release()'s step."""
        self.engine, self.awake = None, False
        if self.target.lm_head.weight.is_cuda:
            torch.cuda.empty_cache()

    def restore_engine(self, tags: Sequence[str]) -> None:
        """resume(tags)'s step."""
        unknown = sorted(set(tags) - {WEIGHTS, KV_CACHE})
        if unknown:
            raise ValueError(f"tags: expected {WEIGHTS!r} and/or {KV_CACHE!r}, got {unknown}")
        if KV_CACHE in tags:
            if self.engine is None and self.engine_config is not None:
                self.engine = RolloutEngine(self.target, self.engine_config, self.drafter)
            self.awake = True


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    """One engine call's metrics under tlt_core's names (docs/metrics.md); an acceptance
    length only where some step was speculative."""
    lengths = [len(r.tokens) for r in result.rollouts]
    metrics = {
        "rollout/time_s": result.total_s,
        "rollout/response_length_mean": sum(lengths) / max(len(lengths), 1),
        "rollout/truncated_fraction": (sum(r.finish_reason == "length" for r in result.rollouts)
                                       / max(len(lengths), 1)),
        "spec/sd_step_share": len(result.spec_steps) / max(result.decode_steps, 1),
    }
    if result.acceptance_length is not None:
        metrics["spec/acceptance_length"] = result.acceptance_length
    for bucket, length in result.acceptance_by_position.items():
        if length is not None:
            metrics[f"spec/acceptance_length/{bucket}"] = length
    return metrics


def model_token_ids(model_config) -> tuple[tuple[int, ...], int]:
    """(stop ids, pad id) of the model: its generation config's eos ids, else its config's;
    pad: the config's pad id, else the first stop id, else 0 (pad positions are masked)."""
    sources = [getattr(model_config, "generation_config", None),
               getattr(model_config, "hf_config", None)]
    eos = next((getattr(s, "eos_token_id", None) for s in sources
                if getattr(s, "eos_token_id", None) is not None), None)
    stop_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(map(int, eos))
    pad = getattr(sources[1], "pad_token_id", None)
    return stop_ids, int(pad) if pad is not None else (stop_ids[0] if stop_ids else 0)


def _check_supported(config) -> None:
    """What the tlt rollout cannot honour, named before anything is loaded."""
    problems = []
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(config, name) != 1:
            problems.append(f"{name}={getattr(config, name)} (one device per rollout: set 1)")
    if float(config.repetition_penalty) != 1.0:
        problems.append("repetition_penalty != 1 (the engine samples the model's distribution)")
    if problems:
        raise ValueError("rollout: unsupported setting(s) for name=tlt: " + "; ".join(problems))
