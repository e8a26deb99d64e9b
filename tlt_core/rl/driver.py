"""The RL driver: rollout with the adaptive loop and the spot-trained drafter, a GRPO or PPO
update, weights to the engine, drafter refresh, held-out evaluation; one step at a time,
checkpointed.

One step:
1. `prompts_per_step` prompts (a seeded shuffle of the data, epoch by epoch, read from a
   cursor), `samples_per_prompt` samples each, rolled out by every rank over its shard of the
   prompts (`rollout_round`: SD through the adaptive policy when TLT is on; ranks that finish
   early spot-train the drafter); every rank then holds every rollout. Dynamic sampling (DAPO)
   drops the groups whose rewards are all equal and refills: each refill round rolls out as
   many new prompts as the share kept so far says will fill the gap (at most
   `prompts_per_step`), up to `max_refill_rounds` rounds; groups beyond `prompts_per_step` are
   not used, and a step that never fills trains on what it kept.
2. Rewards from the reward function (an error in it is recorded against its sample: reward 0),
   plus DAPO's soft overlong penalty, minus the KL when it is placed in the reward. Advantages:
   GRPO's group-relative ones (scaled by `scale_rewards`), or PPO's GAE over the critic's
   values (whitened over the batch's tokens).
3. Clipped-surrogate updates (clip-higher's asymmetric range) over mini-batches of
   `minibatch_size` sequences, each token weighted by `loss_agg_mode`; with PPO the critic takes
   its clipped value-loss step on the same mini-batch with its own optimizer. Rank r computes
   the loss of the mini-batch's sequences j with j mod world == r with weights from the whole
   mini-batch, and DistributedDataParallel sums the gradients (it averages, so the loss is
   scaled by the world size): the update is the same for any number of ranks. A rank's share
   runs as length-sorted micro-batches of at most `micro_batch_tokens` padded tokens whose
   gradients accumulate; a rank with fewer of them than another (or none) runs zero-gradient
   passes first, so every rank makes the same DDP calls. Sequences whose gradient is exactly
   zero (a GRPO advantage of 0, as in a group that scored alike, and no KL term) count in the
   loss's normalisation but pass through no model (`_inert`). `mask_truncated_completions`
   leaves the responses cut at `max_new_tokens` out of both losses. The first mini-batch's
   log-probs, before any update, are compared with the rollout's: `train/logprob_gap` (~0 in
   float32; SD is lossless).
4. The engine reads the policy's weights directly (its packed copy is rebuilt when they change),
   the drafter replicas are refreshed (step-weighted average) and the watchdog judges them
   (a rollback it asks for is loaded here).
5. Every `eval_every` steps, the held-out prompts are sampled `eval_samples` times each with the
   same engine (SD on when TLT is) and scored: mean reward and pass@k of the updated policy.
6. The step's metrics (tlt_core.outputs.metrics names them); `state_dict` checkpoints everything
   that evolves: policy, optimizer, critic and its optimizer, reference, drafter, spot trainer,
   adaptive policy, RNG, step, the data cursor. `save` writes it as a step folder
   (tlt_core.persistence.checkpoint_io: safetensors and JSON, no pickle, atomic, the newest K kept),
   `resume` reads one back.

The adaptive loop's plans: the built-in ones at the run's temperature (builtin_plans: the
sampled chains alone at T > 0 under `sampled_drafts`), or with `plans_from` the best plan per
batch size of a `tlt bench speculative --json` file at the run's temperature
(tlt_core.adaptive.measured_plans); suffix-match plans beside either under `suffix_drafts`.

The learning rate follows tlt_core.optim.schedule (warm-up, then constant or cosine), per step.

Forced lengths (`forced_lengths`, for benchmarks such as `tlt bench train --workload trace`): a
function (step, prompt, sample) -> tokens, where prompt counts the prompts rolled out in the
step (refills continue the count) and sample the group's samples. Each training sample then
decodes to exactly that many tokens, as vLLM's benchmarks fix an output length, its stop ids
masked (tlt_core.engine.records.exact_length) so that it stays a response. Its rollout
log-probs are then those of the masked distribution, not the policy's, so PPO's old log-probs
are recomputed (old_logprobs "auto"; "rollout" is refused). The step rolls out one request per
sample, siblings kept together on one rank, and numbers the records back to (prompt, sample),
so groups, rewards and advantages are computed as without it. Every such sample ends for its
length (finish reason "length", so rollout/truncated_fraction counts it), which is why
mask_truncated_completions is refused with forced lengths. Held-out evaluation keeps the
model's own lengths.

Determinism: sampling seeds come from (seed, step, prompt), so with SD off (or a fixed plan) a
resumed run repeats an uninterrupted one exactly; with the adaptive loop the plan choices depend
on measured step times, so the samples differ run to run (their distribution does not).
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from tlt_core.adaptive.calibration_cache import CalibrationCache
from tlt_core.adaptive.measured_plans import MeasuredPlans, measured_plans
from tlt_core.adaptive.policy import AdaptivePolicy, builtin_plans
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import (Request, SamplingParams, exact_length,
                                     seconds_at_or_below, step_trace_rows)
from tlt_core.engine.sampling import sample_seed
from tlt_core.model.transformer import Transformer
from tlt_core.optim.master_weights import MasterWeightAdamW
from tlt_core.optim.schedule import lr_multiplier
from tlt_core.persistence.checkpoint_io import read_state, write_checkpoint
from tlt_core.rl.advantages import gae, group_advantages, overlong_penalty, varied_groups, whiten
from tlt_core.rl.config import TrainConfig
from tlt_core.rl.critic import ValueModel, response_values
from tlt_core.rl.evaluation import PASS_AT_K, evaluation_metrics
from tlt_core.rl.losses import (LossParts, kl_estimate, ppo_clip_loss, response_logprobs,
                                value_loss)
from tlt_core.rl.update import (BeforeUpdate, MicroBatch, UpdatePlan, UpdateTotals, ValueParts,
                                micro_batch_weights, pack_micro_batch, plan_update)
from tlt_core.tasks.inputs import Prompt
from tlt_core.tasks.rewards import RewardFn, Scored, score_all
from tlt_core.workers.group import WorkerGroup
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.workers.refresh import refresh
from tlt_core.workers.round import WorkerRound, rollout_round
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer
from tlt_core.workers.watchdog import DrafterWatchdog

TAIL_FRACTION = 0.25  # the tail: the running batch at or below this share of the step's peak
EVAL_SEED_STEP = -1  # evaluation samples use the seeds of this step index: the same every pass
# (step, prompt index within the step, sample index) -> the tokens that sample decodes
ForcedLengths = Callable[[int, int, int], int]


@dataclass
class TrainState:
    step: int = 0
    history: list[dict] = field(default_factory=list)  # every step's metrics
    prompts_used: int = 0  # the data cursor: prompts rolled out so far, refills included
    rounds: int = 0  # rollout rounds so far (each needs an id of its own across the ranks)


@dataclass
class _Collected:
    """A step's rollouts after dynamic sampling: `rollouts` are the kept groups', group by
    group (`samples_per_prompt` each), with their prompts and scores."""
    prompts: list[Prompt]
    rollouts: list
    scores: list[float]
    rounds: list[WorkerRound]
    all_scores: list[float]  # every rolled-out sample's, dropped groups included
    all_lengths: list[int]
    truncated: int  # rolled-out samples cut at max_new_tokens
    groups_dropped: int
    first_reward_error: str | None
    reward_errors: int


class RLDriver:
    """GRPO or PPO with TLT, one step at a time. detokenize maps a response's token ids to the
    text the reward function reads; stop_ids end a response; evaluation: the held-out prompts
    of eval_every; forced_lengths: each training sample's exact length (module docstring),
    None for responses that end at a stop id or max_new_tokens."""

    def __init__(self, policy: torch.nn.Module, prompts: Sequence[Prompt], reward_fn: RewardFn,
                 detokenize: Callable[[list[int]], str], stop_ids: Sequence[int],
                 config: TrainConfig = TrainConfig(), *,
                 drafter: Drafter | Eagle3Drafter | None = None,
                 calibration: Sequence[Prompt] = (), group: WorkerGroup | None = None,
                 evaluation: Sequence[Prompt] = (), forced_lengths: ForcedLengths | None = None):
        if not prompts:
            raise ValueError("prompts: need at least one prompt")
        if forced_lengths is not None and config.mask_truncated_completions:
            raise ValueError("forced_lengths: every forced sample ends for its length, so "
                             "mask_truncated_completions would leave them all out of the loss")
        if forced_lengths is not None and config.old_logprobs == "rollout":
            raise ValueError("forced_lengths: a forced sample's stop ids are masked, so its "
                             "rollout log-probs are not the policy's; use old_logprobs "
                             "recompute or auto")
        if config.eval_every and not evaluation:
            raise ValueError("evaluation: eval_every needs held-out prompts (--eval-data)")
        self.config, self.policy, self.prompts = config, policy, list(prompts)
        self.evaluation = list(evaluation)
        self.reward_fn, self.detokenize, self.stop_ids = reward_fn, detokenize, tuple(stop_ids)
        self.forced_lengths = forced_lengths
        self.group = group or WorkerGroup()
        if config.minibatch_size < self.group.world_size:
            raise ValueError(f"minibatch_size: {config.minibatch_size} is below the number of "
                             f"ranks ({self.group.world_size}); every rank needs a sequence")
        torch.manual_seed(config.seed)
        # bf16/fp16 policies train with float32 master weights (tlt_core.optim.master_weights)
        self.optimizer = MasterWeightAdamW(policy.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        self.critic = self.critic_optimizer = None
        if config.algorithm == "ppo":
            self.critic = ValueModel(policy, config.critic_layers)
            self.critic_optimizer = MasterWeightAdamW(
                self.critic.parameters(), lr=config.critic_peak_lr, betas=(0.9, 0.95),
                weight_decay=0.0)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self._ddp = self._critic_ddp = None
        if self.group.distributed:
            device = next(policy.parameters()).device
            ids = [device.index] if device.type == "cuda" else None
            # No buffer broadcast: the models' buffers (RoPE frequencies) are the same on every
            # rank, and a broadcast in every synced forward would be a collective that ranks
            # running different numbers of micro-batches reach different numbers of times.
            self._ddp = DistributedDataParallel(policy, device_ids=ids, forward_sync_buffers=False)
            if self.critic is not None:
                self._critic_ddp = DistributedDataParallel(self.critic, device_ids=ids,
                                                           forward_sync_buffers=False)
        max_len = max(len(p.ids) for p in self.prompts + self.evaluation) + config.max_new_tokens
        engine_config = EngineConfig(max_batch=config.max_batch, max_len=max_len, seed=config.seed)
        self.drafter = drafter if config.tlt else None
        # Spot training needs a rank that went idle while others still decode: with one rank
        # there is none, so harvesting would only cost the rollout time. It trains a Drafter on
        # the warm-up's loss (tlt_core.drafting.training); an EAGLE-3 drafter (imported) drafts
        # as loaded.
        spot = isinstance(self.drafter, Drafter) and self.group.world_size > 1
        self.harvest = HarvestBuffer(max_bytes=64 << 20) if spot else None
        self.engine = RolloutEngine(policy, engine_config, self.drafter, self.harvest)
        # the spot trainer's settings (it runs only beside other ranks: one finishes first)
        self.spot_config = SpotConfig(seed=config.seed, unroll=config.drafter_unroll)
        self.spot = SpotTrainer(self.drafter, self.harvest, self.spot_config) if spot else None
        self.watchdog = DrafterWatchdog(self.drafter) if self.drafter is not None else None
        self.adaptive = None
        if config.tlt:
            plans, measured = _adaptive_plans(config)
            calibration_requests = [self._request(p, min(16, config.max_new_tokens), 0, i, n=1)
                                    for i, p in enumerate(calibration or self.prompts[:4])]
            self.adaptive = AdaptivePolicy.from_calibration(
                self.engine, plans, calibration_requests,
                fallback_model=measured.cost_model(plans) if measured else None,
                cache=(CalibrationCache(config.calibration_cache)
                       if config.calibration_cache is not None else None))
        # calibration runs for the first step: its seconds (a cached one's: reading it) are
        # that step's
        self._calibration_s = self.adaptive.cost_model.calibration_s if self.adaptive else 0.0
        self._calibration_cached = bool(self.adaptive and self.adaptive.cost_model.cached_from)
        self.state = TrainState()

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> dict:
        config, group = self.config, self.group
        step = self.state.step
        start = time.perf_counter() - self._calibration_s
        calibration_s, self._calibration_s = self._calibration_s, 0.0
        calibration_cached, self._calibration_cached = self._calibration_cached, False
        lr_scale = lr_multiplier(step, steps=config.steps, warmup_steps=config.warmup_steps,
                                 scheduler=config.lr_scheduler_type,
                                 min_lr_ratio=config.min_lr_ratio)
        self.optimizer.set_lr(config.lr * lr_scale)
        if self.critic_optimizer is not None:
            self.critic_optimizer.set_lr(config.critic_peak_lr * lr_scale)
        self.policy.eval()
        batch = self._collect(step)
        rollout_s = time.perf_counter() - start
        train_start = time.perf_counter()
        losses = self._update(batch.rollouts, torch.tensor(batch.scores, dtype=torch.float32))
        train_s = time.perf_counter() - train_start
        spot_steps = sum(r.spot_steps for r in batch.rounds)
        acceptance = _token_weighted(batch.rounds, lambda r: r.acceptance_length)
        refreshed = (refresh(group, self.drafter, spot_steps)
                     if self.drafter is not None else False)
        drafter_event = None
        if self.watchdog is not None:
            verdict = self.watchdog.observe(group.mean(acceptance))
            drafter_event = verdict.event
            if verdict.restore is not None:  # the refresh made drafting worse: undo it
                self.drafter.load_state_dict(verdict.restore)
            if refreshed:
                self.watchdog.publish()
        step_s = time.perf_counter() - start
        trace_time, trace_running, trace_speculative = _joined_traces(batch.rounds)
        scores = torch.tensor(batch.all_scores)
        metrics = {
            "step": step, "train/reward": float(scores.mean()),
            "train/reward_std": float(scores.std(unbiased=False)),
            "train/step_s": step_s, "rollout/time_s": rollout_s, "train/update_s": train_s,
            "rollout/calibration_s": calibration_s,
            "rollout/calibration_cached": float(calibration_cached),
            "rollout/time_share": rollout_s / step_s,
            "rollout/tail_s": sum(seconds_at_or_below(r.trace_time_s, r.trace_running,
                                              TAIL_FRACTION * max(r.trace_running, default=0))
                          for r in batch.rounds),
            "spec/acceptance_length": acceptance,
            **{f"spec/acceptance_length/{label}": _token_weighted(
                batch.rounds, lambda r, label=label: r.acceptance_by_position.get(label))
               for label in batch.rounds[0].acceptance_by_position},
            "spec/sd_step_share": _token_weighted(batch.rounds, lambda r: r.sd_on_share) or 0.0,
            "drafter/version": self.watchdog.version if self.watchdog else None,
            "drafter_event": drafter_event, "drafter/spot_steps": spot_steps,
            "rollout/response_length_mean": sum(batch.all_lengths) / len(batch.all_lengths),
            "response_lengths": batch.all_lengths,
            "rollout/truncated_fraction": batch.truncated / len(batch.all_lengths),
            "rollout/groups_dropped": batch.groups_dropped,
            "rollout/refill_rounds": len(batch.rounds) - 1,
            "train/reward_errors": batch.reward_errors,
            "first_reward_error": batch.first_reward_error,
            "trace_time_s": trace_time, "trace_running": trace_running,
            "trace_speculative": trace_speculative,
            "step_trace": [{"round": number, **row} for number, r in enumerate(batch.rounds)
                           for row in step_trace_rows(r.step_trace)],
            "spec/batch_max": max((b for b, sd in zip(trace_running, trace_speculative) if sd),
                                default=None),
            "train/lr": config.lr * lr_scale, **losses}
        evaluate = config.eval_every and (step + 1) % config.eval_every == 0
        metrics.update(self.evaluate() if evaluate else
                       dict.fromkeys(["eval/time_s", "eval/reward",
                                      *(f"eval/pass@{k}" for k in PASS_AT_K)]))
        self.state.history.append(metrics)
        self.state.step += 1
        return metrics

    def _rollout_policy(self):
        """What drafts this round: the adaptive policy, unless TLT is off or the watchdog
        turned SD off."""
        if self.adaptive is not None and (self.watchdog is None or self.watchdog.sd_enabled):
            return self.adaptive
        return None

    def _round_id(self) -> int:
        self.state.rounds += 1
        return self.state.rounds

    def _collect(self, step: int) -> _Collected:
        """Rolls out and scores the step's groups; with dynamic sampling, drops the groups
        whose scores are all equal and refills (module docstring)."""
        config, per = self.config, self.config.prompts_per_step
        kept = _Collected([], [], [], [], [], [], 0, 0, None, 0)
        offered, kept_groups = 0, 0
        while True:
            count = per
            if kept.rounds:  # a refill: the kept share so far says how many fill the gap
                rate = max(kept_groups / offered, 1 / per)
                count = min(per, math.ceil((per - len(kept.prompts)) / rate))
            prompts = self._take_prompts(count)
            if self.forced_lengths is None:
                rollouts, stats = self._rollout(
                    [self._request(p, config.max_new_tokens, step, offered + i)
                     for i, p in enumerate(prompts)])
            else:
                rollouts, stats = self._forced_rollout(prompts, step, offered)
            kept.rounds.append(stats)
            offered += len(prompts)
            scored = _score(self.reward_fn, [prompts[r.request_index] for r in rollouts],
                            [self.detokenize(r.tokens.tolist()) for r in rollouts])
            kept.all_scores += [s.reward for s in scored]
            kept.all_lengths += [len(r.tokens) for r in rollouts]
            kept.truncated += sum(r.finish_reason == "length" for r in rollouts)
            kept.reward_errors += sum(s.error is not None for s in scored)
            kept.first_reward_error = kept.first_reward_error or next(
                (s.error for s in scored if s.error), None)
            groups = {}
            for rollout, score in zip(rollouts, scored):
                groups.setdefault(rollout.request_index, []).append((rollout, score.reward))
            rewards = torch.tensor([[s for _, s in groups[i]] for i in range(len(prompts))])
            varied = (varied_groups(rewards).tolist() if config.dynamic_sampling
                      else [True] * len(prompts))
            kept.groups_dropped += varied.count(False)
            kept_groups += varied.count(True)
            for index, keep in enumerate(varied):
                if keep and len(kept.prompts) < per:
                    kept.prompts.append(prompts[index])
                    kept.rollouts += [r for r, _ in groups[index]]
                    kept.scores += [s for _, s in groups[index]]
            if (not config.dynamic_sampling or len(kept.prompts) == per
                    or len(kept.rounds) > config.max_refill_rounds):
                return kept

    def _rollout(self, requests: list[Request], group_size: int = 1
                 ) -> tuple[list, WorkerRound]:
        """One training rollout round over every rank (groups of `group_size` requests kept on
        one rank)."""
        return rollout_round(self.group, self.engine, requests, round_id=self._round_id(),
                             strategy=self._rollout_policy(), trainer=self.spot,
                             group_size=group_size)

    def _forced_rollout(self, prompts: list[Prompt], step: int, offered: int
                        ) -> tuple[list, WorkerRound]:
        """The round's samples at their forced lengths: one request per sample, its stop ids
        masked up to max_tokens, its length; the records numbered back to (prompt, sample)."""
        n, cap = self.config.samples_per_prompt, self.config.max_new_tokens
        requests = []
        for i, prompt in enumerate(prompts):
            index = offered + i
            for sample in range(n):
                length = self.forced_lengths(step, index, sample)
                if (isinstance(length, bool) or not isinstance(length, numbers.Integral)
                        or not 1 <= length <= cap):
                    raise ValueError(f"forced_lengths: step {step}, prompt {index}, sample "
                                     f"{sample} got {length!r}; a length must be a whole number "
                                     f"of tokens in [1, max_new_tokens = {cap}]")
                # the seed the default path's request gives this sample, hashed once more by
                # the engine: distinct per sample, independent of how ranks split the requests
                seed = sample_seed(sample_seed(self.config.seed, step, index), 0, sample)
                requests.append(Request(prompt.ids, exact_length(SamplingParams(
                    temperature=self.config.temperature, stop_ids=self.stop_ids, seed=seed),
                    int(length))))
        rollouts, stats = self._rollout(requests, group_size=n)
        return [replace(r, request_index=r.request_index // n, sample_index=r.request_index % n)
                for r in rollouts], stats

    def _update(self, rollouts, scores: torch.Tensor) -> dict:
        """The policy's (and the critic's) update on the kept rollouts (group by group) with
        their scores; the step's loss metrics."""
        config, group = self.config, self.group
        if not rollouts:  # dynamic sampling kept no group: nothing to learn from
            return _no_update(self.critic is not None)
        device = next(self.policy.parameters()).device
        inert = self._inert(rollouts, scores)
        plan = plan_update(rollouts, minibatch_size=config.minibatch_size,
                           micro_batch_tokens=config.micro_batch_tokens,
                           mask_truncated=config.mask_truncated_completions, seed=config.seed,
                           step=self.state.step, rank=group.rank, world=group.world_size,
                           inert=inert)
        before = self._before_update(rollouts, plan, device)
        advantages, returns, value_stats = self._advantages(rollouts, scores, before, plan.mine)
        self._train(True)
        totals = UpdateTotals()
        for epoch in range(config.ppo_epochs):
            for number in range(len(plan.minibatches)):
                self._minibatch_step(rollouts, plan, number, before, advantages, returns,
                                     totals, device, measure_gap=epoch == 0 and number == 0)
        self._train(False)
        return {**self._loss_metrics(totals.reduced(group), value_stats),
                "train/inert_fraction": len(inert) / len(rollouts)}

    def _train(self, mode: bool) -> None:
        self.policy.train(mode)
        if self.critic is not None:
            self.critic.train(mode)

    def _minibatch_step(self, rollouts, plan: UpdatePlan, number: int, before: BeforeUpdate,
                        advantages: dict[int, torch.Tensor], returns: dict[int, torch.Tensor],
                        totals: UpdateTotals, device, *, measure_gap: bool) -> None:
        """One optimizer step (policy, and critic with PPO) on mini-batch `number`: this rank's
        micro-batches accumulate their gradients, DDP reduces them at the last pass."""
        config, batch = self.config, plan.minibatches[number]
        in_loss = [j for j in batch if plan.counted[j]]
        if not in_loss:  # every sequence masked: no optimizer step
            return
        batch_tokens = sum(len(rollouts[j].tokens) for j in in_loss)
        self.optimizer.zero_grad()
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad()
        # A rank with fewer micro-batches than another first runs zero-gradient passes on a
        # sequence of the batch, so every rank makes the same DDP calls.
        micros, passes = plan.micro_batches[number], plan.passes[number]
        padding = passes - len(micros)
        for index in range(padding):
            with _sync_unless(self._ddp, index == passes - 1), \
                    _sync_unless(self._critic_ddp, index == passes - 1):
                self._zero_gradient_pass(rollouts, batch[0], device)
        totals.start_minibatch()
        # an inert sequence's tokens count in the clip fraction's denominator, as if passed
        totals.tokens += sum(len(rollouts[j].tokens) for j in plan.inert[number]
                             if plan.counted[j])
        for index, rows in enumerate(micros, start=padding):
            micro = pack_micro_batch(rollouts, rows, device)
            weights = micro_batch_weights(micro, plan, mode=config.loss_agg_mode,
                                          batch_tokens=batch_tokens,
                                          batch_sequences=len(in_loss),
                                          max_new_tokens=config.max_new_tokens)
            last = index == passes - 1
            totals.add_policy(self._policy_pass(micro, weights, before, advantages, last,
                                                totals.logprob_gaps if measure_gap else None))
            if self.critic is not None:
                totals.add_value(self._critic_pass(micro, weights, before, returns, last))
        totals.grad_norms.append(self.optimizer.clip_and_step(config.max_grad_norm))
        if self.critic_optimizer is not None:
            self.critic_optimizer.clip_and_step(config.max_grad_norm)

    def _policy_pass(self, micro: MicroBatch, weights: torch.Tensor, before: BeforeUpdate,
                     advantages: dict[int, torch.Tensor], last: bool,
                     gaps: list[float] | None) -> LossParts:
        """The clipped-surrogate loss of one micro-batch, backpropagated (DDP reduces at the
        mini-batch's `last` pass). `gaps`, when given, gets the largest |trainer - engine|
        log-prob of a token: before any update, the rollout's own policy."""
        config = self.config
        model = self._ddp if self._ddp is not None else self.policy
        kl_in_loss = self.reference is not None and config.kl_placement == "loss"
        with _sync_unless(self._ddp, last):
            logp = response_logprobs(model, micro.sequences, micro.prompt_lengths, micro.mask,
                                     config.temperature)  # (B, T)
            if before.old is not None and any(j not in before.old for j in micro.rows):
                # the first mini-batch's old log-probs: this pass's, the policy not yet updated
                detached = logp.detach().cpu()
                lengths = micro.mask.sum(dim=1).long().tolist()  # one host read, not one a row
                for b, j in enumerate(micro.rows):
                    before.old[j] = detached[b, :lengths[b]]
            old = (micro.padded(before.old) if before.old is not None
                   else micro.rollout_logprobs)
            if gaps is not None:
                gaps.append(float(((logp.detach() - micro.rollout_logprobs) * micro.mask)
                                  .abs().max()))
            part = ppo_clip_loss(
                logp, old, micro.padded(advantages), weights,
                epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
                ref_logp=micro.padded(before.ref) if kl_in_loss else None,
                kl_coef=config.kl_coef if kl_in_loss else 0.0, kl_estimator=config.kl_estimator)
            # DDP averages over ranks; the weights already share the mini-batch out
            (part.loss * self.group.world_size).backward()
        return part

    def _critic_pass(self, micro: MicroBatch, weights: torch.Tensor, before: BeforeUpdate,
                     returns: dict[int, torch.Tensor], last: bool) -> ValueParts:
        """PPO's clipped value loss of one micro-batch, backpropagated into the critic."""
        critic = self._critic_ddp if self._critic_ddp is not None else self.critic
        with _sync_unless(self._critic_ddp, last):
            values = response_values(critic, micro.sequences, micro.prompt_lengths, micro.mask)
            loss, clipped = value_loss(values, micro.padded(before.values),
                                       micro.padded(returns), weights,
                                       self.config.cliprange_value)
            (loss * self.group.world_size).backward()
        return ValueParts(loss, clipped)

    def _loss_metrics(self, totals: UpdateTotals, value_stats: dict) -> dict:
        """The update's loss metrics from the totals over all ranks."""
        config, tokens = self.config, totals.tokens
        kl_in_loss = self.reference is not None and config.kl_placement == "loss"
        trained = len(totals.policy_losses)
        out = {"train/loss": sum(totals.policy_losses) / trained if trained else 0.0,
               "train/kl": totals.kl_sum / tokens if tokens and kl_in_loss else 0.0,
               "train/clip_fraction": totals.clipped_tokens / tokens if tokens else 0.0,
               "train/grad_norm": max(totals.grad_norms, default=0.0),
               "train/logprob_gap": max(totals.logprob_gaps, default=0.0),
               "train/value_loss": None, "train/value_clip_fraction": None,
               "train/explained_variance": None}
        if self.critic is not None:
            out["train/value_loss"] = sum(totals.value_losses) / trained if trained else 0.0
            out["train/value_clip_fraction"] = (totals.value_clipped_tokens / tokens
                                                if tokens else 0.0)
            out["train/explained_variance"] = value_stats.get("explained_variance")
        if self.reference is not None and config.kl_placement == "reward":
            out["train/kl"] = value_stats.get("kl_in_reward", 0.0)
        return out

    def _zero_gradient_pass(self, rollouts, row: int, device) -> None:
        """A forward and backward through the policy (and the critic) that adds nothing to the
        gradients: a rank's stand-in for a micro-batch it does not have."""
        micro = pack_micro_batch(rollouts, [row], device)
        inputs = (micro.sequences, micro.prompt_lengths, micro.mask)
        model = self._ddp if self._ddp is not None else self.policy
        (0.0 * response_logprobs(model, *inputs)).sum().backward()
        if self.critic is not None:
            critic = self._critic_ddp if self._critic_ddp is not None else self.critic
            (0.0 * response_values(critic, *inputs)).sum().backward()

    def _before_update(self, rollouts, plan: UpdatePlan, device) -> BeforeUpdate:
        """This rank's rollouts' per-token numbers before any update: the policy's own
        log-probs (when PPO's old log-probs are recomputed), the reference's (with a KL) and
        the critic's values (with PPO).

        The first mini-batch's old log-probs are left out when the policy is a tlt_core
        Transformer and nothing reads them before the update (a KL in the reward does): its
        first training pass computes them (`_policy_pass`), the policy not yet updated and a
        training pass the same function as an evaluation one (no dropout), so a forward pass
        over those sequences is saved: all of them with one mini-batch of one epoch, TRL's case
        for taking the old log-probs from the training pass."""
        config = self.config
        recompute = config.old_logprobs == "recompute" or (
            config.old_logprobs == "auto"
            and (self.optimizer.mixed or self.forced_lengths is not None))
        old = {} if recompute else None
        ref = {} if self.reference is not None else None
        values = {} if self.critic is not None else None
        kl_in_reward = self.reference is not None and config.kl_placement == "reward"
        deferred = ({j for micro in plan.micro_batches[0] for j in micro}
                    if recompute and isinstance(self.policy, Transformer) and not kl_in_reward
                    else set())
        self.policy.eval()
        with torch.no_grad():
            for rows in (rows for micros in plan.micro_batches for rows in micros):
                micro = pack_micro_batch(rollouts, rows, device)
                inputs = (micro.sequences, micro.prompt_lengths, micro.mask)
                now = old if not deferred.issuperset(rows) else None
                for out, compute in (
                        (now, lambda: response_logprobs(self.policy, *inputs, config.temperature)),
                        (ref, lambda: response_logprobs(self.reference, *inputs,
                                                        config.temperature)),
                        (values, lambda: response_values(self.critic, *inputs))):
                    if out is not None:
                        result = compute().cpu()  # (B, T)
                        for b, j in enumerate(rows):
                            out[j] = result[b, :len(rollouts[j].tokens)]
        return BeforeUpdate(old, ref, values)

    def _rewards(self, rollouts, scores: torch.Tensor) -> torch.Tensor:
        """The scores with the overlong penalty, one per rollout."""
        config = self.config
        rewards = scores.clone()
        if config.overlong_buffer_len:
            rewards += torch.tensor([overlong_penalty(len(r.tokens), config.max_new_tokens,
                                                      config.overlong_buffer_len,
                                                      config.overlong_penalty_factor)
                                     for r in rollouts])
        return rewards

    def _inert(self, rollouts, scores: torch.Tensor) -> frozenset[int]:
        """The rollouts whose every token's gradient is exactly zero, which the update passes
        over (tlt_core.rl.update.UpdatePlan): GRPO's samples with a group advantage of 0 when
        no KL term reaches the loss or the rewards (the clipped surrogate of A = 0 is 0 at any
        ratio). Early in RL on a hard task most groups score alike (all wrong), and this is
        most of the update's passes."""
        if self.critic is not None or self.reference is not None:
            return frozenset()
        advantages = group_advantages(
            self._rewards(rollouts, scores).view(-1, self.config.samples_per_prompt),
            self.config.scale_rewards).view(-1)
        return frozenset(torch.nonzero(advantages == 0).view(-1).tolist())

    def _advantages(self, rollouts, scores: torch.Tensor, before: BeforeUpdate, mine: list[int]
                    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict]:
        """Per-token advantages and (PPO) returns of this rank's rollouts `mine`, keyed by
        rollout index, and the statistics they give (explained variance; the in-reward KL)."""
        config, group = self.config, self.group
        rewards = self._rewards(rollouts, scores)
        token_kl = {}
        stats = {}
        if self.reference is not None and config.kl_placement == "reward":
            for j in mine:
                own = before.old[j] if before.old is not None else rollouts[j].logprobs
                token_kl[j] = kl_estimate(own, before.ref[j], config.kl_estimator)
            kl_sums = torch.zeros(len(rollouts) + 1, dtype=torch.float64)
            for j in mine:
                kl_sums[j] = float(token_kl[j].sum())
                kl_sums[-1] += len(token_kl[j])
            kl_sums = group.all_reduce_sum(kl_sums)
            stats["kl_in_reward"] = float(kl_sums[:-1].sum() / kl_sums[-1].clamp(min=1))
        advantages, returns = {}, {}
        if self.critic is None:  # GRPO: every token of a sample gets its group advantage
            if token_kl:
                rewards = rewards - config.kl_coef * kl_sums[:-1].float()
            group_adv = group_advantages(rewards.view(-1, config.samples_per_prompt),
                                         config.scale_rewards).view(-1)
            for j in mine:
                advantages[j] = group_adv[j].expand(len(rollouts[j].tokens))
            return advantages, returns, stats
        # PPO: token rewards (the score at the last token, the KL at every token), GAE
        moments = torch.zeros(6, dtype=torch.float64)  # n, sum A, sum A^2, sum R, R^2, (R-V)^2
        for j in mine:
            T = len(rollouts[j].tokens)
            token_rewards = torch.zeros(T)
            token_rewards[-1] = rewards[j]
            if token_kl:
                token_rewards -= config.kl_coef * token_kl[j].float()
            values = before.values[j]
            advantages[j], returns[j] = gae(token_rewards, values, config.gamma, config.lam)
            a, r = advantages[j].double(), returns[j].double()
            moments += torch.stack([torch.tensor(float(T), dtype=torch.float64), a.sum(),
                                    (a * a).sum(), r.sum(), (r * r).sum(),
                                    ((r - values.double()) ** 2).sum()])
        n, a_sum, a_squares, r_sum, r_squares, residual = group.all_reduce_sum(moments).tolist()
        if config.whiten_advantages:
            for j in mine:
                advantages[j] = whiten(advantages[j], n, a_sum, a_squares)
        return_variance = r_squares / n - (r_sum / n) ** 2
        stats["explained_variance"] = (1 - residual / n / return_variance
                                       if return_variance > 1e-12 else None)
        return advantages, returns, stats

    # ---- evaluation --------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """The held-out prompts, `eval_samples` samples each, rolled out by the engine as the
        training rollouts are (SD on when TLT is) and scored: eval/reward, eval/pass@k (k up to
        eval_samples) and eval/time_s. The samples' seeds are the same at every evaluation, so two
        evaluations differ by the policy only."""
        config, start = self.config, time.perf_counter()
        self.policy.eval()
        requests = [self._request(p, config.max_new_tokens, EVAL_SEED_STEP, i,
                                  n=config.eval_samples) for i, p in enumerate(self.evaluation)]
        rollouts, _ = rollout_round(self.group, self.engine, requests, round_id=self._round_id(),
                                    strategy=self._rollout_policy())
        scored = _score(self.reward_fn, [self.evaluation[r.request_index] for r in rollouts],
                        [self.detokenize(r.tokens.tolist()) for r in rollouts])
        groups = [[] for _ in self.evaluation]
        for rollout, score in zip(rollouts, scored):
            groups[rollout.request_index].append(score.reward)
        return {**evaluation_metrics(groups, config.pass_threshold),
                "eval/time_s": time.perf_counter() - start}

    # ---- inputs --------------------------------------------------------------------------

    def _take_prompts(self, count: int) -> list[Prompt]:
        """The next `count` prompts of the data stream: consecutive slices of a per-epoch
        seeded shuffle, from the cursor on."""
        total, chosen = len(self.prompts), []
        for k in range(self.state.prompts_used, self.state.prompts_used + count):
            epoch, index = divmod(k, total)
            order = list(range(total))
            random.Random(f"{self.config.seed}/epoch/{epoch}").shuffle(order)
            chosen.append(self.prompts[order[index]])
        self.state.prompts_used += count
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
        state = {"step": self.state.step, "config": self.config.as_record(),
                 "history": list(self.state.history),
                 "model_config": _model_config(self.policy), "stop_ids": list(self.stop_ids),
                 "policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "prompts_used": self.state.prompts_used, "rounds": self.state.rounds,
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
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
        # an option the checkpoint's config lacks is newer than it: it ran at the default
        defaults, mine = TrainConfig().as_record(), self.config.as_record()
        changed = sorted(k for k in mine if k != "steps"
                         and state["config"].get(k, defaults[k]) != mine[k])
        if changed:
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
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
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
        self.state = TrainState(int(state["step"]), list(state["history"]),
                                int(state["prompts_used"]), int(state["rounds"]))

    def save(self, directory: str | Path, *, keep: int = 2) -> Path | None:
        """Writes this step's checkpoint as directory/step-NNNNNN (NNNNNN = steps done) and
        keeps the newest `keep` (tlt_core.persistence.checkpoint_io.write_checkpoint); rank 0
        writes and returns the folder, the other ranks return None."""
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


def _score(reward_fn: RewardFn, prompts: list[Prompt], responses: list[str]) -> list[Scored]:
    """score_all over samples of these prompts, with what TRL- and veRL-style reward functions
    read besides the text (the chat messages, the data row)."""
    return score_all(reward_fn, [p.text for p in prompts], responses,
                     [p.reference for p in prompts], messages=[p.messages for p in prompts],
                     rows=[p.row for p in prompts])


def _adaptive_plans(config: TrainConfig) -> tuple[tuple[DraftPlan, ...], MeasuredPlans | None]:
    """The adaptive loop's plans, and what plans_from's file measured (None without one): the
    file's best plans at the run's temperature, else the built-in ones at that temperature
    (builtin_plans: the sampled chains alone at T > 0 under sampled_drafts); suffix-match
    plans beside either under suffix_drafts (a benchmark's requests have no siblings to copy
    drafts from, so the file cannot rank them)."""
    measured = None
    if config.plans_from is not None:
        try:
            measured = measured_plans(config.plans_from, config.temperature)
        except (FileNotFoundError, ValueError) as error:  # it names the file and the row
            raise ValueError(f"plans_from: {error}") from None
        plans = measured.plans
    else:
        plans = builtin_plans(config.temperature, config.sampled_drafts)
    if config.suffix_drafts:
        keys = {plan.key for plan in plans}
        plans += tuple(plan for plan in (SuffixMatch(8), SuffixMatch(16)) if plan.key not in keys)
    return plans, measured


def _model_config(policy: torch.nn.Module) -> dict | None:
    return policy.config.to_hf_config() if isinstance(policy, Transformer) else None


def _no_update(critic: bool) -> dict:
    """The loss metrics of a step that kept no rollout to train on."""
    out = {"train/loss": 0.0, "train/kl": 0.0, "train/clip_fraction": 0.0,
           "train/inert_fraction": 0.0,
           "train/grad_norm": 0.0, "train/logprob_gap": 0.0, "train/value_loss": None,
           "train/value_clip_fraction": None, "train/explained_variance": None}
    if critic:
        out.update({"train/value_loss": 0.0, "train/value_clip_fraction": 0.0})
    return out


def _sync_unless(ddp: DistributedDataParallel | None, last: bool):
    """DDP's gradient reduction only at a mini-batch's last micro-batch."""
    return contextlib.nullcontext() if last or ddp is None else ddp.no_sync()


def _token_weighted(rounds: list[WorkerRound], value: Callable[[WorkerRound], float | None]
                    ) -> float | None:
    """A per-round rate over a step's rounds, weighted by the tokens each generated (None
    where no round has one)."""
    pairs = [(value(r), r.tokens) for r in rounds if value(r) is not None]
    weight = sum(t for _, t in pairs)
    if not pairs:
        return None
    return sum(v * t for v, t in pairs) / weight if weight else pairs[0][0]


def _joined_traces(rounds: list[WorkerRound]) -> tuple[list[float], list[int], list[bool]]:
    """The rounds' engine traces end to end: each round's times offset by the makespans
    before it, the running rows and whether each step was speculative."""
    times, running, speculative, offset = [], [], [], 0.0
    for r in rounds:
        times += [offset + t for t in r.trace_time_s]
        running += list(r.trace_running)
        speculative += list(r.trace_speculative)
        offset += r.makespan_s
    return times, running, speculative
