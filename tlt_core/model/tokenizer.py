"""Text <-> token ids for real checkpoints: `CheckpointTokenizer(folder)` is the one loader every
command uses, and its ids are the ids transformers gives for the same folder.

The backend is a `tokenizers.Tokenizer` either way: the folder's tokenizer.json through the
tokenizers library (no transformers import); else, for a folder with only a
tokenizer_config.json or SentencePiece model, the fast tokenizer transformers builds from it
(`AutoTokenizer.from_pretrained(folder).backend_tokenizer`, so transformers must be installed);
else an error. Loading does to the backend what transformers' loading does: the config's
"added_tokens_decoder" and the special tokens that are not yet added tokens are added (the
latter as special tokens), truncation and padding are switched off, and the config's
"split_special_tokens" is obeyed.

What it carries, all read from the folder's files:
- `special_tokens`: name -> token (tlt_core.model.chat_template.read_special_tokens);
  `bos_id`, `pad_id`: the ids of bos_token and pad_token, or None.
- `chat_template`: the folder's ChatTemplate, a user's template file instead, or None.
- `eos_ids`: generation_config.json's eos_token_id, else config.json's, else the tokenizer
  config's eos_token, else every one of </s>, <|endoftext|>, <|im_end|>, <|eot_id|>, <eos> in
  the vocabulary; then the chat template's end-of-turn tokens, where the template writes one
  the list lacks (a chat's turns may end with a token the checkpoint's config does not call
  eos: Qwen2.5 base lists <|endoftext|>, its template ends turns with <|im_end|>).

`encode(text)` = transformers' `tokenizer(text).input_ids`; `encode_chat(messages)` =
`tokenizer.apply_chat_template(messages, tokenize=True)`: the rendered text encoded with
add_special_tokens=False, as transformers does (the template writes bos itself where the model
wants one). `save(folder)` writes tokenizer.json, tokenizer_config.json, chat_template.jinja and
special_tokens_map.json, which transformers' AutoTokenizer loads with the same ids and
template. The embedded task has its own small tokenizer (tlt_core.embedded.CharTokenizer); both
expose encode / decode / eos_ids, which is all the engine's callers need.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from tlt_core.model.chat_template import (SPECIAL_TOKENS_MAP, TEMPLATE_FILE, TOKENIZER_CONFIG,
                                          ChatTemplate, read_tokenizer_config,
                                          special_token_entries, token_content)

TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
KNOWN_EOS_TOKENS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Config keys save() does not carry over: the template is rewritten, and a saved folder has
# neither the source's paths nor its custom tokenizer code.
_UNSAVED_CONFIG_KEYS = ("chat_template", "auto_map", "name_or_path", "tokenizer_file")


class CheckpointTokenizer:
    """The tokenizer of a local Hugging Face checkpoint folder (see the module docstring);
    `chat_template_file`, if given, replaces the folder's chat template."""

    def __init__(self, folder: str | Path, *, chat_template_file: str | Path | None = None):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"folder: {folder} is not a directory")
        self.folder = folder
        self._config = read_tokenizer_config(folder)
        self._tokenizer = _load_backend(folder, self._config)
        entries = special_token_entries(folder)
        _add_tokens_as_transformers_does(self._tokenizer, self._config, entries)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._tokenizer.encode_special_tokens = bool(self._config.get("split_special_tokens"))
        self.special_tokens: dict[str, str] = {k: token_content(v) for k, v in entries.items()}
        self.chat_template: ChatTemplate | None = (
            ChatTemplate.from_folder(folder) if chat_template_file is None
            else ChatTemplate.from_file(chat_template_file, self.special_tokens))
        self.bos_id = self._special_token_id("bos_token")
        self.pad_id = self._special_token_id("pad_token")
        self.eos_ids: tuple[int, ...] = self._read_eos_ids(folder)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, conversation: str | list[dict], *, add_generation_prompt: bool = True,
                    system_prompt: str | None = None,
                    template_vars: Mapping[str, object] | None = None) -> list[int]:
        """The prompt ids of a chat: `conversation` is its messages, or one user message's
        text; see ChatTemplate.render for the other arguments."""
        if self.chat_template is None:
            raise ValueError(f"conversation: {self.folder} has no chat template "
                             f"({TEMPLATE_FILE}, or chat_template in {TOKENIZER_CONFIG}); give "
                             "chat_template_file, or encode the plain text")
        if isinstance(conversation, str):
            conversation = [{"role": "user", "content": conversation}]
        text = self.chat_template.render(conversation, add_generation_prompt=add_generation_prompt,
                                         system_prompt=system_prompt, template_vars=template_vars)
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._tokenizer.decode([int(i) for i in ids],
                                      skip_special_tokens=skip_special_tokens)

    def save(self, folder: str | Path) -> None:
        """Write the tokenizer's files into `folder` (created if missing), replacing any there:
        the backend as tokenizer.json, the source config with this tokenizer's special tokens
        and template as tokenizer_config.json (class PreTrainedTokenizerFast, so transformers
        loads tokenizer.json as it is), chat_template.jinja and special_tokens_map.json."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(folder / TOKENIZER_FILE))
        config = {k: v for k, v in self._config.items() if k not in _UNSAVED_CONFIG_KEYS}
        config.update(self.special_tokens, tokenizer_class="PreTrainedTokenizerFast")
        template_path = folder / TEMPLATE_FILE
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template.source
            template_path.write_text(self.chat_template.source, encoding="utf-8")
        elif template_path.is_file():
            template_path.unlink()  # a stale template would be loaded as this tokenizer's
        _write_json(folder / TOKENIZER_CONFIG, config)
        _write_json(folder / SPECIAL_TOKENS_MAP, self.special_tokens)

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    def _read_eos_ids(self, folder: Path) -> tuple[int, ...]:
        """See the module docstring for the order."""
        found = self._configured_eos_ids(folder)
        if not found:
            eos = self._special_token_id("eos_token")
            found = [eos] if eos is not None else [
                i for i in map(self._tokenizer.token_to_id, KNOWN_EOS_TOKENS) if i is not None]
        if self.chat_template is not None:
            found += [i for i in map(self._tokenizer.token_to_id,
                                     self.chat_template.end_of_turn_tokens) if i is not None]
        return tuple(dict.fromkeys(found))

    def _configured_eos_ids(self, folder: Path) -> list[int]:
        for name in ("generation_config.json", "config.json"):
            path = folder / name
            if not path.is_file():
                continue
            try:
                eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError) as error:
                raise ValueError(f"{name}: cannot be read as a JSON object ({error})") from error
            if eos is None:
                continue
            ids = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"{name}: eos_token_id {eos!r} is not a token id (or list of "
                                 f"them) in [0, {self.vocab_size})")
            return list(ids)
        return []


def _load_backend(folder: Path, config: dict) -> Tokenizer:
    path = folder / TOKENIZER_FILE
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions
            raise ValueError(f"tokenizer.json: cannot be parsed ({error})") from error
    if not config and not (folder / SENTENCEPIECE_FILE).is_file():
        raise FileNotFoundError(f"tokenizer.json: not found in {folder}, nor a "
                                f"{TOKENIZER_CONFIG} or {SENTENCEPIECE_FILE}; real checkpoints "
                                "need their own tokenizer")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(f"folder: {folder} has no tokenizer.json; building its tokenizer from "
                          f"{TOKENIZER_CONFIG} needs transformers (pip install transformers)"
                          ) from None
    try:
        # trust_remote_code stays False: a checkpoint's tokenizer code is not run.
        loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(f"folder: transformers cannot build the tokenizer of {folder} "
                         f"({type(error).__name__}: {error})") from error
    backend = getattr(loaded, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"folder: transformers loads the tokenizer of {folder} as "
                         f"{type(loaded).__name__}, which has no fast (tokenizers) backend")
    return backend


def _add_tokens_as_transformers_does(tokenizer: Tokenizer, config: dict,
                                     entries: dict[str, str | dict]) -> None:
    """The config's "added_tokens_decoder" entries (by id), then each special token and extra
    special token that is not an added token yet, as a special token: transformers 5 adds them
    when it loads a folder, and they change how text around them is split."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{TOKENIZER_CONFIG}: added_tokens_decoder must be a dict of id -> "
                         "token")
    try:
        listed = [_added_token(decoder[key], special=None)
                  for key in sorted(decoder, key=int)]
    except ValueError as error:
        raise ValueError(f"{TOKENIZER_CONFIG}: added_tokens_decoder: {error}") from error
    if listed:
        tokenizer.add_tokens(listed)
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    present = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    missing = []
    for value in [*entries.values(), *(extra if isinstance(extra, list) else [])]:
        token = _added_token(value, special=True)
        if token.content not in present:
            missing.append(token)
            present.add(token.content)
    if missing:
        tokenizer.add_special_tokens(missing)


def _added_token(value: object, *, special: bool | None) -> AddedToken:
    """An AddedToken from a config's str or AddedToken dict; `special`, if given, overrides the
    dict's flag. A str is a special token matched as written (normalized=False)."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if not (isinstance(value, dict) and isinstance(value.get("content"), str)):
        raise ValueError(f"expected a token (str or AddedToken dict), got {value!r}")
    fields = {k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
