"""The embedded workload, loaded in one place: the pre-trained embedded model, its drafter and
the task's tokenizer (`load_embedded`), and what `tlt train` trains on (`train_inputs`).

Where the weights come from, the first that has them:
1. shipped in the package (`tlt_core/embedded/weights/`): the weights of the default configs,
   produced by this project's own deterministic pre-training and offline drafter training
   (`train_default_weights`; provenance in `weights/PROVENANCE.json`; a slow test retrains them
   and compares);
2. the user cache, $TLT_CACHE_DIR (default ~/.cache/tlt_core);
3. trained now, with a log record (info) before it starts saying what and about how long,
   then cached for later runs.
A folder is named by a digest of the configs that produce it (`model_folder_name`,
`drafter_folder_name`), so a changed config trains anew instead of loading weights it does not
describe. A drafter's folder sits inside its target's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tlt_core._version import __version__
from tlt_core.drafting.drafter import DRAFTER_CONFIG_FILE, Drafter
from tlt_core.embedded.architecture import EMBEDDED_MODEL_CONFIG
from tlt_core.embedded.offline_drafter import (OfflineDrafterConfig, OfflineDrafterReport,
                                               train_offline_drafter)
from tlt_core.embedded.pretrain import PretrainConfig, PretrainReport, evaluate, pretrain
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems, parse_answer
from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.tasks.inputs import Prompt, TrainInputs

logger = logging.getLogger(__name__)

SHIPPED_ROOT = Path(__file__).resolve().parent / "weights"
PROVENANCE_FILE = "PROVENANCE.json"
PRETRAIN_REPORT = "pretrain_report.json"
DRAFTER_REPORT = "drafter_report.json"
# What training costs when nothing has the weights, as measured on the project's 2-core machine
# (the reports' train_seconds; evaluation and sampling add a little), for the announcement.
PRETRAIN_MINUTES, DRAFTER_MINUTES = 5, 5
EVAL_PROMPTS = 32  # held-out problems of `tlt train --eval-every` on the embedded task
# `tlt train` starts from an early drafter: the default's offline training stopped at 100 of its
# 2,500 steps (teacher-forced top-1 0.70 instead of 0.98; about 2.3 tokens per speculative step
# at T = 1 instead of 5-7). On this small, overhead-bound model the fully trained drafter makes
# SD faster than plain decoding at every running batch, so the adaptive switch would never show;
# from the early one SD pays only in the tail.
MAIN_JOB_DRAFTER = OfflineDrafterConfig(steps=100)
# The main job's problems: a fixed set that every step samples, so that the step's reward
# measures the policy learning them (8 problems x 16 samples, lr 2e-4: the mean reward of the
# last 4 of 16 steps above the first 4's by 0.107-0.164 over seeds 0-2; docs/cli.md).
MAIN_JOB_PROBLEMS = 8


def cache_root() -> Path:
    return Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt_core"))


def model_folder_name(config: PretrainConfig = PretrainConfig(),
                      model_config: ModelConfig = EMBEDDED_MODEL_CONFIG) -> str:
    key = json.dumps({"pretrain": asdict(config), "model": model_config.to_hf_config()},
                     sort_keys=True, default=str)
    return f"embedded-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def drafter_folder_name(config: OfflineDrafterConfig = OfflineDrafterConfig()) -> str:
    key = json.dumps(asdict(config), sort_keys=True)
    return f"drafter-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def load_pretrained(config: PretrainConfig = PretrainConfig(),
                    model_config: ModelConfig = EMBEDDED_MODEL_CONFIG, *, progress: bool = True,
                    eval_problems: int = 512, shipped: bool = True, cache: Path | None = None
                    ) -> tuple[Transformer, PretrainReport, Path]:
    """(the pre-trained embedded model, its report, its folder): shipped, cached, or trained
    now and cached. shipped=False skips the shipped weights; cache replaces cache_root()."""
    name, cache = model_folder_name(config, model_config), cache or cache_root()
    for root in [SHIPPED_ROOT] * shipped + [cache]:
        folder = root / name
        if (folder / PRETRAIN_REPORT).is_file():
            report = PretrainReport(**json.loads((folder / PRETRAIN_REPORT).read_text()))
            return load_checkpoint(folder).eval(), report, folder
    folder = cache / name
    logger.info("embedded model: no weights for this pre-training config yet; pre-training it "
                "now (%d steps, about %d minutes on 2 CPU cores), cached in %s for later runs",
                config.steps, PRETRAIN_MINUTES, folder)
    model, losses, tokens_seen, seconds = pretrain(config, model_config, progress=progress)
    accuracy, entropy, lengths = evaluate(model, num_problems=eval_problems, task=config.task)
    tail = losses[-50:]
    report = PretrainReport(len(losses), tokens_seen, sum(tail) / len(tail), seconds, accuracy,
                            entropy, lengths)
    save_checkpoint(model, folder)
    (folder / PRETRAIN_REPORT).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return model, report, folder


def load_drafter(target: Transformer, target_folder: Path,
                 config: OfflineDrafterConfig = OfflineDrafterConfig(), *,
                 progress: bool = True, shipped: bool = True, cache: Path | None = None
                 ) -> tuple[Drafter, OfflineDrafterReport, Path]:
    """(the drafter of the target in target_folder, its report, its folder): next to a shipped
    or cached target, or trained now and cached (arguments as in load_pretrained)."""
    name, cache = drafter_folder_name(config), cache or cache_root()
    for root in [SHIPPED_ROOT] * shipped + [cache]:
        folder = root / target_folder.name / name
        if (folder / DRAFTER_REPORT).is_file():
            report = OfflineDrafterReport(**json.loads((folder / DRAFTER_REPORT).read_text()))
            return Drafter.load(folder, target).eval(), report, folder
    folder = cache / target_folder.name / name
    logger.info("embedded drafter: none trained for this config yet; training it now (%d steps "
                "on the model's own responses, about %d minutes on 2 CPU cores), cached in %s "
                "for later runs", config.steps, DRAFTER_MINUTES, folder)
    drafter, report = train_offline_drafter(target, config, progress=progress)
    drafter.save(folder, metadata={"offline_training": asdict(config)})
    (folder / DRAFTER_REPORT).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return drafter, report, folder


@dataclass(frozen=True)
class EmbeddedWorkload:
    target: Transformer  # the pre-trained embedded model, float32 on the CPU, in eval mode
    drafter: Drafter | None  # its offline-trained drafter (None when not asked for)
    tokenizer: CharTokenizer
    target_folder: Path  # a Hugging Face checkpoint folder of the target
    drafter_folder: Path | None  # a Drafter.save folder
    pretrain_report: PretrainReport
    drafter_report: OfflineDrafterReport | None


def load_embedded(*, with_drafter: bool = True, progress: bool = True,
                  drafter_config: OfflineDrafterConfig = OfflineDrafterConfig()
                  ) -> EmbeddedWorkload:
    """The embedded model (and its drafter, trained as drafter_config says) with the default
    pre-training, from wherever they are (module docstring)."""
    target, report, folder = load_pretrained(progress=progress)
    drafter = drafter_report = drafter_folder = None
    if with_drafter:
        drafter, drafter_report, drafter_folder = load_drafter(target, folder, drafter_config,
                                                               progress=progress)
    return EmbeddedWorkload(target, drafter, CharTokenizer(), folder, drafter_folder, report,
                            drafter_report)


def embedded_reward(prompt: str, response: str, reference: str) -> float:
    """The embedded task's checker: the answer after the one '#' marker, exactly."""
    return float(parse_answer(response) == reference)


