"""Phase 1 of the warm-up: the target's own responses to the training prompts, with the hidden
states a drafter trains on.

The target answers with the RL sampling settings (the caller's prompt format, temperature,
max_tokens, stop ids) in the rollout engine, and a HarvestBuffer keeps the hidden states of the
very passes that generated them: no second target pass (tlt_core.workers.harvest). Each chunk
of `rollout_batch` rows is a shard `work/responses/shard-NNNNN/`, a checkpoint_io folder
(tokens and features concatenated, with lengths and prompt lengths); a resumed run reads the
shards it has, and a shard that does not read back as what `write_shard` writes is logged (a
warning), deleted and generated again.

Shapes: T positions of a sequence, F feature layers, H hidden size.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.training import DraftRecord
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.transformer import Transformer
from tlt_core.persistence.checkpoint_io import read_state, write_state
from tlt_core.warmup.config import OfflineConfig
from tlt_core.warmup.work_folder import discard
from tlt_core.workers.harvest import HarvestBuffer

logger = logging.getLogger(__name__)


@torch.no_grad()
def target_responses(target: Transformer, prompts: list[tuple[int, ...]], directory: Path,
                     config: OfflineConfig, stop_ids: tuple[int, ...], progress: bool
                     ) -> tuple[list[DraftRecord], list[int]]:
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
        read = _read_shard_or_discard(shard, config, hidden_size) if shard.exists() else None
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
            write_shard(shard, list(harvest.records), batch, config)
            read = read_shard(shard, config, hidden_size=hidden_size)
        shard_records, shard_lengths = read
        records += shard_records
        prompt_lengths += shard_lengths
        bar.update(min(chunk, len(prompts) - first))
        bar.set_postfix(sequences=len(records))
    bar.close()
    if engine is None:
        logger.info("responses: read %d sequences from %s", len(records), directory)
    return records, prompt_lengths


def write_shard(folder: Path, records: list[DraftRecord], prompts: list[tuple[int, ...]],
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


def read_shard(folder: Path, config: OfflineConfig, *, hidden_size: int | None = None
               ) -> tuple[list[DraftRecord], list[int]]:
    """The shard's records and their prompt lengths; a ValueError (or FileNotFoundError) naming
    the folder when it is not what write_shard writes for `config` (and a target of
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


def _read_shard_or_discard(folder: Path, config: OfflineConfig, hidden_size: int
                           ) -> tuple[list[DraftRecord], list[int]] | None:
    """read_shard's result, or None after deleting a damaged shard (a logged warning)."""
    try:
        return read_shard(folder, config, hidden_size=hidden_size)
    except (FileNotFoundError, ValueError) as error:
        logger.warning("responses: %s; generating %s again", error, folder.name)
        discard(folder)
        return None
