"""Offline drafter training for any checkpoint (`tlt drafter train`): the EAGLE warm-up on the
target's own responses, before RL starts.

Three phases, each resumable from the output folder's `work/` (tlt_core.warmup.work_folder):
1. Responses (tlt_core.warmup.responses): the target answers the training prompts with the RL
   sampling settings, and the hidden states of the passes that generated them are kept.
2. Draft vocabulary (tlt_core.warmup.draft_vocabulary): the V' token ids the responses use
   most.
3. Training (tlt_core.warmup.training_loop): AdamW on the drafter's loss (EAGLE's plus the
   sampled rejection term, tlt_core.drafting.training) unrolled over
   OfflineConfig.unroll drafting steps (the training-time test, tlt_core.drafting.unrolled) over
   the response positions, warmed up then on a cosine to a tenth, against a float32 twin of the
   target, checkpointed so an interrupted run resumes with the same batches.
Then the drafter is saved (Drafter.save) in the target's dtype and its acceptance length is
measured on held-out prompts the training never saw, at T = 0 and T = 1
(tlt_core.warmup.acceptance), and stored in the folder's metadata with the provenance
(`acceptance_length`: the greedy chain's).

One process at a time: a call holds `work/`'s lock (tlt_core.persistence.folder_lock)
throughout, so a second call with the same --out waits for the first (saying so), then reuses
what it wrote instead of generating and training a second time. Every entry of the work folder
is written atomically, and one that does not read back is logged (a warning) and built
again. Progress is logged to the `tlt_core.warmup` loggers (and shown by tqdm when `progress`).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from tlt_core._version import __version__
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import target_sha256
from tlt_core.model.transformer import Transformer
from tlt_core.persistence.folder_lock import folder_lock
from tlt_core.warmup.acceptance import HEADLINE, held_out_acceptance
from tlt_core.warmup.config import OfflineConfig
from tlt_core.warmup.draft_vocabulary import coverage, draft_vocabulary
from tlt_core.warmup.responses import target_responses
from tlt_core.warmup.training_loop import float32_twin, train_drafter
from tlt_core.warmup.work_folder import RESPONSES_DIR, TRAIN_DIR, WORK_DIR, claim_work_folder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineReport:
    folder: str
    train_prompts: int
    held_out_prompts: int
    sequences: int
    response_tokens: int
    draft_vocab: int | None
    steps: int
    final_loss: float  # mean over the last 20 steps
    final_top1: float  # teacher-forced top-1 agreement with the target, last 20 steps
    # per unrolled step k >= 2 ("top1_step2", ...): top-1 agreement drafting from its own
    # outputs, last 20 steps
    final_top1_by_step: dict = field(default_factory=dict)
    # the sampled acceptance at T = 1 (1 - the rejection term), teacher-forced and then per
    # unrolled step k >= 2 ("accept_step2", ...), last 20 steps
    final_accept: float = float("nan")
    final_accept_by_step: dict = field(default_factory=dict)
    # "t0" / "t1" (tlt_core.warmup.acceptance.EVAL_SETTINGS) -> plan -> acceptance length
    held_out_acceptance: dict = field(default_factory=dict)
    held_out_by_position: dict = field(default_factory=dict)  # the same, then context bucket
    seconds: dict = field(default_factory=dict)  # phase -> wall seconds (this run's)


def train_offline(target: Transformer, prompts: Sequence[Sequence[int]], out: str | Path,
                  config: OfflineConfig = OfflineConfig(), *, stop_ids: Sequence[int] = (),
                  metadata: dict | None = None, progress: bool = True) -> OfflineReport:
    """Trains a drafter for `target` on its own responses to `prompts` (token ids, already in
    the prompt format the RL run uses) and saves it to `out` (Drafter.save), resuming from
    `out/work/` what an earlier call with the same arguments finished. metadata: provenance to
    store with the drafter (e.g. the model and data paths); the held-out acceptance is added."""
    prompts = [tuple(int(t) for t in p) for p in prompts]
    if len(prompts) <= config.held_out:
        raise ValueError(f"prompts: {len(prompts)} prompts leave none to train on after the "
                         f"{config.held_out} held out; give more or lower held_out")
    folder = Path(out)
    work = folder / WORK_DIR

    def waiting(pid: int | None) -> None:
        logger.info("out: %s is in use by another process (pid %s); waiting for it to finish, "
                    "then reusing what it wrote", work, pid)

    with folder_lock(work, wait=True, on_wait=waiting):
        return _train_offline_holding(target, prompts, folder, config, tuple(stop_ids),
                                      metadata, progress)


def _train_offline_holding(target: Transformer, prompts: list[tuple[int, ...]], folder: Path,
                           config: OfflineConfig, stop_ids: tuple[int, ...],
                           metadata: dict | None, progress: bool) -> OfflineReport:
    """train_offline's phases, while holding the work folder's lock."""
    work = folder / WORK_DIR
    train_prompts, held_out = prompts[:-config.held_out], prompts[-config.held_out:]
    weights_sha256 = target_sha256(target)
    claim_work_folder(work, config, prompts, weights_sha256)
    seconds = {}

    start = time.perf_counter()
    records, prompt_lengths = target_responses(target, train_prompts, work / RESPONSES_DIR,
                                               config, config.decode_stop_ids(stop_ids),
                                               progress)
    seconds["responses"] = time.perf_counter() - start
    response_tokens = sum(int(r.tokens.shape[0]) - p for r, p in zip(records, prompt_lengths))

    ids = draft_vocabulary(records, prompt_lengths, config.draft_vocab, stop_ids,
                           target.config.vocab_size)
    if ids is not None:
        covered = coverage(records, prompt_lengths, ids)
        logger.info("draft vocabulary: %d ids cover %.1f%% of the response tokens",
                    ids.numel(), 100 * covered)

    start = time.perf_counter()
    trainer_target = float32_twin(target)
    drafter_config = DrafterConfig(config.feature_layers, config.form,
                                   None if ids is None else int(ids.numel()))
    with torch.random.fork_rng(devices=[]):  # the initial weights: a function of the seed
        torch.manual_seed(config.seed)
        drafter = Drafter(trainer_target, drafter_config, ids)
    history = train_drafter(drafter, records, prompt_lengths, work / TRAIN_DIR, config,
                            progress, target.lm_head.weight.dtype)
    seconds["training"] = time.perf_counter() - start
    del trainer_target

    tail = history[-20:]
    provenance = {**(metadata or {}), "tlt_core_version": __version__,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "target_sha256": weights_sha256, "offline": asdict(config),
                  "train_prompts": len(train_prompts), "sequences": len(records),
                  "response_tokens": response_tokens,
                  "final_loss": _mean(h["loss"] for h in tail),
                  "final_top1": _tail_mean(tail, "top1"),
                  "final_top1_by_step": {key: _tail_mean(tail, key) for key in
                                         (f"top1_step{k}" for k in range(2, config.unroll + 1))},
                  "final_accept": _tail_mean(tail, "accept"),
                  "final_accept_by_step": {
                      key: _tail_mean(tail, key)
                      for key in (f"accept_step{k}" for k in range(2, config.unroll + 1))}}
    drafter.save(folder, metadata=provenance)  # written now; the measurement is added below
    served = Drafter.load(folder, target).eval()  # the target's dtype, as rollouts run it
    start = time.perf_counter()
    acceptance, by_position = held_out_acceptance(target, served, held_out, config,
                                                  config.decode_stop_ids(stop_ids))
    seconds["held_out"] = time.perf_counter() - start
    provenance.update(held_out_prompts=len(held_out), held_out_acceptance=acceptance,
                      held_out_by_position=by_position,
                      acceptance_length=acceptance[HEADLINE[0]][HEADLINE[1]],
                      # this process's seconds per phase (a resumed phase: what was left of it)
                      phase_seconds={phase: round(s, 1) for phase, s in seconds.items()})
    served.save(folder, metadata=provenance)
    return OfflineReport(str(folder), len(train_prompts), len(held_out), len(records),
                         response_tokens, drafter_config.draft_vocab, len(history),
                         provenance["final_loss"], provenance["final_top1"],
                         provenance["final_top1_by_step"], provenance["final_accept"],
                         provenance["final_accept_by_step"], acceptance, by_position, seconds)


def _tail_mean(tail: list[dict], key: str) -> float:
    """The mean of a metric over the last steps' histories, leaving out a step where it is NaN
    (a batch too short for that unrolled step) or missing (a resumed checkpoint's history that
    did not record it)."""
    values = [h.get(key) for h in tail]
    return _mean(v for v in values if v is not None and v == v)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
