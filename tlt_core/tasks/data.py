"""Prompt data sets for `tlt train --data PATH`: rows of a prompt and its reference answer, read
from the files a user already has.

Formats, by path:
- a folder written by `datasets`' `save_to_disk`: a `DatasetDict` (dataset_dict.json) gives its
  split `split` ("train" when None), a `Dataset` (state.json) all its rows;
- `.parquet`: read with pyarrow;
- `.csv` and `.json` (a JSON array or JSON Lines): read with `datasets.load_dataset`;
- anything else: JSON Lines, one object a line.
`datasets` and pyarrow are imported only for the formats that need them (`datasets` takes seconds
to import). `split` names a split of a `DatasetDict`; giving it for data without splits is an
error rather than ignored.

Fields. `prompt_key=None` takes the first of PROMPT_KEYS the data has ("prompt", "question",
"problem", "messages"), `answer_key=None` the first of ANSWER_KEYS ("answer", "solution",
"reference", and veRL's "reward_model.ground_truth"); a key given explicitly is the only one
looked for. The choice is made once, at the first row that has one of the fields, so every row
is read the same way; Dataset.prompt_key and Dataset.answer_key say which was used.
A key is a field path: a row's own key when it has one of that name, else dotted steps into
nested objects (`reward_model.ground_truth` in veRL's Parquet files, whose `prompt` is a list
of chat messages). A row without it is a bad row whose report names the path, the step that is
missing and the keys found there. Example.row keeps every field of the row, for reward functions
that take more than the prompt and the answer (TRL's keyword columns, veRL's `data_source` and
`extra_info`).
- A prompt is a non-empty string, or chat messages: a list of {"role": str, "content": str}
  objects (roles in ROLES) with a user message. Example.messages keeps them; Example.prompt is
  the last user message's text, which is what a reward function sees.
- An answer is a non-empty string or a finite number (written as text); a final answer that
  reads as a non-finite number ("nan", "inf", "1e999") is refused, since no response equals it. A worked solution
  (GSM8K's "... #### 72", a MATH solution ending in a `\\boxed{}`) gives Example.answer its final
  answer, by `rewards.reference_answer`, and keeps the full text as Example.solution.

Bad rows. A malformed row — not UTF-8, not JSON (or JSON Python cannot hold: nested thousands
deep, an integer of thousands of digits), not an object, a field missing, empty or of the wrong
type — is reported with its line (JSON Lines) or row (other formats) number, 1-based;
`on_bad_rows="skip"` keeps going without it (the report says how many and which), `"error"`
raises `DataError` listing them (at most 10 shown). Nothing is dropped silently, and data with no
good row is an error either way. A line that is not UTF-8 is reported as bad, never decoded into
other characters; a UTF-8 byte-order mark opening the file is skipped. A file pyarrow or
`datasets` cannot read at all is a `DataError` naming it.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from tlt_core.tasks.rewards import reference_answer

PROMPT_KEYS = ("prompt", "question", "problem", "messages")
ANSWER_KEYS = ("answer", "solution", "reference", "reward_model.ground_truth")
SHOWN_KEYS = 20  # keys listed when a field path is missing
ROLES = ("system", "developer", "user", "assistant", "tool")
DATASETS_FORMATS = {".csv": "csv", ".json": "json"}  # suffix -> datasets' builder
UTF8_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Example:
    prompt: str  # the prompt text; for chat messages, the last user message's content
    answer: str  # the final answer a reward compares against
    line: int  # 1-based line (JSON Lines) or row (other formats) in the data
    solution: str | None = None  # the answer field's full text, when it was a worked solution
    messages: tuple[dict, ...] | None = None  # the chat messages, when the prompt was messages
    row: dict = field(default_factory=dict)  # every field of the row, as read


@dataclass(frozen=True)
class Dataset:
    examples: list[Example]
    bad_rows: list[tuple[int, str]]  # (line or row, why)
    path: Path
    unit: str = "line"  # what Example.line and bad_rows count: "line" or "row"
    split: str | None = None  # the DatasetDict split read, if the data had splits
    prompt_key: str | None = None  # the fields read (None: no row had one)
    answer_key: str | None = None


class _BadRow(Exception):
    """Why one row cannot be used; load_prompts records it against the row."""


def load_prompts(path: str | Path, *, prompt_key: str | None = None,
                 answer_key: str | None = None, on_bad_rows: str = "skip",
                 split: str | None = None, require_answers: bool = True) -> Dataset:
    """require_answers=False: prompts alone are enough (drafter training); a row without an
    answer field gets answer ""."""
    path = Path(path)
    if on_bad_rows not in ("skip", "error"):
        raise ValueError(f"on_bad_rows: must be 'skip' or 'error', got {on_bad_rows!r}")
    for name, value in (("prompt_key", prompt_key), ("answer_key", answer_key),
                        ("split", split)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name}: must be a non-empty string or None, got {value!r}")
    rows, unit, split_read = _rows(path, split)
    prompt_field, answer_field = prompt_key, answer_key
    examples, bad = [], []
    for number, row in rows:
        if isinstance(row, str):  # the reader's own complaint (not JSON)
            bad.append((number, row))
            continue
        if not isinstance(row, dict):
            bad.append((number, f"expected an object, got {type(row).__name__}"))
            continue
        prompt_field = prompt_field or next((k for k in PROMPT_KEYS if _has(row, k)), None)
        answer_field = answer_field or next((k for k in ANSWER_KEYS if _has(row, k)), None)
        try:
            examples.append(_example(row, number, prompt_field, answer_field)
                            if require_answers or _has(row, answer_field)
                            else _prompt_only(row, number, prompt_field))
        except _BadRow as why:
            bad.append((number, str(why)))
        except (ValueError, RecursionError) as error:  # a value Python cannot handle as text
            bad.append((number, f"unreadable value ({type(error).__name__}: {error})"[:200]))
    if bad and on_bad_rows == "error":
        shown = "; ".join(f"{unit} {number}: {why}" for number, why in bad[:10])
        raise DataError(f"data: {len(bad)} malformed rows in {path} ({shown}); fix them or "
                        "pass on_bad_rows='skip' (--skip-bad-rows)")
    if not examples:
        first = f"; {unit} {bad[0][0]}: {bad[0][1]}" if bad else ""
        raise DataError(f"data: no usable rows in {path} (need a prompt field "
                        f"({_looked_for(prompt_key, PROMPT_KEYS)}) and an answer field "
                        f"({_looked_for(answer_key, ANSWER_KEYS)}); {len(bad)} malformed"
                        f"{first})")
    return Dataset(examples, bad, path, unit, split_read, prompt_field, answer_field)


def _prompt_only(row: dict, number: int, prompt_field: str | None) -> Example:
    prompt, messages = _prompt(_value(row, prompt_field, PROMPT_KEYS), prompt_field)
    return Example(prompt, "", number, None, messages, row)


def _has(row: dict, path: str | None) -> bool:
    try:
        _value(row, path, ())
    except _BadRow:
        return False
    return True


def _value(row: dict, path: str | None, candidates: tuple[str, ...]):
    """The value at a field path (the module docstring's Fields); _BadRow naming the path, the
    missing step and the keys there when the row lacks it."""
    if path is None:
        raise _BadRow(f"no {'prompt' if candidates is PROMPT_KEYS else 'answer'} field "
                      f"({_looked_for(None, candidates)}; the row's keys: {_keys(row)})")
    if path in row:
        return row[path]
    value, walked = row, []
    for step in path.split("."):
        if not isinstance(value, dict):
            raise _BadRow(f"no '{path}' field: '{'.'.join(walked)}' is a "
                          f"{type(value).__name__}, not an object")
        if step not in value:
            where = f"'{'.'.join(walked)}' has" if walked else "the row's keys:"
            raise _BadRow(f"no '{path}' field ({where} {_keys(value)})")
        value, walked = value[step], walked + [step]
    return value


def _keys(mapping: dict) -> str:
    keys = [repr(str(key)) for key in list(mapping)[:SHOWN_KEYS]]
    more = f", ... ({len(mapping)} in all)" if len(mapping) > SHOWN_KEYS else ""
    return (", ".join(keys) + more) if keys else "none"


def _looked_for(explicit: str | None, candidates: tuple[str, ...]) -> str:
    return f"'{explicit}'" if explicit else "one of " + ", ".join(f"'{k}'" for k in candidates)


def _example(row: dict, number: int, prompt_field: str | None,
             answer_field: str | None) -> Example:
    prompt_value = _value(row, prompt_field, PROMPT_KEYS)
    answer = _value(row, answer_field, ANSWER_KEYS)
    prompt, messages = _prompt(prompt_value, prompt_field)
    if (isinstance(answer, bool) or not isinstance(answer, (str, int, float))
            or (isinstance(answer, float) and not math.isfinite(answer))
            or not str(answer).strip()):
        raise _BadRow(f"'{answer_field}' must be a non-empty string or a finite number")
    text = str(answer)
    final = reference_answer(text)
    if not final:
        raise _BadRow(f"'{answer_field}' has an empty final answer (after '####' or in "
                      "\\boxed{})")
    if _is_non_finite_number(final):
        raise _BadRow(f"'{answer_field}' has a non-finite final answer {final!r}; no response "
                      "can equal it")
    return Example(prompt, final, number, text if final != text.strip() else None, messages,
                   row)


def _is_non_finite_number(text: str) -> bool:
    """"nan", "inf", "-Infinity", "1e999": text that reads as a float that is not finite."""
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _prompt(value, field: str) -> tuple[str, tuple[dict, ...] | None]:
    """(prompt text, chat messages or None) from a prompt field's value."""
    if isinstance(value, str) and value.strip():
        return value, None
    if not isinstance(value, list) or not value:
        raise _BadRow(f"'{field}' must be a non-empty string or a list of chat messages")
    for index, message in enumerate(value, start=1):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise _BadRow(f"'{field}' message {index}: must be an object with string 'role' "
                          "and 'content'")
        if message["role"] not in ROLES:
            raise _BadRow(f"'{field}' message {index}: role {message['role']!r} is not one of "
                          f"{', '.join(ROLES)}")
    users = [message["content"] for message in value if message["role"] == "user"]
    if not users or not users[-1].strip():
        raise _BadRow(f"'{field}' needs a user message with text (the last one is the prompt)")
    return users[-1], tuple(dict(message) for message in value)


def _rows(path: Path, split: str | None) -> tuple[Iterable[tuple[int, object]], str, str | None]:
    """(numbered rows, what the numbers count, the split read) for the data at `path`."""
    if path.is_dir():
        rows, split_read = _saved_dataset_rows(path, split)
        return rows, "row", split_read
    if not path.is_file():
        raise FileNotFoundError(f"data: no file or folder at {path}")
    if split is not None:
        raise ValueError(f"split: {path} is a single file with no splits; omit split")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_rows(path), "row", None
    if suffix in DATASETS_FORMATS:
        return _datasets_file_rows(path, DATASETS_FORMATS[suffix]), "row", None
    return _jsonl_rows(path), "line", None


def _jsonl_rows(path: Path):
    # Bytes, decoded line by line: a line that is not UTF-8 is reported, never altered.
    with path.open("rb") as handle:
        for line, raw in enumerate(handle, start=1):
            if line == 1:
                raw = raw.removeprefix(UTF8_BOM)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield line, (f"not UTF-8 (byte 0x{raw[error.start]:02x} at column "
                             f"{error.start + 1}); re-save the file as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as error:
                yield line, f"not JSON ({error.msg})"
            except RecursionError:
                yield line, "not JSON we can read (nested too deeply)"
            except ValueError as error:  # e.g. an integer of more than 4300 digits
                yield line, f"not JSON we can read ({error})"[:200]


def _parquet_rows(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data: reading Parquet needs pyarrow (pip install pyarrow); or convert "
                        "the file to JSONL") from None
    import pyarrow

    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise DataError(f"data: cannot read {path} as Parquet ({type(error).__name__}: "
                        f"{error})") from error
    return enumerate(table.to_pylist(), start=1)


def _import_datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise DataError(f"data: reading {path} needs the datasets package (pip install "
                        "datasets); or convert it to JSONL") from None
    return datasets


def _saved_dataset_rows(path: Path, split: str | None):
    if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        raise DataError(f"data: {path} is a folder but not a dataset written by datasets' "
                        "save_to_disk (it has no dataset_dict.json or state.json)")
    datasets = _import_datasets(path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001 - datasets raises many types for a bad folder
        raise DataError(f"data: cannot read the saved dataset {path} "
                        f"({type(error).__name__}: {error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise ValueError(f"split: {path} has no split {name!r}; its splits are "
                             f"{', '.join(sorted(loaded))}")
        return enumerate(loaded[name], start=1), name
    if split is not None:
        raise ValueError(f"split: {path} holds a single Dataset with no splits; omit split")
    return enumerate(loaded, start=1), None


def _datasets_file_rows(path: Path, builder: str) -> list[tuple[int, dict]]:
    datasets = _import_datasets(path)
    # A throwaway cache: reading a user's file should not leave an Arrow copy of it in ~/.cache.
    with tempfile.TemporaryDirectory(prefix="tlt-data-") as cache:
        try:
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train",
                                           cache_dir=cache, keep_in_memory=True)
        except Exception as error:  # noqa: BLE001 - datasets raises many types for a bad file
            raise DataError(f"data: datasets cannot read {path} as {builder} "
                            f"({type(error).__name__}: {error})") from error
        return list(enumerate(loaded, start=1))  # read before the cache folder goes