def train_inputs(num_prompts: int = MAIN_JOB_PROBLEMS, seed: int = 2024,
                 progress: bool = True) -> TrainInputs:
    """What `tlt train` trains on by default: the embedded model and its early drafter
    (MAIN_JOB_DRAFTER), on problems of the embedded task, and EVAL_PROMPTS held-out ones
    (another seed) to evaluate on."""
    workload = load_embedded(progress=progress, drafter_config=MAIN_JOB_DRAFTER)
    tokenizer = workload.tokenizer

    def prompts(task_seed: int, count: int) -> list[Prompt]:
        return [Prompt(p.prompt, tuple(tokenizer.prompt_ids(p.prompt)), p.answer)
                for p in generate_problems(TaskConfig(seed=task_seed, num_problems=count))]

    return TrainInputs(workload.target, workload.drafter, prompts(seed, num_prompts),
                       prompts(seed + 1, 4), embedded_reward, tokenizer.decode_response,
                       (tokenizer.eos_id,),
                       f"the embedded task (countdown sums; {num_prompts} problems) and model "
                       f"(8 layers, 1.6M parameters)", [],
                       evaluation=prompts(seed + 2, EVAL_PROMPTS))


def train_default_weights(root: Path, *, progress: bool = True) -> dict:
    """Trains the default model and drafter from scratch into root (the shipped weights' layout:
    root/<model folder>/<drafter folder>) and returns their provenance record."""
    target, report, folder = load_pretrained(progress=progress, shipped=False, cache=root)
    _, drafter_report, drafter_folder = load_drafter(target, folder, progress=progress,
                                                     shipped=False, cache=root)
    _, early_report, early_folder = load_drafter(target, folder, MAIN_JOB_DRAFTER,
                                                 progress=progress, shipped=False, cache=root)
    return {
        "produced_by": "tlt_core.embedded.workload.train_default_weights "
                       "(python scripts/train_embedded_weights.py OUT)",
        "tlt_core_version": __version__, "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor() or None, "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "model": {"folder": folder.name, "pretrain": asdict(PretrainConfig()),
                  "report": asdict(report)},
        "drafter": {"folder": f"{folder.name}/{drafter_folder.name}",
                    "config_file": DRAFTER_CONFIG_FILE,
                    "offline_training": asdict(OfflineDrafterConfig()),
                    "report": asdict(drafter_report)},
        "main_job_drafter": {"folder": f"{folder.name}/{early_folder.name}",
                             "config_file": DRAFTER_CONFIG_FILE,
                             "offline_training": asdict(MAIN_JOB_DRAFTER),
                             "report": asdict(early_report)}}
