"""`tlt bench peers`: tlt_core next to the tools people already use, on the same work.

hf_assisted: Hugging Face transformers' assisted decoding (`generate(assistant_model=...)`, batch
1, the only batch size it supports) against our speculative decoding at batch 1, with the same
target weights: the pre-trained embedded model exported to a Hugging Face checkpoint. The
assistant is what assisted decoding expects, a small model of the same vocabulary: the embedded
model's architecture with 2 layers instead of 8, pre-trained on the same task the same way
(trained and cached on first use, about a minute); ours drafts with its one-layer EAGLE drafter, strategy
(6,1,7). Both generate every prompt of a fixed set of task problems to <eos>, one at a time;
the numbers are generated tokens per second over the whole set, at T = 0 (greedy: both must
produce the same tokens, checked) and at T = 1. Rows carry `peer`, `setting`, `ours`, `theirs`
(tokens per second) and `ratio` (ours / theirs: above 1, ours is faster).

trl_grpo: TRL's GRPOTrainer against our GRPO driver, TLT on and SD off, on the same model (the
pre-trained embedded model; TRL gets it as a Hugging Face checkpoint with a character tokenizer that
encodes exactly as ours), the same prompt pool (the first 64 embedded-task prompts of `tlt
train`), 8 prompts x 8 samples per step, at most 256 new tokens, T = 1, lr 5e-5, no KL, one
optimizer step per GRPO step over all 64 samples, float32 on both sides (TRL's default bf16
autocast is turned off), on the CPU. TRL generates with `model.generate`
(HF, one padded batch of 64) and trains in 4 accumulated micro-batches of 16, its fastest setting
we measured here (within 10% of 1 x 64 and 8 x 8; transformers' continuous batching,
`use_transformers_continuous_batching`, fails on the CPU in TRL 1.16: accelerate casts its paged
cache to float); ours trains in length-sorted micro-batches (`micro_batch_tokens`). The comparison
is generated tokens per second of GRPO step time over `steps` steps after one untimed step (the
runs sample different lengths: tokens per second is what the work costs; seconds per step are
reported too).

The peers are optional benchmark dependencies, never installed by the core install:
`bash bench/setup_peers.sh` installs TRL.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tlt_core.config_flags import add_dataclass_arguments, option
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.architecture import EMBEDDED_MODEL_CONFIG
from tlt_core.embedded.pretrain import PretrainConfig
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems
from tlt_core.embedded.workload import embedded_reward, load_pretrained, train_inputs
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import save_checkpoint
from tlt_core.rl.driver import RLDriver, TrainConfig

ASSISTANT_LAYERS = 2


@dataclass(frozen=True)
class PeersOptions:
    """`tlt bench peers`: where the rows go."""
    json: Path | None = option("write the rows here", None, metavar="FILE")
    no_progress: bool = option("no progress bars", False)


CLI_OPTIONS = (PeersOptions,)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench peers`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


def assistant_model(progress: bool = True):
    """The 2-layer assistant for assisted decoding, pre-trained like the target (cached)."""
    config = replace(EMBEDDED_MODEL_CONFIG, num_layers=ASSISTANT_LAYERS)
    return load_pretrained(PretrainConfig(), config, progress=progress)[0]


def hf_assisted(target, drafter, *, problems: int = 12, seed: int = 4242, progress: bool = True
                ) -> list[dict]:
    from transformers import AutoModelForCausalLM

    tokenizer = CharTokenizer()
    prompts = [tokenizer.prompt_ids(p.prompt)
               for p in generate_problems(TaskConfig(seed=seed, num_problems=problems))]
    max_new = 7 * 63 + 16
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        save_checkpoint(target, a)
        save_checkpoint(assistant_model(progress), b)
        hf_target = AutoModelForCausalLM.from_pretrained(a, torch_dtype=torch.float32).eval()
        hf_assistant = AutoModelForCausalLM.from_pretrained(b, torch_dtype=torch.float32).eval()
    engine = RolloutEngine(target, EngineConfig(max_batch=1, max_len=max_new + 16, seed=seed),
                           drafter)
    rows = []
    for temperature in (0.0, 1.0):
        def ours():
            params = SamplingParams(temperature=temperature, max_tokens=max_new,
                                    stop_ids=(tokenizer.eos_id,))
            outs = []
            for prompt in prompts:  # one at a time: batch 1, as assisted decoding runs
                outs += engine.generate([Request(prompt, params)], Strategy(6, 1, 7)).rollouts
            return [r.tokens.tolist() for r in outs]

        def theirs():
            outs = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                with torch.inference_mode():
                    generated = hf_target.generate(
                        ids, attention_mask=torch.ones_like(ids), assistant_model=hf_assistant,
                        do_sample=temperature > 0, temperature=temperature or None, top_k=0,
                        max_new_tokens=max_new, eos_token_id=tokenizer.eos_id,
                        pad_token_id=tokenizer.pad_id)
                outs.append(generated[0, len(prompt):].tolist())
            return outs

        ours(), theirs()  # untimed: one-time costs
        (ours_out, ours_s), (theirs_out, theirs_s) = _timed(ours), _timed(theirs)
        if temperature == 0.0:
            assert ours_out == theirs_out, "greedy outputs differ between tlt_core and transformers"
        ours_tokens = sum(map(len, ours_out))
        theirs_tokens = sum(map(len, theirs_out))
        rows.append({"peer": "hf_assisted", "setting": f"batch 1, T={temperature:g}",
                     "ours": ours_tokens / ours_s, "theirs": theirs_tokens / theirs_s,
                     "ratio": (ours_tokens / ours_s) / (theirs_tokens / theirs_s),
                     "tokens_ours": ours_tokens, "tokens_theirs": theirs_tokens})
    return rows


def _char_tokenizer():
    """A Hugging Face fast tokenizer that encodes like CharTokenizer.prompt_ids (one token per
    character, <bos> first) and decodes without spaces."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = CharTokenizer()
    core = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(tokenizer.pieces)},
                                      unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")


