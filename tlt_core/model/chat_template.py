"""A checkpoint's chat template: messages -> the prompt text, exactly as transformers'
`tokenizer.apply_chat_template(messages, tokenize=False)` writes it, without transformers.

Where the template comes from (`ChatTemplate.from_folder`, transformers' order): the folder's
`chat_template.jinja`; else `chat_templates/default.jinja`; else `tokenizer_config.json`'s
"chat_template", a string or a list of {"name", "template"} of which "default" is used. A user's
template file is read by `ChatTemplate.from_file`.

What the template sees (transformers 5, `render_jinja_template`): `messages`; `tools=None` and
`documents=None` (tool schemas and retrieval documents are not supported here);
`add_generation_prompt`; every special token of the tokenizer config as a string (`bos_token`,
`eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`, any other
"*_token" key and the "extra_special_tokens" names; an AddedToken dict gives its "content");
then the caller's `template_vars` (e.g. `enable_thinking`), which override special tokens.
Messages are plain data: each a dict with str "role" and "content", other keys (tool_calls,
name, ...) passed on; keys whose value is None are dropped, and a message's reasoning is also
given as "thinking" and "reasoning_content", as transformers does.

How it is rendered: jinja2's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
the loop-controls extension ({% break %}, {% continue %}); `{% generation %}` blocks (the marker
transformers uses for assistant-token masks) render their body. Globals `raise_exception(msg)`,
`strftime_now(format)` (local time), a `dict` that is not the dict type and a `namespace` that
refuses names starting with "_"; the `tojson` filter is `json.dumps` (no HTML escaping,
ensure_ascii=False, with indent / separators / sort_keys). The sandbox means a template read
from disk cannot run code: attribute access to Python internals and mutation of the data it is
given raise jinja2's SecurityError. Every failure — a syntax error, `raise_exception`, a
sandbox violation, any error while rendering — is a `ChatTemplateError` (a ValueError) naming
the template's origin.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_FOLDER = "chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
# Tokens chat templates write to close a turn; generation must stop at them even where the
# checkpoint's eos is another token (e.g. Qwen2.5 base: eos <|endoftext|>, turns end <|im_end|>).
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# What `render` itself passes; template_vars may not set them.
_RESERVED_VARS = ("messages", "add_generation_prompt", "tools", "documents")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the standard


class ChatTemplateError(ValueError):
    """A chat template that cannot be read, compiled or rendered."""


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], *,
                 origin: str = "chat template"):
        if not isinstance(source, str):
            raise TypeError(f"source: expected the template text (str), got "
                            f"{type(source).__name__}")
        if not isinstance(special_tokens, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in special_tokens.items()):
            raise TypeError("special_tokens: expected a mapping of str names to str tokens, got "
                            f"{special_tokens!r}")
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.origin = origin
        environment = _sandbox()
        try:
            syntax = environment.parse(source)
            self._template = environment.from_string(syntax)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{origin}: not a valid jinja template ({error})") from error
        literal_text = "\0".join(
            [node.data for node in syntax.find_all(jinja2.nodes.TemplateData)]
            + [node.value for node in syntax.find_all(jinja2.nodes.Const)
               if isinstance(node.value, str)])
        eos = self.special_tokens.get("eos_token")
        writes_eos = eos is not None and (
            "eos_token" in jinja2.meta.find_undeclared_variables(syntax) or eos in literal_text)
        markers = [m for m in END_OF_TURN_MARKERS if m in literal_text and m != eos]
        self.end_of_turn_tokens: tuple[str, ...] = tuple(([eos] if writes_eos else []) + markers)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The template of a Hugging Face checkpoint folder, or None if it has none."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"folder: {folder} is not a directory")
        special_tokens = read_special_tokens(folder)
        for path in (folder / TEMPLATE_FILE, folder / TEMPLATES_FOLDER / "default.jinja"):
            if path.is_file():
                return cls(path.read_text(encoding="utf-8"), special_tokens, origin=str(path))
        if (folder / TEMPLATES_FOLDER).is_dir():
            # transformers takes the folder's templates over the config's, and has no default
            raise ChatTemplateError(f"{folder / TEMPLATES_FOLDER}: has no default.jinja (and "
                                    f"the folder no {TEMPLATE_FILE})")
        entry = read_tokenizer_config(folder).get("chat_template")
        if entry is None:
            return None
        origin = f"{folder / TOKENIZER_CONFIG} chat_template"
        return cls(_default_template(entry, origin), special_tokens, origin=origin)

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: Mapping[str, str]) -> ChatTemplate:
        """A template file the user gave (jinja text), rendered with `special_tokens`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"path: no chat template file {path}")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ChatTemplateError(f"path: {path} is not UTF-8 text ({error})") from error
        return cls(source, special_tokens, origin=str(path))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               system_prompt: str | None = None,
               template_vars: Mapping[str, object] | None = None) -> str:
        """The prompt text of `messages`. `system_prompt`, if given, is prepended as a system
        message unless the messages already have one; `add_generation_prompt` ends the text
        with the header of an assistant turn."""
        if not isinstance(add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt: expected bool, got "
                            f"{type(add_generation_prompt).__name__}")
        chat = _check_messages(messages)
        if system_prompt is not None:
            if not isinstance(system_prompt, str):
                raise TypeError(f"system_prompt: expected str, got "
                                f"{type(system_prompt).__name__}")
            if not any(message["role"] == "system" for message in chat):
                chat.insert(0, {"role": "system", "content": system_prompt})
        template_vars = dict(template_vars or {})
        for name in template_vars:
            if not isinstance(name, str) or name in _RESERVED_VARS:
                raise ValueError(f"template_vars: {name!r} cannot be set (render sets "
                                 f"{', '.join(_RESERVED_VARS)})")
        variables = {**self.special_tokens, **_plain(template_vars, "template_vars")}
        try:
            return self._template.render(messages=[_alias_reasoning(m) for m in chat],
                                         tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except _TemplateRaised as error:
            raise ChatTemplateError(f"{self.origin}: the template refused the messages: "
                                    f"{error}") from error
        except jinja2.exceptions.SecurityError as error:
            raise ChatTemplateError(f"{self.origin}: the template tried an operation the "
                                    f"sandbox forbids ({error})") from error
        except Exception as error:  # noqa: BLE001 - a template's failure may be any exception
            raise ChatTemplateError(f"{self.origin}: rendering failed "
                                    f"({type(error).__name__}: {error})") from error


def read_tokenizer_config(folder: Path) -> dict:
    """The folder's tokenizer_config.json as a dict ({} where there is none)."""
    return _read_json_object(Path(folder) / TOKENIZER_CONFIG)


def read_special_tokens(folder: str | Path) -> dict[str, str]:
    """The special tokens a template is rendered with: `special_token_entries` as strings."""
    return {name: token_content(value)
            for name, value in special_token_entries(folder).items()}


def special_token_entries(folder: str | Path) -> dict[str, str | dict]:
    """The folder's special tokens as its tokenizer config gives them (a str, or an AddedToken
    dict with "content"), as transformers 5 reads them: the named ones in transformers' order,
    then any other "*_token" key with a token value and the entries of "extra_special_tokens"
    when it is a dict. special_tokens_map.json (the legacy file) overrides the config only
    where the config has no "added_tokens_decoder"."""
    folder = Path(folder)
    config = read_tokenizer_config(folder)
    if "added_tokens_decoder" not in config:
        config.update(_read_json_object(folder / SPECIAL_TOKENS_MAP))
    extra = config.get("extra_special_tokens")
    model_specific = extra if isinstance(extra, dict) else {}
    given = {**config, **model_specific}
    names = [*NAMED_SPECIAL_TOKENS, *(n for n in given if n not in NAMED_SPECIAL_TOKENS and (
        n.endswith("_token") or n in model_specific))]
    return {name: given[name] for name in names if token_content(given.get(name)) is not None}


def token_content(value: object) -> str | None:
    """A token's text: a str, or the "content" of an AddedToken dict; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _check_messages(messages: object) -> list[dict]:
    """`messages` as fresh plain data, None-valued keys dropped; a TypeError or ValueError
    naming the message that is not a dict with str "role" and "content"."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages: expected a list of {{'role', 'content'}} dicts, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ValueError("messages: empty; a chat needs at least one message")
    chat = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where}: expected a dict with 'role' and 'content', got "
                            f"{type(message).__name__}")
        message = _plain({k: v for k, v in message.items() if v is not None}, where)
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"{where}: needs a str {key!r}, got {message.get(key)!r}")
        chat.append(message)
    return chat


