"""`tlt generate`: text generation with speculative decoding from the command line.

Batch mode takes prompts from `--prompt TEXT` (repeatable) and `--prompts FILE` (JSONL objects
with a "prompt" field, or plain text, one prompt per line) and runs them through one engine call;
interactive mode (stdin a terminal and no prompts given, or `--interactive`) reads prompts line
by line from stdin and answers each as it comes. The model is the pre-trained embedded model
with its drafter by default, or a local Hugging Face checkpoint
(`--model DIR`, its own tokenizer from the folder) with an optional drafter (`--drafter DIR`;
without one decoding is plain).

Speculation is lossless: greedy output is token for token that of plain decoding (`--no-sd`
changes the speed, not the text), and sampled output has the target's distribution. What it
gains is measured, not estimated (after one short uncounted call, see `untimed_first_call`): while
the engine runs, its per-step hook (`observe`) feeds a live line on stderr (tokens emitted so
far, tokens per second, running acceptance length: tokens a row emits per speculative step);
after each engine call a summary line gives the committed tokens, the engine's own wall time and
`RolloutResult.acceptance_length`. Responses print when their engine call returns: the engine
finishes requests as a batch and has no per-token callback.

Output: the responses on stdout (text), or with `--json` one JSON object per response
({"index", "prompt", "response", "token_ids", "finish_reason", "num_tokens"}) followed, per
engine call, by one {"summary": {...}} object; the live line, the summaries, `--stats` and the
interactive prompt go to stderr, as the command's own output; what the model is and a prompt
that could not be encoded are logged (tlt_core.cli.logs).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence, TextIO

from tlt_core.cli.options import add_dataclass_arguments, dataclass_from_args
from tlt_core.config_flags import option
from tlt_core.drafting.export import load_drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.embedded.workload import load_embedded
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.hooks import StepOutcome
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.cli.model_options import (add_placement_arguments, add_prompt_arguments,
                                        placement_from_args)
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.placement import Placement, peak_memory_bytes
from tlt_core.model.prompt_format import load_prompt_format

logger = logging.getLogger(__name__)

LIVE_INTERVAL_S = 0.2  # the live line is redrawn at most this often


@dataclass(frozen=True)
class GenerateConfig:
    """What `tlt generate` samples and how it speculates; checked as SamplingParams and
    Strategy check them."""

    # greedy: reproducible, and SD's output equals plain decoding's
    temperature: float = option("sampling temperature; 0 is greedy", 0.0)
    top_k: int = option("sample among the k most likely tokens only; 0 turns it off", 0)
    top_p: float = option("sample among the most likely tokens whose probabilities sum to p "
                          "(nucleus); 1 turns it off", 1.0)
    max_tokens: int = option("most tokens generated per prompt", 256)
    min_tokens: int = option("fewest tokens generated per prompt: the end of turn cannot be "
                             "sampled before (its probability is 0 there; SD stays lossless)", 0)
    seed: int = option("base of the per-prompt sampling seeds (a prompt's samples do not depend "
                       "on its batch)", 0)
    sd: bool = option("speculative decoding with the drafter (off: plain decoding; the same text,"
                      " slower)", True)
    # (6,1,7): the best fixed strategy of `tlt bench rollout` here
    draft_depth: int = option("draft strategy: drafter levels per speculative step "
                              "(Strategy.depth)", 6)
    draft_topk: int = option("draft strategy: children per expanded node, and nodes expanded per "
                             "level (Strategy.topk; 1 drafts a chain)", 1)
    num_verify_tokens: int = option("draft strategy: tree nodes the target verifies per step, the"
                                    " root included (Strategy.num_verify_tokens; at most the "
                                    "nodes drafted + 1)", 7)
    max_batch: int = option("most prompts decoding at once in batch mode", 16)

    def __post_init__(self):
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                       max_tokens=self.max_tokens, min_tokens=self.min_tokens)
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch: must be an int >= 1, got {self.max_batch!r}")
        if self.sd:
            self.strategy()

    def strategy(self):
        """The draft strategy, its errors named by this config's fields."""
        try:
            return Strategy(self.draft_depth, self.draft_topk, self.num_verify_tokens)
        except ValueError as error:
            name, _, rest = str(error).partition(":")
            renamed = {"depth": "draft_depth", "topk": "draft_topk"}.get(name, name)
            raise ValueError(f"{renamed}:{rest}") from None

    def sampling(self, stop_ids: Sequence[int]) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_tokens=self.max_tokens, stop_ids=tuple(stop_ids),
                              min_tokens=self.min_tokens)


