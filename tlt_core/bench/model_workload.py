"""The real-model side of the benchmarks: a local checkpoint, its drafter and prompts, loaded
one way for every `tlt bench ... --model DIR` (the embedded model is the default elsewhere).

Prompts are the data set's (`--data FILE`) or, with none, the project's own GSM8K-style
arithmetic problems (tlt_core.tasks.arithmetic_problems: no download), through the checkpoint's
prompt format (its chat template unless told otherwise), and every response stops at the
model's end-of-turn ids, as a rollout does. `label` names the model in every result row, so a
reader can tell the real model's numbers from the embedded model's.

Shapes: P prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Generic, Mapping, TypeVar

import torch

from tlt_core.config_flags import option
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.export import load_drafter
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.placement import Placement
from tlt_core.model.prompt_format import load_prompt_format
from tlt_core.tasks.arithmetic_problems import generate_problems
from tlt_core.tasks.data import Example, load_prompts

EMBEDDED_LABEL = "embedded (8 layers, 1.6M parameters)"
DEFAULT_PROBLEMS_SEED = 1  # not tlt data arithmetic's default seed 0, the drafter's training set

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelOptions:
    """--model/--drafter/--data/--dtype/--device: a benchmark on a local checkpoint instead of
    the embedded model (load_model_workload)."""
    model: Path | None = option("a local Hugging Face checkpoint folder (default: the embedded "
                                "model)", None, metavar="DIR")
    drafter: Path | None = option("the drafter for --model (tlt drafter train's folder, a tlt "
                                  "export, or a published EAGLE / EAGLE-3 checkpoint)", None,
                                  metavar="DIR")
    data: Path | None = option("prompts for --model (default: the project's arithmetic word "
                               "problems, seed 1) in its chat template", None, metavar="FILE")
    dtype: str = option("--model's dtype (auto: as tlt generate chooses)", "auto",
                        choices=DTYPES)
    device: str = option("where --model runs", "auto", choices=DEVICES)


ConfigT = TypeVar("ConfigT")


@dataclass(frozen=True)
class PerWorkload(Generic[ConfigT]):
    """A benchmark config whose sizes depend on the workload: the embedded run's defaults and a
    checkpoint's (--model). Its size flags default to None, "the workload's"."""
    embedded: ConfigT
    model: ConfigT

    def help(self, what: str, name: str) -> str:
        """A size flag's help, with both workloads' defaults of field `name`."""
        return (f"{what} (default: {getattr(self.embedded, name)}; with --model "
                f"{getattr(self.model, name)})")

    def config(self, model: bool, values: Mapping[str, object]) -> ConfigT:
        """The workload's config with `values` over it: those that name one of its fields and
        are given (not None). Its own checks' ValueErrors ("field: ...") pass through."""
        base = self.model if model else self.embedded
        names = {f.name for f in fields(base)}
        return replace(base, **{name: value for name, value in values.items()
                                if name in names and value is not None})


@dataclass
class ModelWorkload:
    target: torch.nn.Module
    drafter: Drafter | None
    prompts: list[tuple[int, ...]]  # (P,) token ids, in the prompt format
    answers: list[str]  # (P,) reference answers ("" where the data has none)
    stop_ids: tuple[int, ...]
    label: str  # the model's name and dtype, for result rows
    folder: Path
    drafter_folder: Path | None
    placement: Placement

    def requests(self, count: int, params: SamplingParams, *, first: int = 0) -> list[Request]:
        """`count` requests over the prompts from `first` on (wrapping around), stopping at the
        model's end-of-turn ids unless params has stop ids of its own."""
        if not params.stop_ids:
            params = SamplingParams(**{**params.__dict__, "stop_ids": self.stop_ids})
        return [Request(self.prompts[(first + i) % len(self.prompts)], params)
                for i in range(count)]


def model_label(folder: str | Path, dtype: torch.dtype) -> str:
    """"<model name> (<dtype>)": the name from config.json's _name_or_path, or a conversion's
    source, else the folder's name."""
    folder = Path(folder)
    name = folder.name
    for file, key in (("converted_from.json", "name"), ("config.json", "_name_or_path")):
        path = folder / file
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get(key)
            except (ValueError, AttributeError):
                value = None
            if isinstance(value, str) and value:
                name = Path(value).name
                break
    return f"{name} ({str(dtype).removeprefix('torch.')})"


def load_model_workload(folder: str | Path, placement: Placement, *,
                        drafter: str | Path | None = None, data: str | Path | None = None,
                        prompts: int = 256, chat_template: str | Path = "auto",
                        system_prompt: str | None = None) -> ModelWorkload:
    """The checkpoint in `folder` in `placement`, the drafter folder `drafter` attached to it
    (any layout load_drafter reads), and up to `prompts` prompts of `data` (default: that many
    arithmetic problems)."""
    folder = Path(folder)
    prompt_format = load_prompt_format(folder, chat_template, system_prompt)
    if data is not None:
        examples = load_prompts(data, require_answers=False).examples[:prompts]
    else:
        examples = [Example(p["question"], p["answer"].rsplit("#### ", 1)[-1], i + 1)
                    for i, p in enumerate(generate_problems(prompts, seed=DEFAULT_PROBLEMS_SEED))]
    encoded = [tuple(prompt_format.encode(list(e.messages) if e.messages else e.prompt))
               for e in examples]
    target = load_checkpoint(folder, dtype=placement.dtype, device=placement.device)
    attached = load_drafter(drafter, target).eval() if drafter is not None else None
    return ModelWorkload(target, attached, encoded, [e.answer for e in examples],
                         tuple(prompt_format.tokenizer.eos_ids),
                         model_label(folder, placement.dtype), folder,
                         None if drafter is None else Path(drafter), placement)