def _read_json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path.name}: cannot be parsed ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path.name}: expected a JSON object, got {type(value).__name__}")
    return value


def _default_template(entry: object, origin: str) -> str:
    """The template text of a config's "chat_template": a str, or the "default" of named ones."""
    if isinstance(entry, str):
        return entry
    if not (isinstance(entry, list) and all(
            isinstance(e, dict) and isinstance(e.get("name"), str)
            and isinstance(e.get("template"), str) for e in entry)):
        raise ChatTemplateError(f"{origin}: expected a str or a list of {{'name', 'template'}} "
                                f"dicts, got {str(entry)[:80]!r}")
    named = {e["name"]: e["template"] for e in entry}
    if "default" not in named:
        raise ChatTemplateError(f"{origin}: has templates {sorted(named)} but no 'default'")
    return named["default"]


def _plain(value: object, where: str):
    """`value` rebuilt from exact JSON types, so the template sees no caller object's methods
    (the sandbox guards Python internals, not what a rich object's public methods do)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, ...) back to their base value; str() of a (str, Enum) is its name.
    for kind, base_value in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):
            return base_value(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"{where}: {type(value).__name__} is not plain data (str, number, bool, "
                    "None, list or dict)")


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under "thinking" and "reasoning_content" too (templates read one
    or the other), with transformers' key order."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _TemplateRaised(jinja2.TemplateError):
    """The template's own `raise_exception(message)`."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; prompts need the text as written.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _DictMaker:
    """The template's `dict`: makes dicts, but is not the dict type, whose class attributes
    would be one step closer to Python internals."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _refuse_private_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a namespace cannot hold names starting with '_', got {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses "_"-prefixed names, through which a template could reach
    CPython internals. Methods are looked up on the class: Namespace's __getattribute__ reads
    its attributes from the stored names."""

    def __init__(*args, **kwargs):  # noqa: N805 - Namespace's signature, so `self=` is a name
        self, args = args[0], args[1:]
        names = dict(*args, **kwargs)
        for name in names:
            _refuse_private_name(name)
        jinja2.utils.Namespace.__init__(self, names)

    def __setitem__(self, name, value):
        _refuse_private_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it for
    its assistant-token mask; here the block is its body, rendered in its own scope as
    transformers' call block renders it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _sandbox() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                               dict=_DictMaker(), namespace=_Namespace)
    return environment