def add_parsers(commands) -> None:
    generate = commands.add_parser(
        "generate", help="text generation with speculative decoding, batch or interactive",
        description="Generates text with speculative decoding (lossless: greedy output equals "
                    "plain decoding's; --no-sd to compare) from the pre-trained embedded model "
                    "and its drafter, or a local checkpoint (--model DIR, --drafter DIR). Batch "
                    "mode: --prompt TEXT (repeatable) and --prompts FILE. Interactive mode "
                    "(stdin a terminal and no prompts, or --interactive): one prompt per line "
                    "of stdin. stderr shows a live line (tokens, tokens/s, acceptance length) "
                    "and a measured summary per engine call.")
    add_arguments(generate)
    generate.set_defaults(runner=run_generate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt; repeatable (batch mode)")
    parser.add_argument("--prompts", type=Path, metavar="FILE",
                        help="prompts, one per line: JSONL (.jsonl: objects with a 'prompt' "
                             "field, or strings) or plain text (any other name; blank lines "
                             "skipped; - reads stdin) (batch mode)")
    parser.add_argument("--interactive", action="store_true",
                        help="read prompts from stdin line by line and answer each (the default "
                             "when stdin is a terminal and no prompts are given)")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="a local Hugging Face checkpoint folder, with its tokenizer "
                             "(tokenizer.json, or files transformers can load) and, for an "
                             "instruct model, its chat template (default: the "
                             "pre-trained embedded model, whose prompts are countdown sums "
                             "such as 37+04)")
    parser.add_argument("--drafter", type=Path, metavar="DIR",
                        help="a drafter for the model: a folder Drafter.save wrote, a `tlt "
                             "export drafter` export, or a published EAGLE-1/2 or EAGLE-3 "
                             "checkpoint (default: "
                             "the embedded drafter with the embedded model; none with --model, "
                             "which then decodes plainly)")
    add_dataclass_arguments(parser, GenerateConfig)
    add_placement_arguments(parser)
    add_prompt_arguments(parser)
    parser.add_argument("--stats", action="store_true",
                        help="also report the process's peak memory (CUDA: peak allocation; "
                             "CPU: peak resident set) and the packed weights' extra copy")
    parser.add_argument("--json", action="store_true",
                        help="JSON lines on stdout: one object per response, then a summary "
                             "object per engine call")
    parser.add_argument("--no-progress", action="store_true",
                        help="no live line on stderr (the summaries stay)")


# ---- model and tokenizer -------------------------------------------------------------------


@dataclass(frozen=True)
class TextModel:
    """A target, its drafter (or None) and the text side of its tokenizer."""

    target: object
    drafter: object | None
    encode: Callable[[str], list[int]]  # a prompt -> the model's input ids
    decode: Callable[[list[int]], str]  # generated ids -> the response text
    stop_ids: tuple[int, ...]
    description: str


def embedded_text_model(drafter_folder: Path | None, want_drafter: bool,
                        placement: Placement) -> TextModel:
    """The pre-trained embedded model with the task's character tokenizer, and (want_drafter)
    the drafter saved in drafter_folder, else the embedded drafter."""
    workload = load_embedded(with_drafter=want_drafter and drafter_folder is None)
    to = dict(device=placement.device, dtype=placement.dtype)
    target, drafter = workload.target.to(**to).eval(), workload.drafter
    if drafter is not None:
        drafter = drafter.to(**to).eval()
    elif want_drafter:
        drafter = load_drafter(drafter_folder, target).eval()
    tokenizer = workload.tokenizer
    return TextModel(target, drafter, tokenizer.prompt_ids, tokenizer.decode_response,
                     (tokenizer.eos_id,), "the pre-trained embedded model")


def checkpoint_text_model(folder: Path, drafter_folder: Path | None, want_drafter: bool,
                          placement: Placement, chat_template: str = "auto",
                          system_prompt: str | None = None) -> TextModel:
    """A local checkpoint, its tokenizer and prompt format, and the drafter saved in
    drafter_folder (if any)."""
    prompt_format = load_prompt_format(folder, chat_template, system_prompt)
    target = load_checkpoint(folder, dtype=placement.dtype, device=placement.device)
    drafter = (load_drafter(drafter_folder, target).eval()
               if want_drafter and drafter_folder is not None else None)
    tokenizer = prompt_format.tokenizer
    return TextModel(target, drafter, prompt_format.encode, tokenizer.decode,
                     tuple(tokenizer.eos_ids), f"{folder} ({prompt_format.describe()})")


# ---- prompts -----------------------------------------------------------------------------


