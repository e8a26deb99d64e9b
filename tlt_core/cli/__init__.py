"""The `tlt` command line. Subcommands:

  tlt train           GRPO with TLT (the main job): the embedded task by default, or --model
                      DIR --data FILE; --compare adds the SD-off baseline
  tlt generate        text generation with speculative decoding, batch or interactive
  tlt export drafter  a drafter in the EAGLE-1 / EAGLE-3 layouts vLLM, SGLang, speculators load
  tlt export policy   a `tlt train` run's policy as a Hugging Face folder
  tlt bench ...       benchmarks, each a ratio against a baseline run side by side
  tlt task lengths    the embedded task's heavy-tailed response lengths (--plot PNG)
  tlt demo            one speculative verification step on a toy tree, explained

`main.py` builds the tree from the subcommand modules and dispatches; `options.py` derives
flags from config dataclasses; `config_file.py` reads `--config FILE`; `run_folder.py` says when
`tlt train` may use its --out (fresh, --resume, --overwrite, its lock). Run as `tlt ...` or
`python -m tlt_core.cli ...` (what `torchrun -m tlt_core.cli train` uses).
"""

from tlt_core.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
