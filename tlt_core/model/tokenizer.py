"""Text <-> token ids for real checkpoints: the checkpoint's own `tokenizer.json`, through the
`tokenizers` library (the Rust tokenizer every Hugging Face model ships; no transformers
import). The embedded task has its own small tokenizer (tlt_core.embedded.CharTokenizer); both
expose encode / decode / eos_ids, which is all the engine's callers need.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class CheckpointTokenizer:
    """The tokenizer of a local Hugging Face checkpoint folder."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json: not found in {folder}; real checkpoints "
                                    "need their fast-tokenizer file (tokenizer.json)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions
            raise ValueError(f"tokenizer.json: cannot be parsed ({error})") from error
        self.eos_ids = self._read_eos_ids(folder)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _read_eos_ids(self, folder: Path) -> tuple[int, ...]:
        """End-of-sequence ids from generation_config.json, else config.json, else the
        tokenizer's </s> / <|endoftext|> / <|im_end|> / <|eot_id|> tokens."""
        for name in ("generation_config.json", "config.json"):
            path = folder / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                if eos is not None:
                    return tuple(eos) if isinstance(eos, list) else (int(eos),)
        found = [self._tokenizer.token_to_id(t) for t in
                 ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>")]
        return tuple(i for i in found if i is not None)
