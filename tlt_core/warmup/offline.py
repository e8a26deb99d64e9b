"""Offline drafter training for any checkpoint (`tlt drafter train`): the EAGLE warm-up on the
target's own responses, before RL starts.

Three phases, each resumable from the output folder's `work/`:
1. Responses: the target answers the training prompts with the RL sampling settings (the
   caller's prompt format, temperature, max_tokens, stop ids) in the rollout engine, and a
   HarvestBuffer keeps the hidden states of the very passes that generated them: no second
   target pass (tlt_core.workers.harvest). Written as shards `work/responses/shard-NNNNN/`
   (tlt_core.persistence.checkpoint_io); a resumed run skips the shards it has.
2. Draft vocabulary (`draft_vocab` V'): the V' token ids the responses use most, stop ids
   always included (FR-Spec / EAGLE-3's d2t: a drafting level's LM head then costs V'/V).
3. Training: AdamW on the EAGLE loss (tlt_core.drafting.training) over the response positions
   of every sequence, in batches of at most `batch_tokens` padded positions, the learning rate
   warmed up then on a cosine to a tenth. The drafter trains in float32 against a float32 twin
   of the target (the same weights, widened exactly), whatever dtype the target decodes in, so
   AdamW's small updates are not rounded away. Checkpointed every `checkpoint_every` steps
   (`work/train/step-N/`: weights, optimizer, data order), so an interrupted run resumes where
   it stopped with the same batches.
Then the drafter is saved (Drafter.save) in the target's dtype and its acceptance length is
measured on held-out prompts the training never saw, with the engine exactly as a rollout runs
it, and stored in the folder's metadata with the provenance.

The work folder is a cache several processes may reach for at once, and which a crash, a full
disk or a hand may damage; it stays usable:
- one process at a time: a call holds `work/`'s lock (tlt_core.persistence.folder_lock) throughout, so
  a second call with the same --out waits for the first (saying so), then reuses what it wrote
  instead of generating and training a second time;
- every entry is written atomically (`work/run.json` by checkpoint_io.atomic_file, shards and
  step checkpoints as checkpoint_io folders): a reader sees the old entry or the new one;
- an entry that does not read back as what this module writes (torn or foreign JSON, missing
  keys or tensors, inconsistent shapes) is reported through `log` with its path and built
  again: a damaged run.json discards the work folder's shards and checkpoints (nothing vouches
  for their settings any more), a damaged shard is generated again, a damaged step checkpoint is
  deleted and training resumes from the one before, or from the start.

Shapes: T positions of a sequence, F feature layers, H hidden size.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from tlt_core._version import __version__
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import target_sha256
from tlt_core.drafting.training import (DraftBatch, DraftRecord, make_batch, make_optimizer,
                                        train_step)
from tlt_core.drafting.tree import Strategy
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.transformer import Transformer, rope_inv_freq
from tlt_core.optim.schedule import learning_rate
from tlt_core.persistence.checkpoint_io import (atomic_file, read_state, step_folders,
                                                write_checkpoint, write_state)
from tlt_core.persistence.folder_lock import folder_lock
from tlt_core.workers.harvest import HarvestBuffer

WORK_DIR, RESPONSES_DIR, TRAIN_DIR = "work", "responses", "train"
WORK_RECORD = "run.json"  # the settings and prompts a work folder belongs to
EVAL_STRATEGIES = (Strategy(6, 1, 7), Strategy(5, 4, 16))  # a chain and a tree, as rollouts use


@dataclass(frozen=True)
class OfflineConfig:
    # the RL sampling settings the responses are drawn with
    temperature: float = 1.0
    max_tokens: int = 512
    samples_per_prompt: int = 1
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
    checkpoint_every: int = 100
    seed: int = 0
    # held-out acceptance: greedy, as many rows at once
    eval_max_tokens: int = 256

    def __post_init__(self):
        for name in ("max_tokens", "samples_per_prompt", "rollout_batch", "steps",
                     "batch_tokens", "checkpoint_every", "eval_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if not isinstance(self.held_out, int) or self.held_out < 1:
            raise ValueError(f"held_out: must be an int >= 1 (the acceptance is measured on "
                             f"them), got {self.held_out!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        DrafterConfig(self.feature_layers, self.form, self.draft_vocab)  # validates those


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
    held_out_acceptance: dict = field(default_factory=dict)  # strategy -> acceptance length
    held_out_by_position: dict = field(default_factory=dict)  # strategy -> bucket -> length
    seconds: dict = field(default_factory=dict)  # phase -> wall seconds (this run's)


def float32_twin(target: Transformer) -> Transformer:
    """The same model in float32 on the same device: its weights widened exactly (every bf16
    or fp16 value is a float32 one), for training a drafter against what the target computes.
    The target itself when it is float32 already."""
    if target.lm_head.weight.dtype == torch.float32:
        return target
    device = target.lm_head.weight.device
    with torch.device("meta"):
        twin = Transformer(target.config)
    state = {name: tensor.detach().float() for name, tensor in target.state_dict().items()}
    twin.load_state_dict(state, strict=True, assign=True)
    twin.tie_weights()
    twin.model.rotary_emb.inv_freq = rope_inv_freq(target.config, device)
    return twin.eval()


def train_offline(target: Transformer, prompts: Sequence[Sequence[int]], out: str | Path,
                  config: OfflineConfig = OfflineConfig(), *, stop_ids: Sequence[int] = (),
                  metadata: dict | None = None, progress: bool = True,
                  log: Callable[[str], None] = print) -> OfflineReport:
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
        log(f"out: {work} is in use by another process (pid {pid}); waiting for it to finish, "
            "then reusing what it wrote")

    with folder_lock(work, wait=True, on_wait=waiting):
        return _train_offline_holding(target, prompts, folder, config, tuple(stop_ids),
                                      metadata, progress, log)


def _train_offline_holding(target: Transformer, prompts: list[tuple[int, ...]], folder: Path,
                           config: OfflineConfig, stop_ids: tuple[int, ...],
                           metadata: dict | None, progress: bool,
                           log: Callable[[str], None]) -> OfflineReport:
    """train_offline's phases, while holding the work folder's lock."""
    work = folder / WORK_DIR
    train_prompts, held_out = prompts[:-config.held_out], prompts[-config.held_out:]
    weights_sha256 = target_sha256(target)
    _claim_work_folder(work, config, prompts, weights_sha256, log)
    seconds = {}

    start = time.perf_counter()
    records, prompt_lengths = _responses(target, train_prompts, work / RESPONSES_DIR, config,
                                         stop_ids, progress, log)
    seconds["responses"] = time.perf_counter() - start
    response_tokens = sum(int(r.tokens.shape[0]) - p for r, p in zip(records, prompt_lengths))

    ids = _draft_vocabulary(records, prompt_lengths, config.draft_vocab, stop_ids,
                            target.config.vocab_size)
    if ids is not None:
        covered = _coverage(records, prompt_lengths, ids)
        log(f"draft vocabulary: {ids.numel()} ids cover {covered:.1%} of the response tokens")

    start = time.perf_counter()
    trainer_target = float32_twin(target)
    drafter_config = DrafterConfig(config.feature_layers, config.form,
                                   None if ids is None else int(ids.numel()))
    with torch.random.fork_rng(devices=[]):  # the initial weights: a function of the seed
        torch.manual_seed(config.seed)
        drafter = Drafter(trainer_target, drafter_config, ids)
    history = _train(drafter, records, prompt_lengths, work / TRAIN_DIR, config, progress, log)
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
                  "final_top1": _mean(h["top1"] for h in tail)}
    drafter.save(folder, metadata=provenance)  # written now; the measurement is added below
    served = Drafter.load(folder, target).eval()  # the target's dtype, as rollouts run it
    start = time.perf_counter()
    acceptance, by_position = held_out_acceptance(target, served, held_out, config, stop_ids)
    seconds["held_out"] = time.perf_counter() - start
    provenance.update(held_out_prompts=len(held_out), held_out_acceptance=acceptance,
                      held_out_by_position=by_position,
                      acceptance_length=acceptance[EVAL_STRATEGIES[0].key])
    served.save(folder, metadata=provenance)
    return OfflineReport(str(folder), len(train_prompts), len(held_out), len(records),
                         response_tokens, drafter_config.draft_vocab, len(history),
                         provenance["final_loss"], provenance["final_top1"], acceptance,
                         by_position, seconds)


@torch.no_grad()
def held_out_acceptance(target: Transformer, drafter: Drafter, prompts: Sequence[Sequence[int]],
                        config: OfflineConfig, stop_ids: Sequence[int] = ()
                        ) -> tuple[dict[str, float], dict[str, dict]]:
    """Greedy acceptance length (tokens a row emits per speculative step) of `drafter` on
    `prompts`, per EVAL_STRATEGIES plan, overall and by context position."""
    params = SamplingParams(temperature=0.0, max_tokens=config.eval_max_tokens,
                            stop_ids=tuple(stop_ids))
    requests = [Request(p, params) for p in prompts]
    engine = RolloutEngine(target, EngineConfig(
        max_batch=len(requests), max_len=max(len(p) for p in prompts) + config.eval_max_tokens,
        seed=config.seed), drafter)
    overall, by_position = {}, {}
    for strategy in EVAL_STRATEGIES:
        result = engine.generate(requests, strategy=strategy)
        overall[strategy.key] = result.acceptance_length
        by_position[strategy.key] = result.acceptance_by_position
    return overall, by_position


def _claim_work_folder(work: Path, config: OfflineConfig, prompts: list[tuple[int, ...]],
                       weights_sha256: str, log: Callable[[str], None]) -> None:
    """Records what this run's work folder holds (the settings, the prompts' hash and the
    target's), or checks that an earlier run's matches: resuming with other settings, or for
    another target, would mix two runs' data.
    `steps` and `checkpoint_every` may change (a resumed run may train longer). A record that is
    damaged or foreign, or missing beside shards and checkpoints, starts the folder afresh."""
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    mine = {**asdict(config), "prompts_sha256": digest, "target_sha256": weights_sha256}
    for free in ("steps", "checkpoint_every"):
        mine.pop(free)
    mine = json.loads(json.dumps(mine))  # tuples as lists, as read back
    path = work / WORK_RECORD
    problem = _record_problem(path, set(mine))
    if problem is None:
        theirs = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(key for key in mine if mine[key] != theirs[key])
        if changed:
            raise ValueError(f"out: {work.parent} holds a run with other settings "
                             f"({', '.join(changed)}); resume it with the same ones or choose "
                             "another --out")
        return
    stale = [work / name for name in (RESPONSES_DIR, TRAIN_DIR) if (work / name).exists()]
    if path.exists() or stale:
        log(f"out: {path} {problem}, so nothing vouches for the settings of "
            f"{', '.join(str(s) for s in stale) or 'the work folder'}; starting it afresh")
        for entry in stale:
            shutil.rmtree(entry)
    with atomic_file(path) as temporary:
        temporary.write_text(json.dumps(mine, indent=1) + "\n", encoding="utf-8")


def _record_problem(path: Path, keys: set[str]) -> str | None:
    """What keeps `path` from being a work record with exactly `keys`; None when it is one."""
    if not path.is_file():
        return "is missing"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"is not valid JSON ({error})"
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not a work record"
    if set(record) != keys:
        missing, foreign = sorted(keys - set(record)), sorted(set(record) - keys)
        return ("is not a work record of this version ("
                + "; ".join(part for part in (missing and f"missing {', '.join(missing)}",
                                              foreign and f"unknown {', '.join(foreign)}")
                            if part) + ")")
    return None


# ---- phase 1: responses -----------------------------------------------------------------------

@torch.no_grad()
def _responses(target: Transformer, prompts: list[tuple[int, ...]], directory: Path,
               config: OfflineConfig, stop_ids: tuple[int, ...], progress: bool,
               log: Callable[[str], None]) -> tuple[list[DraftRecord], list[int]]:
    """Every training prompt's responses as DraftRecords (prompt and response positions) and
    each record's prompt length, from the shards on disk or generated now."""
    harvest_drafter = Drafter(target, DrafterConfig(config.feature_layers, config.form))
    params = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens,
                            stop_ids=stop_ids, n=config.samples_per_prompt)
    chunk = max(1, config.rollout_batch // config.samples_per_prompt)
    shards = range(0, len(prompts), chunk)
    records, prompt_lengths = [], []
    bar = tqdm(total=len(prompts), disable=not progress, unit="prompt",
               desc="target responses")
    engine = None
    hidden_size = target.config.hidden_size
    for index, first in enumerate(shards):
        shard = directory / f"shard-{index:05d}"
        batch = prompts[first:first + chunk]
        read = _read_shard_or_discard(shard, config, hidden_size, log) if shard.exists() else None
        if read is None:
            harvest = HarvestBuffer(max_bytes=1 << 62, min_length=2)  # this shard's, whole
            if engine is None:
                engine = RolloutEngine(
                    target, EngineConfig(max_batch=config.rollout_batch,
                                         max_len=max(map(len, prompts)) + config.max_tokens,
                                         seed=config.seed), harvest_drafter, harvest)
            engine.harvest = harvest
            engine.generate([Request(p, params) for p in batch],
                            request_ids=list(range(first, first + len(batch))))
            harvest.collect()
            _write_shard(shard, list(harvest.records), batch, config)
            read = _read_shard(shard, config, hidden_size=hidden_size)
        shard_records, shard_lengths = read
        records += shard_records
        prompt_lengths += shard_lengths
        bar.update(min(chunk, len(prompts) - first))
        bar.set_postfix(sequences=len(records))
    bar.close()
    if engine is None:
        log(f"responses: read {len(records)} sequences from {directory}")
    return records, prompt_lengths


def _write_shard(folder: Path, records: list[DraftRecord], prompts: list[tuple[int, ...]],
                 config: OfflineConfig) -> None:
    """One shard: the records' tokens and features concatenated, with their lengths and prompt
    lengths. The last layer's output is stored only when it is not the one feature already."""
    lengths = [int(r.tokens.shape[0]) for r in records]
    starts = [_prompt_length(r, prompts) for r in records]
    state = {"lengths": torch.tensor(lengths, dtype=torch.int64),
             "prompt_lengths": torch.tensor(starts, dtype=torch.int64),
             "tokens": torch.cat([r.tokens for r in records]),
             "features": torch.cat([r.features for r in records])}
    if tuple(config.feature_layers) != (-1,):
        state["last_hidden"] = torch.cat([r.last_hidden for r in records])
    write_state(state, folder)


def _prompt_length(record: DraftRecord, prompts: list[tuple[int, ...]]) -> int:
    """The length of the prompt this record starts with (the longest that matches)."""
    tokens = record.tokens.tolist()
    matches = [len(p) for p in prompts if tuple(tokens[:len(p)]) == p]
    if not matches:
        raise AssertionError("a harvested sequence does not start with any of its shard's "
                             "prompts")
    return max(matches)


def _read_shard(folder: Path, config: OfflineConfig, *, hidden_size: int | None = None
                ) -> tuple[list[DraftRecord], list[int]]:
    """The shard's records and their prompt lengths; a ValueError (or FileNotFoundError) naming
    the folder when it is not what _write_shard writes for `config` (and a target of
    `hidden_size`, when given)."""
    state = read_state(folder)
    wanted = {"lengths", "prompt_lengths", "tokens", "features"}
    if tuple(config.feature_layers) != (-1,):
        wanted.add("last_hidden")
    missing = sorted(wanted - {k for k, v in state.items() if isinstance(v, torch.Tensor)})
    if missing:
        raise ValueError(f"out: {folder} lacks the tensors {', '.join(missing)}")
    for name in ("lengths", "prompt_lengths", "tokens"):
        if state[name].dtype != torch.int64:
            raise ValueError(f"out: {folder}: {name} is {state[name].dtype}, expected int64")
    lengths, starts = state["lengths"], state["prompt_lengths"]
    total = int(lengths.sum()) if lengths.dim() == 1 else -1
    F = len(config.feature_layers)
    H = hidden_size if hidden_size is not None else state["features"].shape[-1]
    shapes = {"lengths": (lengths.numel(),), "prompt_lengths": (lengths.numel(),),
              "tokens": (total,), "features": (total, F, H), "last_hidden": (total, H)}
    for name in sorted(wanted | state.keys() & shapes.keys()):
        if tuple(state[name].shape) != shapes[name]:
            raise ValueError(f"out: {folder}: {name} has shape {tuple(state[name].shape)}, "
                             f"expected {shapes[name]} (F = {F} feature layers, H = {H})")
    if lengths.numel() == 0 or bool((lengths < 1).any()) or bool((starts < 1).any()) \
            or bool((starts > lengths).any()):
        raise ValueError(f"out: {folder}: its lengths and prompt lengths are not those of "
                         "prompts with responses")
    split = lengths.tolist()
    tokens = state["tokens"].split(split)
    features = state["features"].split(split)
    last = (state["last_hidden"].split(split) if "last_hidden" in state
            else [f[:, 0] for f in features])
    records = [DraftRecord(t, f, h) for t, f, h in zip(tokens, features, last)]
    return records, starts.tolist()


def _read_shard_or_discard(folder: Path, config: OfflineConfig, hidden_size: int,
                           log: Callable[[str], None]
                           ) -> tuple[list[DraftRecord], list[int]] | None:
    """_read_shard's result, or None after deleting a damaged shard (reported through log)."""
    try:
        return _read_shard(folder, config, hidden_size=hidden_size)
    except (FileNotFoundError, ValueError) as error:
        log(f"responses: {error}; generating {folder.name} again")
        _discard(folder)
        return None


# ---- phase 2: the draft vocabulary -----------------------------------------------------------

def _draft_vocabulary(records: list[DraftRecord], prompt_lengths: list[int], size: int | None,
                      stop_ids: Sequence[int], vocab: int) -> torch.Tensor | None:
    """The `size` ids the responses use most (ties to the lower id), stop ids always in; fewer
    when the responses use fewer distinct ids. None: no reduced vocabulary."""
    if size is None:
        return None
    counts = torch.zeros(vocab, dtype=torch.int64)
    for record, start in zip(records, prompt_lengths):
        counts += torch.bincount(record.tokens[start:], minlength=vocab)
    used = int((counts > 0).sum())
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = set(order[:min(size, used)].tolist())
    for stop in stop_ids:
        if stop not in chosen:
            chosen.discard(int(order[len(chosen) - 1]))  # the least used goes
            chosen.add(int(stop))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def _coverage(records: list[DraftRecord], prompt_lengths: list[int], ids: torch.Tensor) -> float:
    inside = total = 0
    for record, start in zip(records, prompt_lengths):
        response = record.tokens[start:]
        inside += int(torch.isin(response, ids).sum())
        total += response.numel()
    return inside / max(total, 1)


# ---- phase 3: training -----------------------------------------------------------------------

def _train(drafter: Drafter, records: list[DraftRecord], prompt_lengths: list[int],
           directory: Path, config: OfflineConfig, progress: bool,
           log: Callable[[str], None]) -> list[dict]:
    """AdamW steps on the EAGLE loss over response positions; resumes from the newest step
    checkpoint in `directory` that reads back (a damaged one is reported and deleted). Returns
    every step's metrics (resumed steps' included)."""
    initial = {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}
    optimizer, step, history = make_optimizer(drafter, config.lr), 0, []
    for saved_step, folder in reversed(step_folders(directory).items()):
        try:
            state = read_state(folder)
            _check_train_state(state, folder, saved_step)
            try:
                drafter.load_state_dict(state["drafter"])
                optimizer.load_state_dict(state["optimizer"])
            except (KeyError, RuntimeError, TypeError) as error:
                raise ValueError(f"out: {folder}: its drafter or optimizer state does not fit "
                                 f"this drafter ({str(error).splitlines()[0]})") from None
        except (FileNotFoundError, ValueError) as error:
            log(f"training: {error}; deleting {folder} and resuming from the checkpoint "
                "before it, or from the start")
            _discard(folder)
            drafter.load_state_dict(initial)  # a failed load may have copied part of it
            optimizer = make_optimizer(drafter, config.lr)
            continue
        step, history = saved_step, list(state["history"])
        break
    device = drafter.fc.weight.device
    bar = tqdm(total=config.steps, initial=step, disable=not progress, unit="step",
               desc="training the drafter")
    batches = _epoch_batches(records, prompt_lengths, config, step)
    while step < config.steps:
        batch = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, lr=config.lr, steps=config.steps,
                                        warmup_steps=config.warmup, scheduler="cosine",
                                        min_lr_ratio=0.1)
        metrics = train_step(drafter, optimizer, _float_batch(batch, device))
        history.append(metrics)
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.3f}")
        if step % config.checkpoint_every == 0 or step == config.steps:
            write_checkpoint(directory, step, {"drafter": drafter.state_dict(),
                                               "optimizer": optimizer.state_dict(),
                                               "step": step, "history": history}, keep=1)
    bar.close()
    return history