def read_prompts(path: Path, stdin: TextIO) -> list[str]:
    """The prompts of a --prompts file (see the flag's help)."""
    if str(path) == "-":
        return [line.rstrip("\n") for line in stdin if line.strip()]
    if not path.is_file():
        raise SystemExit(f"tlt generate: --prompts {path}: no such file")
    lines = path.read_text().splitlines()
    if path.suffix.lower() != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise SystemExit(f"tlt generate: {path}: line {number} is not JSON ({error})") from None
        if isinstance(row, dict):
            row = row.get("prompt")
        if not isinstance(row, str):
            raise SystemExit(f"tlt generate: {path}: line {number} has no 'prompt' string")
        prompts.append(row)
    return prompts


# ---- generation ----------------------------------------------------------------------------


class StepMeter:
    """A PlanPolicy for one generate call: the same plan every step (or None: plain decoding),
    and, told every StepOutcome, a measure of every step that drives the live line."""

    def __init__(self, plan: Strategy | None, live: TextIO | None):
        self.plan, self.live = plan, live
        self.start = time.perf_counter()
        self.emitted = self.spec_rows = self.spec_emitted = 0
        self._drawn = 0.0

    def start_call(self) -> None:
        pass  # one display across calls

    def choose(self, batch: int, context: int) -> Strategy | None:
        return self.plan

    def observe(self, outcome: StepOutcome) -> None:
        self.emitted += outcome.emitted
        if outcome.plan is not None:
            self.spec_rows += outcome.batch
            self.spec_emitted += outcome.emitted
        now = time.perf_counter()
        if self.live is not None and now - self._drawn >= LIVE_INTERVAL_S:
            self._drawn = now
            acceptance = (f"{self.spec_emitted / self.spec_rows:.2f}" if self.spec_rows
                          else "-")
            self.live.write(f"\r{self.emitted} tokens  {self.emitted / (now - self.start):.0f} "
                            f"tok/s  acceptance {acceptance}  running {outcome.batch}   ")
            self.live.flush()

    def clear(self) -> None:
        if self.live is not None and self._drawn:
            self.live.write("\r" + " " * 72 + "\r")
            self.live.flush()


def generate(model: TextModel, prompts: Sequence[str], config: GenerateConfig, *,
             first_index: int = 0, live: TextIO | None = None) -> tuple[list[dict], dict]:
    """One engine call over prompts: (a record per response, the call's summary)."""
    ids = []
    for offset, prompt in enumerate(prompts):
        try:
            ids.append(model.encode(prompt))
        except (ValueError, TypeError) as error:
            raise ValueError(f"prompt {first_index + offset}: {error}") from None
        if not ids[-1]:
            raise ValueError(f"prompt {first_index + offset}: encodes to no tokens")
    drafting = config.sd and model.drafter is not None
    plan = config.strategy() if drafting else None
    reserve = max(64, plan.num_verify_tokens, plan.fed_nodes) if plan is not None else 64
    engine = RolloutEngine(model.target, EngineConfig(
        max_batch=min(config.max_batch, len(prompts)),
        max_len=max(map(len, ids)) + config.max_tokens, seed=config.seed, spec_reserve=reserve,
        draft_backlog=max(128, reserve)), model.drafter if drafting else None)
    meter = StepMeter(plan, live)
    params = config.sampling(model.stop_ids)
    try:
        result = engine.generate([Request(i, params) for i in ids], meter,
                                 request_ids=range(first_index, first_index + len(prompts)))
    finally:
        meter.clear()
    records = []
    for rollout in result.rollouts:
        tokens = rollout.tokens.tolist()
        # request_ids made request_index the prompt's index among all prompts of the run
        records.append({"index": rollout.request_index,
                        "prompt": prompts[rollout.request_index - first_index],
                        "response": model.decode(tokens), "token_ids": tokens,
                        "finish_reason": rollout.finish_reason, "num_tokens": len(tokens)})
    total_tokens = sum(r["num_tokens"] for r in records)
    summary = {"requests": len(records), "tokens": total_tokens, "seconds": result.total_s,
               "tokens_per_s": total_tokens / result.total_s if result.total_s > 0 else None,
               "decode_steps": result.decode_steps,
               "speculative_steps": len(result.spec_steps),
               "acceptance_length": result.acceptance_length,
               "strategy": plan.key if plan is not None else None}
    return records, summary


def untimed_first_call(model: TextModel, prompt: str, config: GenerateConfig) -> None:
    """One short call that is not reported: the first call into a fresh process pays one-time
    costs (thread pools, the model's packed weights, allocator growth) that would otherwise
    dominate the first measurement (once on a shared 2-core machine: 3.3 s, against 0.37 s for
    the same 35 tokens in the calls after it)."""
    short = min(8, config.max_tokens)
    generate(model, [prompt], replace(config, max_tokens=short,
                                      min_tokens=min(short, config.min_tokens)))


