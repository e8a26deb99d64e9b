"""The GRPO driver: rollout with the adaptive loop and the spot-trained drafter, GRPO update,
weights to the engine, drafter refresh; one step at a time, checkpointed.

One step:
1. `prompts_per_step` prompts (a seeded shuffle of the data, epoch by epoch), `samples_per_prompt`
   samples each, rolled out by every rank over its shard of the prompts (`rollout_round`: SD
   through the adaptive policy when TLT is on; ranks that finish early spot-train the drafter);
   every rank then holds every rollout.
2. Rewards from the reward function (an error in it is recorded against its sample: reward 0),
   group-normalized advantages.
3. PPO-clip updates over mini-batches of `minibatch_size` sequences: rank r computes the loss of
   the mini-batch's sequences j with j mod world == r, normalized by the mini-batch's global
   token count, and DistributedDataParallel sums the gradients (it averages, so the loss is
   scaled by the world size): the update is the same for any number of ranks. A rank's share
   runs as length-sorted micro-batches of at most `micro_batch_tokens` padded tokens whose
   gradients accumulate (the long tail would otherwise pad every short sequence to its length:
   padding was a third to a half of the tokens computed). Gradient clipping, AdamW. The first
   mini-batch's log-probs, before any update, are compared with the rollout's: `logprob_gap`
   (it must be ~0; SD is lossless).
4. The engine reads the policy's weights directly (its packed copy is rebuilt when they change),
   the drafter replicas are refreshed (step-weighted average) and the watchdog judges them
   (a rollback it asks for is loaded here).
5. The step's metrics (tlt_core.rl.metrics names them); `state_dict` checkpoints everything
   that evolves: policy, optimizer, reference, drafter, spot trainer, adaptive policy, RNG, step.
   `save` writes it as a step folder (tlt_core.rl.checkpoint_io: safetensors and JSON, no
   pickle, atomic, the newest K kept), `resume` reads one back.

Determinism: sampling seeds come from (seed, step, prompt), so with SD off (or a fixed plan) a
resumed run repeats an uninterrupted one exactly; with the adaptive loop the plan choices depend
on measured step times, so the samples differ run to run (their distribution does not).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from tlt_core.adaptive.policy import DEFAULT_PLANS, SAMPLED_PLANS, AdaptivePolicy
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams, seconds_at_or_below
from tlt_core.engine.sampling import sample_seed
from tlt_core.model.transformer import Transformer
from tlt_core.rl.checkpoint_io import read_state, write_checkpoint
from tlt_core.rl.grpo import group_advantages, ppo_clip_loss, response_logprobs
from tlt_core.rl.master_weights import MasterWeightAdamW
from tlt_core.rl.rewards import RewardFn, score_all
from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.workers.refresh import refresh
from tlt_core.workers.round import rollout_round
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer
from tlt_core.workers.watchdog import DrafterWatchdog

TAIL_FRACTION = 0.25  # the tail: the running batch at or below this share of the step's peak
OLD_LOGPROBS = ("auto", "rollout", "recompute")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 16
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    lr: float = 5e-5
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0: a frozen reference and the k3 KL penalty
    minibatch_size: int = 32  # sequences per optimizer step
    micro_batch_tokens: int = 2048  # padded tokens per forward/backward within a mini-batch
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    seed: int = 0
    tlt: bool = True  # adaptive SD + spot-trained drafter; False: the SD-off baseline
    max_batch: int = 64  # engine rows per rank
    suffix_drafts: bool = True  # suffix-match plans among the adaptive loop's arms
    sampled_drafts: bool = False  # sampled chains (SAMPLED_PLANS) among them too
    # The log-probs PPO's ratio divides by: "rollout" (the engine's, free; exact in float32),
    # "recompute" (the trainer's own pass before the update, as veRL does), "auto" (recompute
    # when the policy is not float32: in bf16 the engine's fused inference pass and the
    # training pass round differently, by up to 0.4-0.6 nats at a token on SmolLM2-135M in
    # `tlt train --model` on the arithmetic set)
    old_logprobs: str = "auto"

    def __post_init__(self):
        positive = ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                    "minibatch_size", "micro_batch_tokens", "ppo_epochs", "max_batch")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        for name in ("lr", "max_grad_norm", "temperature"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps: must be in (0, 1), got {self.clip_eps}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt: GRPO compares samples of one prompt; need >= 2")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs: must be one of {OLD_LOGPROBS}, got "
                             f"{self.old_logprobs!r}")


@dataclass(frozen=True)
class Prompt:
    text: str  # what the reward function sees
    ids: tuple[int, ...]  # what the model sees
    reference: str  # the reference answer


@dataclass
class TrainState:
    step: int = 0
    history: list[dict] = field(default_factory=list)  # every step's metrics


class GRPODriver:
    """GRPO with TLT, one step at a time. detokenize maps a response's token ids to the text the
    reward function reads; stop_ids end a response."""

    def __init__(self, policy: torch.nn.Module, prompts: Sequence[Prompt], reward_fn: RewardFn,
                 detokenize: Callable[[list[int]], str], stop_ids: Sequence[int],
                 config: TrainConfig = TrainConfig(), *, drafter: Drafter | None = None,
                 calibration: Sequence[Prompt] = (), group: WorkerGroup | None = None):
        if not prompts:
            raise ValueError("prompts: need at least one prompt")
        self.config, self.policy, self.prompts = config, policy, list(prompts)
        self.reward_fn, self.detokenize, self.stop_ids = reward_fn, detokenize, tuple(stop_ids)
        self.group = group or WorkerGroup()
        if config.minibatch_size < self.group.world_size:
            raise ValueError(f"minibatch_size: {config.minibatch_size} is below the number of "
                             f"ranks ({self.group.world_size}); every rank needs a sequence")
        torch.manual_seed(config.seed)
        # bf16/fp16 policies train with float32 master weights (tlt_core.rl.master_weights)
        self.optimizer = MasterWeightAdamW(policy.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self._ddp = None
        if self.group.distributed:
            device = next(policy.parameters()).device
            self._ddp = DistributedDataParallel(
                policy, device_ids=[device.index] if device.type == "cuda" else None)
        max_len = max(len(p.ids) for p in self.prompts) + config.max_new_tokens
        engine_config = EngineConfig(max_batch=config.max_batch, max_len=max_len, seed=config.seed)
        self.drafter = drafter if config.tlt else None
        # Spot training needs a rank that went idle while others still decode: with one rank
        # there is none, so harvesting would only cost the rollout time.
        spot = self.drafter is not None and self.group.world_size > 1
        self.harvest = HarvestBuffer(max_bytes=64 << 20) if spot else None
        self.engine = RolloutEngine(policy, engine_config, self.drafter, self.harvest)
        self.spot = (SpotTrainer(self.drafter, self.harvest, SpotConfig(seed=config.seed))
                     if spot else None)
        self.watchdog = DrafterWatchdog(self.drafter) if self.drafter is not None else None
        self.adaptive = None
        if config.tlt:
            plans = (DEFAULT_PLANS + (SAMPLED_PLANS if config.sampled_drafts else ())
                     + ((SuffixMatch(8), SuffixMatch(16)) if config.suffix_drafts else ()))
            calibration_requests = [self._request(p, min(16, config.max_new_tokens), 0, i, n=1)
                                    for i, p in enumerate(calibration or self.prompts[:4])]
            self.adaptive = AdaptivePolicy.from_calibration(self.engine, plans,
                                                            calibration_requests,
                                                            seed=config.seed)
        self.state = TrainState()

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> dict:
        config, group = self.config, self.group
        step = self.state.step
        start = time.perf_counter()
        chosen = self._prompts_for(step)
        requests = [self._request(p, config.max_new_tokens, step, i)
                    for i, p in enumerate(chosen)]
        self.policy.eval()
        policy = (self.adaptive if self.adaptive is not None and
                  (self.watchdog is None or self.watchdog.sd_enabled) else None)
        rollouts, stats = rollout_round(group, self.engine, requests, round_id=step,
                                        strategy=policy, trainer=self.spot)
        rollout_s = time.perf_counter() - start
        texts = [self.detokenize(r.tokens.tolist()) for r in rollouts]
        scored = score_all(self.reward_fn, [chosen[r.request_index].text for r in rollouts],
                           texts, [chosen[r.request_index].reference for r in rollouts])
        rewards = torch.tensor([s.reward for s in scored]).view(len(chosen),
                                                                 config.samples_per_prompt)
        advantages = group_advantages(rewards).view(-1)
        train_start = time.perf_counter()
        losses = self._update(rollouts, advantages)
        train_s = time.perf_counter() - train_start
        refreshed = (refresh(group, self.drafter, stats.spot_steps)
                     if self.drafter is not None else False)
        drafter_event = None
        if self.watchdog is not None:
            verdict = self.watchdog.observe(group.mean(stats.acceptance_length))
            drafter_event = verdict.event
            if verdict.restore is not None:  # the refresh made drafting worse: undo it
                self.drafter.load_state_dict(verdict.restore)
            if refreshed:
                self.watchdog.publish()
        lengths = [len(r.tokens) for r in rollouts]
        step_s = time.perf_counter() - start
        metrics = {
            "step": step, "reward": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "step_s": step_s, "rollout_s": rollout_s, "train_s": train_s,
            "rollout_share": rollout_s / step_s,
            "tail_s": seconds_at_or_below(stats.trace_time_s, stats.trace_running,
                                          TAIL_FRACTION * max(stats.trace_running, default=0)),
            "acceptance_length": stats.acceptance_length,
            **{f"acceptance_length/{label}": value
               for label, value in stats.acceptance_by_position.items()},
            "sd_on_share": stats.sd_on_share,
            "drafter_version": self.watchdog.version if self.watchdog else None,
            "drafter_event": drafter_event, "spot_steps": stats.spot_steps,
            "response_length_mean": sum(lengths) / len(lengths),
            "response_lengths": lengths,
            "reward_errors": sum(s.error is not None for s in scored),
            "first_reward_error": next((s.error for s in scored if s.error), None),
            "trace_time_s": list(stats.trace_time_s), "trace_running": list(stats.trace_running),
            **losses}
        self.state.history.append(metrics)
        self.state.step += 1
        return metrics

    def _update(self, rollouts, advantages: torch.Tensor) -> dict:
        config, group = self.config, self.group
        device = next(self.policy.parameters()).device
        # Mini-batches of similar lengths (little padding: the long tail's sequences would
        # otherwise pad every mini-batch they land in), taken in a seeded random order.
        by_length = sorted(range(len(rollouts)), key=lambda j: (len(rollouts[j].tokens), j))
        batches = [by_length[first:first + config.minibatch_size]
                   for first in range(0, len(by_length), config.minibatch_size)]
        random.Random(f"{config.seed}/{self.state.step}/minibatches").shuffle(batches)
        model = self._ddp if self._ddp is not None else self.policy
        recompute = config.old_logprobs == "recompute" or (
            config.old_logprobs == "auto" and self.optimizer.mixed)
        mine_of = {number: [j for k, j in enumerate(batch) if k % group.world_size == group.rank]
                   for number, batch in enumerate(batches)}
        micros_of = {number: _micro_batches(rollouts, mine, config.micro_batch_tokens)
                     for number, mine in mine_of.items()}
        recomputed = self._recompute_logprobs(rollouts, micros_of, device) if recompute else {}
        self.policy.train()
        parts, gaps, norms = [], [], []
        for epoch in range(config.ppo_epochs):
            for number, batch in enumerate(batches):
                total_tokens = sum(len(rollouts[j].tokens) for j in batch)
                micros = micros_of[number]
                self.optimizer.zero_grad()
                for index, micro in enumerate(micros):
                    seqs, lengths, mask, old = _pack([rollouts[j] for j in micro], device)
                    if recompute:  # the gap below is then the engine's vs the trainer's
                        rollout_old, old = old, recomputed[tuple(micro)]
                    # DDP reduces the gradients once per mini-batch, at the rank's last micro-
                    # batch: ranks may run different numbers of them
                    last = index == len(micros) - 1
                    with contextlib.nullcontext() if last or self._ddp is None else \
                            self._ddp.no_sync():
                        logp = response_logprobs(model, seqs, lengths, mask, config.temperature)
                        if epoch == 0 and number == 0:  # before any update: the rollout's policy
                            engine_logp = rollout_old if recompute else old
                            gaps.append(float(((logp.detach() - engine_logp) * mask).abs().max()))
                        ref = None
                        if self.reference is not None:
                            with torch.no_grad():
                                ref = response_logprobs(self.reference, seqs, lengths, mask,
                                                        config.temperature)
                        local_tokens = float(mask.sum())
                        part = ppo_clip_loss(logp, old, advantages[micro].to(device), mask,
                                             config.clip_eps, ref, config.kl_coef)
                        # mean over the micro-batch's tokens -> its share of the global mini-
                        # batch's mean; DDP averages over ranks, hence the world size
                        scale = local_tokens / max(total_tokens, 1) * group.world_size
                        (part.loss * scale).backward()
                    parts.append((part, local_tokens))
                norms.append(self.optimizer.clip_and_step(config.max_grad_norm))
        self.policy.eval()
        weight = sum(t for _, t in parts) or 1.0
        return {"loss": sum(p.policy_loss * t for p, t in parts) / weight,
                "kl": sum(p.kl * t for p, t in parts) / weight,
                "clip_fraction": sum(p.clip_fraction * t for p, t in parts) / weight,
                "grad_norm": max(norms),
                "logprob_gap": max(gaps) if gaps else 0.0}

    def _recompute_logprobs(self, rollouts, micros_of: dict[int, list[list[int]]], device
                            ) -> dict[tuple[int, ...], torch.Tensor]:
        """The policy's own log-probs of every micro-batch (keyed by its rollout indices),
        before any update, in the training pass: PPO's old log-probs when they are recomputed."""
        out = {}
        self.policy.eval()
        with torch.no_grad():
            for micros in micros_of.values():
                for micro in micros:
                    seqs, lengths, mask, _ = _pack([rollouts[j] for j in micro], device)
                    out[tuple(micro)] = response_logprobs(self.policy, seqs, lengths, mask,
                                                          self.config.temperature)
        return out

    # ---- inputs --------------------------------------------------------------------------

    def _prompts_for(self, step: int) -> list[Prompt]:
        """The step's prompts: consecutive slices of a per-epoch seeded shuffle."""
        per, total = self.config.prompts_per_step, len(self.prompts)
        chosen = []
        for k in range(step * per, (step + 1) * per):
            epoch, index = divmod(k, total)
            order = list(range(total))
            random.Random(f"{self.config.seed}/epoch/{epoch}").shuffle(order)
            chosen.append(self.prompts[order[index]])
        return chosen

    def _request(self, prompt: Prompt, max_tokens: int, step: int, index: int,
                 n: int | None = None) -> Request:
        seed = sample_seed(self.config.seed, step, index)  # new draws every step
        return Request(prompt.ids, SamplingParams(
            temperature=self.config.temperature, max_tokens=max_tokens, stop_ids=self.stop_ids,
            seed=seed, n=self.config.samples_per_prompt if n is None else n))

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What evolves, and what a reader of the checkpoint needs to rebuild the policy:
        `model_config` (its config.json dict; None for a policy that is not a tlt_core
        Transformer) and `stop_ids` (the ids that end a response)."""
        state = {"step": self.state.step, "config": asdict(self.config),
                 "history": list(self.state.history),
                 "model_config": _model_config(self.policy), "stop_ids": list(self.stop_ids),
                 "policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        if self.drafter is not None:
            state["drafter"] = self.drafter.state_dict()
            if self.spot is not None:
                state["spot"] = self.spot.state_dict()
            state["watchdog_version"] = self.watchdog.version
        if self.adaptive is not None:
            state["adaptive"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = {k: v for k, v in state["config"].items() if k != "steps"}
        mine = {k: v for k, v in asdict(self.config).items() if k != "steps"}
        if saved != mine:
            changed = sorted(k for k in mine if saved.get(k) != mine[k])
            raise ValueError(f"checkpoint: saved under another config ({', '.join(changed)} "
                             "differ); resume with the same settings (only steps may change)")
        saved_model, my_model = state.get("model_config") or {}, _model_config(self.policy) or {}
        if saved_model != my_model:
            changed = sorted(k for k in saved_model.keys() | my_model.keys()
                             if saved_model.get(k) != my_model.get(k))
            raise ValueError(f"checkpoint: saved for a policy of another architecture "
                             f"({', '.join(changed)} differ); resume with the same model")
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])
        if self.drafter is not None and "drafter" in state:
            self.drafter.load_state_dict(state["drafter"])
            if self.spot is not None and "spot" in state:
                self.spot.load_state_dict(state["spot"])
            self.watchdog.version = int(state["watchdog_version"])
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.state = TrainState(int(state["step"]), list(state["history"]))

    def save(self, directory: str | Path, *, keep: int = 2) -> Path | None:
        """Writes this step's checkpoint as directory/step-NNNNNN (NNNNNN = steps done) and
        keeps the newest `keep` (tlt_core.rl.checkpoint_io.write_checkpoint); rank 0 writes and
        returns the folder, the other ranks return None."""
        if self.group.rank != 0:
            return None
        return write_checkpoint(directory, self.state.step, self.state_dict(), keep=keep)

    def resume(self, folder: str | Path) -> None:
        """Continues from a checkpoint folder `save` wrote (checkpoint_io.latest_checkpoint
        finds the newest one of a directory)."""
        try:
            state = read_state(folder)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"resume: {error}") from None
        self.load_state_dict(state)


def _model_config(policy: torch.nn.Module) -> dict | None:
    return policy.config.to_hf_config() if isinstance(policy, Transformer) else None


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


def _pack(rollouts, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequences (B, L), prompt lengths (B,), response mask (B, T), rollout log-probs (B, T))."""
    B = len(rollouts)
    width = max(len(r.prompt_ids) + len(r.tokens) for r in rollouts)
    T = max(len(r.tokens) for r in rollouts)
    sequences = torch.zeros(B, width, dtype=torch.int64)
    mask, old = torch.zeros(B, T), torch.zeros(B, T)
    for b, r in enumerate(rollouts):
        sequence = list(r.prompt_ids) + r.tokens.tolist()
        sequences[b, :len(sequence)] = torch.tensor(sequence)
        mask[b, :len(r.tokens)] = 1
        old[b, :len(r.tokens)] = r.logprobs
    lengths = torch.tensor([len(r.prompt_ids) for r in rollouts])
    return sequences.to(device), lengths.to(device), mask.to(device), old.to(device)
