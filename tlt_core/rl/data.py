"""Prompt data sets for `tlt train --data FILE`: JSONL or Parquet rows of a prompt and its
reference answer.

Each row needs a `prompt` and an `answer` field (names configurable), both strings (a number
answer is accepted and written as text). A malformed row — not JSON, not an object, a field
missing, empty or of the wrong type — is reported with its line (JSONL) or row (Parquet) number;
`on_bad_rows="skip"` keeps going without it (the report says how many and which), `"error"`
raises `DataError` listing them (at most 10 shown). Nothing is dropped silently, and a file with
no good row is an error either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    line: int  # 1-based line (JSONL) or row (Parquet) in the file


@dataclass(frozen=True)
class Dataset:
    examples: list[Example]
    bad_rows: list[tuple[int, str]]  # (line, why)
    path: Path


def load_prompts(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 on_bad_rows: str = "skip") -> Dataset:
    path = Path(path)
    if on_bad_rows not in ("skip", "error"):
        raise ValueError(f"on_bad_rows: must be 'skip' or 'error', got {on_bad_rows!r}")
    if not path.is_file():
        raise FileNotFoundError(f"data: no file at {path}")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    examples, bad = [], []
    for line, row in rows:
        if isinstance(row, str):  # the reader's own complaint (not JSON)
            bad.append((line, row))
            continue
        if not isinstance(row, dict):
            bad.append((line, f"expected an object, got {type(row).__name__}"))
            continue
        why = _check(row, prompt_key, answer_key)
        if why:
            bad.append((line, why))
            continue
        examples.append(Example(row[prompt_key], str(row[answer_key]), line))
    if bad and on_bad_rows == "error":
        shown = "; ".join(f"line {line}: {why}" for line, why in bad[:10])
        raise DataError(f"data: {len(bad)} malformed rows in {path} ({shown}); fix them or "
                        "pass on_bad_rows='skip' (--skip-bad-rows)")
    if not examples:
        raise DataError(f"data: no usable rows in {path} (need '{prompt_key}' and "
                        f"'{answer_key}' strings; {len(bad)} malformed)")
    return Dataset(examples, bad, path)


def _check(row: dict, prompt_key: str, answer_key: str) -> str | None:
    for key in (prompt_key, answer_key):
        if key not in row:
            return f"no '{key}' field"
    if not isinstance(row[prompt_key], str) or not row[prompt_key].strip():
        return f"'{prompt_key}' must be a non-empty string"
    answer = row[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        return f"'{answer_key}' must be a non-empty string or number"
    return None


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as error:
                yield line, f"not JSON ({error.msg})"


def _parquet_rows(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data: reading Parquet needs pyarrow (pip install pyarrow); or convert "
                        "the file to JSONL") from None
    table = pq.read_table(path)
    for index, row in enumerate(table.to_pylist(), start=1):
        yield index, row