def summary_line(summary: dict) -> str:
    speed = (f"{summary['tokens_per_s']:.0f} tok/s" if summary["tokens_per_s"] is not None
             else "- tok/s")
    line = (f"{summary['requests']} prompt(s), {summary['tokens']} tokens in "
            f"{summary['seconds']:.2f} s ({speed}), {summary['decode_steps']} decode steps")
    if summary["strategy"] is None:
        return line + ", SD off"
    acceptance = summary["acceptance_length"]
    return (line + f", {summary['speculative_steps']} speculative with {summary['strategy']}, "
            f"acceptance length {'-' if acceptance is None else f'{acceptance:.2f}'}")


def run_generate(args: argparse.Namespace, stdin: TextIO | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    config = dataclass_from_args(GenerateConfig, args, "tlt generate")
    batch = list(args.prompt or [])
    if args.prompts is not None:
        batch += read_prompts(args.prompts, stdin)
    given = args.prompt is not None or args.prompts is not None
    if given and args.interactive:
        raise SystemExit("tlt generate: --interactive reads prompts from stdin; give it or "
                         "--prompt / --prompts, not both")
    if given and not batch:
        raise SystemExit("tlt generate: no prompts in the input (empty --prompts file?)")
    interactive = args.interactive or (not given and stdin.isatty())
    if not given and not interactive:
        raise SystemExit("tlt generate: no prompts: give --prompt TEXT, --prompts FILE, or "
                         "--interactive (stdin is not a terminal)")
    placement = placement_from_args(args, "tlt generate", embedded=args.model is None)
    try:
        if args.model is None:
            model = embedded_text_model(args.drafter, config.sd, placement)
        else:
            model = checkpoint_text_model(args.model, args.drafter, config.sd, placement,
                                          args.chat_template, args.system_prompt)
    except (FileNotFoundError, ImportError, ValueError) as error:  # they name the file
        raise SystemExit(f"tlt generate: {error}") from None
    if args.model is not None:
        logger.info("tlt generate: %s", model.description)
    if args.model is not None and config.sd and args.drafter is None:
        logger.info("tlt generate: no --drafter for --model: plain decoding")
    live = stderr if not args.no_progress and stderr.isatty() else None
    if not interactive:
        try:
            untimed_first_call(model, batch[0], config)
            records, summary = generate(model, batch, config, live=live)
        except ValueError as error:
            raise SystemExit(f"tlt generate: {error}") from None
        _emit(records, summary, args.json, stdout, stderr, headers=len(batch) > 1)
        if args.stats:
            _print_stats(model, placement, stderr)
        return 0
    return _interactive(model, config, args.json, stdin, stdout, stderr, live)


def _print_stats(model: TextModel, placement: Placement, stderr: TextIO) -> None:
    peak = peak_memory_bytes(placement.device)
    kind = "peak CUDA allocation" if placement.device.type == "cuda" else "peak resident set"
    extra = model.target.inference_copy_bytes()
    print(f"stats: {kind} {peak / 2**20:.0f} MiB; packed weights' extra copy "
          f"{extra / 2**20:.0f} MiB ({model.target.inference_layout_in_use} layout)", file=stderr)


def _interactive(model: TextModel, config: GenerateConfig, as_json: bool, stdin: TextIO,
                 stdout: TextIO, stderr: TextIO, live: TextIO | None) -> int:
    terminal = stdin.isatty()
    if terminal:
        print(f"{model.description}; one prompt per line, Ctrl-D to end", file=stderr)
    index = 0
    try:
        while True:
            if terminal:
                stderr.write("> ")
                stderr.flush()
            line = stdin.readline()
            if not line:
                break
            prompt = line.rstrip("\n")
            if not prompt.strip():
                continue
            try:
                if not index:
                    untimed_first_call(model, prompt, config)
                records, summary = generate(model, [prompt], config, first_index=index,
                                            live=live)
            except ValueError as error:  # a prompt the tokenizer cannot encode: say, go on
                logger.error("tlt generate: %s", error)
                continue
            index += 1
            _emit(records, summary, as_json, stdout, stderr, headers=False)
    except KeyboardInterrupt:
        print(file=stderr)
    return 0


def _emit(records: list[dict], summary: dict, as_json: bool, stdout: TextIO, stderr: TextIO,
          headers: bool) -> None:
    for record in records:
        if as_json:
            stdout.write(json.dumps(record) + "\n")
        else:
            if headers:
                first_line = record["prompt"].splitlines()[0] if record["prompt"] else ""
                stdout.write(f"--- {record['index']}: {first_line}\n")
            stdout.write(record["response"] + "\n")
    if as_json:
        stdout.write(json.dumps({"summary": summary}) + "\n")
    stdout.flush()
    print(summary_line(summary), file=stderr)