def _check_train_state(state: dict, folder: Path, step: int) -> None:
    """A ValueError naming `folder` unless `state` is a step checkpoint of `step` steps."""
    missing = sorted({"drafter", "optimizer", "step", "history"} - state.keys())
    if missing:
        raise ValueError(f"out: {folder} lacks {', '.join(missing)}")
    if state["step"] != step or not isinstance(state["history"], list) \
            or len(state["history"]) != step:
        raise ValueError(f"out: {folder} does not hold the state after {step} steps with their "
                         "history")


def _discard(entry: Path) -> None:
    """Deletes a damaged cache entry (a folder, or a file where a folder belongs)."""
    if entry.is_dir():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)


def _epoch_batches(records: list[DraftRecord], prompt_lengths: list[int], config: OfflineConfig,
                   skip: int):
    """Batches forever, epoch after epoch, each epoch's order a function of the seed and the
    epoch alone; the first `skip` batches are passed over (a resumed run)."""
    # the pairs (f_t, x_{t+1}) scored: t >= prompt length - 1, the ones a rollout drafts from
    # (its first draft follows the prompt's last position)
    masked = [(r, max(p - 1, 0)) for r, p in zip(records, prompt_lengths)]
    produced, epoch = 0, 0
    while True:
        rng = random.Random(config.seed * 1_000_003 + epoch)
        order = sorted(range(len(masked)), key=lambda i: masked[i][0].tokens.shape[0])
        groups, current, width = [], [], 0
        for i in order:  # by length, so each batch pads little
            n = masked[i][0].tokens.shape[0]
            if current and max(width, n) * (len(current) + 1) > config.batch_tokens:
                groups.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, n)
        if current:
            groups.append(current)
        rng.shuffle(groups)
        for group in groups:
            produced += 1
            if produced > skip:
                yield _masked_batch([masked[i] for i in group])
        epoch += 1


def _masked_batch(items: list[tuple[DraftRecord, int]]) -> DraftBatch:
    batch = make_batch([record for record, _ in items])
    for b, (_, first) in enumerate(items):
        batch.mask[b, :first] = False
    return batch


def _float_batch(batch: DraftBatch, device: torch.device) -> DraftBatch:
    """The batch on the drafter's device, its hidden states widened to float32."""
    return DraftBatch(batch.tokens.to(device), batch.features.to(device, torch.float32),
                      batch.last_hidden.to(device, torch.float32), batch.mask.to(device))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
