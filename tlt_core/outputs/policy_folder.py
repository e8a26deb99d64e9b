"""A trained policy as a folder users serve: a Hugging Face checkpoint that transformers'
AutoModelForCausalLM and AutoTokenizer load, with the logits of the policy as trained and the
tokenizer's ids and chat template.

`write_policy_folder(policy, folder, tokenizer=..., step=...)` writes, atomically
(tlt_core.persistence.checkpoint_io.atomic_folder: a reader never sees part of a folder; a failed
write leaves the previous one):
- `config.json` and `model.safetensors` (tlt_core.model.checkpoint.save_checkpoint), the
  weights in the policy's dtype; config.json carries bos_token_id / eos_token_id /
  pad_token_id;
- `generation_config.json`: the same token ids (eos a list when several end a response);
- the tokenizer's files when a tokenizer is given (CheckpointTokenizer.save: tokenizer.json,
  tokenizer_config.json with the chat template, chat_template.jinja, special_tokens_map.json);
- `tlt_policy.json`: provenance (format, RL step, tlt_core version).
The token ids are the tokenizer's (`SpecialTokenIds.of`), or `token_ids` where given (a policy
without a Hugging Face tokenizer, such as the embedded model, names at least its eos ids so
that generation stops); an id outside the vocabulary is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tlt_core._version import __version__
from tlt_core.model.checkpoint import save_checkpoint
from tlt_core.model.tokenizer import CheckpointTokenizer
from tlt_core.model.transformer import Transformer
from tlt_core.persistence.checkpoint_io import atomic_folder

POLICY_RECORD = "tlt_policy.json"
GENERATION_CONFIG = "generation_config.json"
POLICY_FORMAT = "tlt_core.policy/1"


@dataclass(frozen=True)
class SpecialTokenIds:
    bos: int | None = None
    eos: tuple[int, ...] = ()  # every id that ends a response
    pad: int | None = None

    @classmethod
    def of(cls, tokenizer: CheckpointTokenizer) -> SpecialTokenIds:
        return cls(tokenizer.bos_id, tuple(tokenizer.eos_ids), tokenizer.pad_id)

    def config_entries(self) -> dict[str, int | list[int]]:
        """The config.json / generation_config.json keys of the ids that are known."""
        entries: dict[str, int | list[int]] = {}
        if self.bos is not None:
            entries["bos_token_id"] = self.bos
        if self.eos:
            entries["eos_token_id"] = self.eos[0] if len(self.eos) == 1 else list(self.eos)
        if self.pad is not None:
            entries["pad_token_id"] = self.pad
        return entries


def write_policy_folder(policy: Transformer, folder: str | Path, *,
                        tokenizer: CheckpointTokenizer | None = None, step: int | None = None,
                        token_ids: SpecialTokenIds | None = None) -> Path:
    """Writes `policy` (and `tokenizer`) as the Hugging Face folder `folder` (module
    docstring), replacing one already there; returns the folder."""
    if not isinstance(policy, Transformer):
        raise TypeError(f"policy: expected a tlt_core Transformer, got {type(policy).__name__}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step: must be an int >= 0 or None, got {step!r}")
    if token_ids is None:
        token_ids = SpecialTokenIds.of(tokenizer) if tokenizer is not None else SpecialTokenIds()
    vocab = policy.config.vocab_size
    for name, ids in (("bos", (token_ids.bos,)), ("eos", token_ids.eos), ("pad", (token_ids.pad,))):
        bad = [i for i in ids if i is not None and not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token_ids: {name} id {bad[0]} is outside the policy's vocabulary "
                             f"[0, {vocab})")
    entries = token_ids.config_entries()
    with atomic_folder(folder) as temporary:
        save_checkpoint(policy, temporary, extra_config=entries)
        _write_json(temporary / GENERATION_CONFIG, entries)
        if tokenizer is not None:
            tokenizer.save(temporary)
        _write_json(temporary / POLICY_RECORD, {"format": POLICY_FORMAT, "step": step,
                                                "tlt_core_version": __version__})
    return Path(folder)


def _write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