def trl_grpo(steps: int = 10, prompts: int = 64, progress: bool = True) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig
    from trl import GRPOTrainer

    config = TrainConfig(steps=steps + 1, max_new_tokens=256, lr=5e-5, minibatch_size=64)
    trl_micro_batch = 16
    tokenizer = CharTokenizer()

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    inputs = train_inputs(progress=progress)
    pool = inputs.prompts[:prompts]
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as out:
        save_checkpoint(inputs.policy, folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for name, value in (("eos_token_id", tokenizer.eos_id), ("pad_token_id", tokenizer.pad_id),
                            ("bos_token_id", tokenizer.bos_id)):
            setattr(model.generation_config, name, value)
        dataset = Dataset.from_list([{"prompt": p.text + "?", "answer": p.reference} for p in pool])

        def reward(prompts, completions, answer, **kwargs):
            return [embedded_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]

        clock = Clock()
        trl_config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=trl_micro_batch,
            gradient_accumulation_steps=config.prompts_per_step * config.samples_per_prompt //
            trl_micro_batch,
            num_generations=config.samples_per_prompt, max_completion_length=config.max_new_tokens,
            temperature=config.temperature, top_k=0, learning_rate=config.lr, beta=0.0,
            max_steps=config.steps, logging_steps=1, report_to="none", use_cpu=True,
            bf16=False,  # TRL's default bf16 autocast would not be the fp32 work ours does
            save_strategy="no", seed=config.seed, disable_tqdm=not progress)
        theirs = GRPOTrainer(model=model, reward_funcs=reward, args=trl_config,
                            train_dataset=dataset, processing_class=_char_tokenizer(),
                            callbacks=[clock])
        start = time.perf_counter()
        theirs.train()
        ends = [start] + clock.ends
        logs = [h for h in theirs.state.log_history if "completions/mean_length" in h]
        trl_seconds = [b - a for a, b in zip(ends, ends[1:])][1:]  # after the untimed first step
        trl_tokens = [h["completions/mean_length"] * config.prompts_per_step *
                      config.samples_per_prompt for h in logs][1:]
    rows = []
    for tlt in (True, False):
        run_inputs = train_inputs(progress=progress)
        driver = RLDriver(run_inputs.policy, pool, run_inputs.reward_fn, run_inputs.detokenize,
                          run_inputs.stop_ids, replace(config, tlt=tlt),
                          drafter=run_inputs.drafter, calibration=run_inputs.calibration)
        history = [driver.step() for _ in range(config.steps)][1:]
        seconds = [m["train/step_s"] for m in history]
        tokens = [sum(m["response_lengths"]) for m in history]
        ours, theirs_rate = sum(tokens) / sum(seconds), sum(trl_tokens) / sum(trl_seconds)
        rows.append({"peer": "trl_grpo",
                     "setting": f"GRPO step, {'TLT' if tlt else 'SD off'}, tokens/s",
                     "ours": ours, "theirs": theirs_rate, "ratio": ours / theirs_rate,
                     "ours_s_per_step": sum(seconds) / len(seconds),
                     "theirs_s_per_step": sum(trl_seconds) / len(trl_seconds),
                     "ours_tokens_per_step": sum(tokens) / len(tokens),
                     "theirs_tokens_per_step": sum(trl_tokens) / len(trl_tokens), "steps": steps})
    return rows


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def format_table(rows: list[dict]) -> str:
    width = max([len("setting")] + [len(r["setting"]) for r in rows]) + 2
    lines = [f"{'peer':<12}{'setting':<{width}}{'ours':>10}{'theirs':>10}{'ratio':>8}"]
    for r in rows:
        lines.append(f"{r['peer']:<12}{r['setting']:<{width}}{r['ours']:>10.0f}"
                     f"{r['theirs']:>10.0f}{r['ratio']:>7.2f}x")
    return "\n".join(lines)
