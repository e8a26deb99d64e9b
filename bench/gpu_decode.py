"""Decoding at real model sizes on one device: our engine, eager and with CUDA graphs, against
transformers' `generate` on the same random weights, the memory-bandwidth roofline, host syncs
and kernel launches per step, peak memory, and speculative chains' break-even acceptance.

    python bench/gpu_decode.py --device cuda --json OUT/decode_cuda.json
    python bench/gpu_decode.py --device cpu --json decode_cpu.json      # tiny shape, seconds

Nothing is downloaded (the GPU machine has no network): each shape is a real architecture's
config kept in this script (Qwen2.5-7B and -1.5B; `tiny` is a 2-layer qwen2 for CI), built as
tlt_core's Transformer directly on the device in bf16 (float32 on the CPU) and filled with
normal(0, --std) weights, norms at one; transformers' Qwen2ForCausalLM is built from the same
config and given the same tensors' values (its logits are checked against ours). Random weights
decode like trained ones (same matmuls, same bytes read); only acceptance means nothing.

Per shape (the 7B shape runs first: it is the one the targets are about). Our engine's plain
decoding runs first, before transformers' model is built, so its memory is ours alone; then
transformers' rows, the speculative chains, and last the optional compiled row:
1. Plain decode steps at each --batches B, prompts of --context random tokens, greedy,
   exactly --new-tokens M tokens per row (no stop ids; transformers with min_new_tokens =
   max_new_tokens). A path's step time is the median over --repeats of (t(M) - t(1)) / (M - 1),
   each t one whole call timed with CUDA events (prefill and set-up cancel out), after an
   untimed warm-up call. Paths: `ours_eager` (EngineConfig(graphs=False)), `ours_graphs`
   (graphs=True: captured on CUDA, the static path run eagerly on the CPU), `hf_dynamic`
   (transformers' default cache), `hf_static` (cache_implementation="static", compile
   disabled) and `hf_static_compiled` (static cache as transformers runs it on CUDA by default:
   torch.compile'd; B = 1 only, and only when --hf-compile allows, since compiling a 7B model
   takes about a minute). Our rows also give the engine's own step clock (`engine_step_s`,
   median of StepOutcome.seconds).
2. The roofline: a decode step reads every weight once (tlt_core.bench.engine.
   weights_read_per_step) plus the K/V of B rows at the mean context; steps/s = bandwidth /
   those bytes, with the GPU's HBM bandwidth from HBM_BANDWIDTH by device name (--bandwidth
   overrides; none on the CPU unless given). Each row's `roofline_fraction` = its steps/s over
   the roofline's.
3. Calls per decode step at B = 1, from torch.profiler: profiles of a call of 1 + P tokens and
   of 1 token, differenced and divided by P (--profile-steps): host syncs (cuda*Synchronize),
   device-to-host copies, kernel launches (cudaLaunchKernel and friends), graph launches
   (cudaGraphLaunch), kernels run on the device, and top-level aten ops dispatched.
4. Peak memory (max_memory_allocated on CUDA, the process's peak RSS on the CPU) over a
   1-token call (prefill) and over the decode steps of an M-token call (the peak is reset
   once the first step has reported, through a step observer or a stopping criterion), next
   to what was allocated before the call (weights and caches). With graphs: the engine's
   graph_memory() with the shared pool and with one pool per graph, at every B.
5. Speculative chains at --spec-batches B with a random drafter (tlt_core.drafting.Drafter,
   one EAGLE layer): Strategy(D, 1, D + 1) for D in --depths, on each engine path. draft_s,
   verify_s and accept_s are the medians of the engine's SpecStepStats; the plain step is
   the same engine's median StepOutcome.seconds; break-even acceptance = (draft + verify +
   accept) / plain step: the tokens a row must emit per speculative step for SD to pay.

`targets` compares the measurements with the project's goals (binding on the 7B shape on a
GPU; computed for every shape): ours_graphs >= 0.9x hf_static_compiled (else hf_static) at
B = 1 and >= 1.5x hf_dynamic at B = 64; our faster path >= 70% of the roofline at B = 1;
ours_graphs >= 1.5x ours_eager at B = 1; break-even acceptance <= 1.5 at B = 1.

The JSON (--json) is rewritten after every measurement (`complete` false and `in_progress`
naming the measurement until the end), so a run cut short keeps what it measured. A failure of
one measurement is recorded in its row (`status` "error", `detail`) and the rest still run;
the exit status is 1 if any of our engine's measurements failed. --budget-s bounds the
optional parts: later shapes and the compiled transformers row run only while the budget
leaves room, and what was left out is listed in `skipped` with the reason.

Shapes: B rows, M new tokens per row, P profiled steps, D draft depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tlt_core.bench.engine import weights_read_per_step
from tlt_core.drafting import Drafter, DrafterConfig, Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams, StepOutcome
from tlt_core.model.placement import peak_memory_bytes, reset_peak_memory
from tlt_core.model.transformer import ModelConfig, Transformer

QWEN2 = dict(family="qwen2", attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6,
             head_dim=128, max_position_embeddings=32768)
SHAPES = {
    "7b": ModelConfig(**QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_layers=28, num_heads=28, num_kv_heads=4),
    "1.5b": ModelConfig(**QWEN2, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                        num_layers=28, num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    "tiny": ModelConfig(**{**QWEN2, "head_dim": 16, "max_position_embeddings": 4096},
                        vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2),
}
# HBM bandwidth in bytes/s by a substring of torch.cuda.get_device_name (first match wins)
HBM_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                 ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12), ("L40S", 0.864e12))
COMPILE_NEED_S = 100.0  # budget left for --hf-compile auto to try compiling transformers
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")
GRAPH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
RANDOM_WEIGHTS_NOTE = ("random weights: acceptance lengths mean nothing (a random drafter "
                       "rarely agrees with a random target); the step costs and break-even "
                       "acceptance are what this measures")


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    context: int  # prompt tokens per row: the cache's context when decoding starts
    new_tokens: int  # M
    repeats: int
    spec_batches: tuple[int, ...]
    depths: tuple[int, ...]
    profile_steps: int  # P


GPU_SIZES = Sizes((1, 16, 64), 512, 32, 3, (1, 8), (3, 5), 4)
CPU_SIZES = Sizes((1, 4), 32, 6, 2, (1, 4), (3, 5), 2)


@dataclass
class DecodeRow:
    path: str  # ours_eager | ours_graphs | hf_dynamic | hf_static | hf_static_compiled
    batch: int
    status: str = "ok"  # "ok" | "error" | "unavailable" | "skipped"
    detail: str | None = None  # the error, or why unavailable / skipped
    step_s: float | None = None  # median (t(M) - t(1)) / (M - 1)
    tokens_per_s: float | None = None  # B / step_s
    roofline_fraction: float | None = None
    engine_step_s: float | None = None  # ours: median StepOutcome.seconds
    baseline_bytes: int | None = None  # allocated before the memory calls
    prefill_peak_bytes: int | None = None
    decode_peak_bytes: int | None = None


@dataclass
class SpecRow:
    path: str  # "ours_eager" | "ours_graphs"
    batch: int
    strategy: str  # Strategy.key, e.g. "(3,1,4)"
    status: str = "ok"
    detail: str | None = None
    plain_step_s: float | None = None
    spec_step_s: float | None = None  # median StepOutcome.seconds of the speculative steps
    draft_s: float | None = None
    verify_s: float | None = None
    accept_s: float | None = None
    break_even_acceptance: float | None = None  # (draft + verify + accept) / plain step
    acceptance_length: float | None = None  # meaningless on random weights
    spec_steps: int = 0


@dataclass
class Calls:
    """Per decode step, from torch.profiler (see the module docstring, part 3)."""

    path: str
    batch: int
    host_syncs: float
    dtoh_copies: float
    kernel_launches: float
    graph_launches: float
    device_kernels: float
    aten_ops: float
    runtime_calls: dict[str, float] = field(default_factory=dict)  # every cuda* call by name


class Budget:
    def __init__(self, seconds: float | None):
        self.start, self.seconds = time.monotonic(), seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()


class Report:
    """The JSON, rewritten after every measurement."""

    def __init__(self, path: Path | None, data: dict):
        self.path, self.data = path, data

    def start(self, what: str, budget: Budget) -> None:
        self.data["in_progress"] = what
        print(f"[{budget.elapsed():6.1f}s] {what}", flush=True)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".partial")
        staging.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
        staging.replace(self.path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # A CPU run is CI's smoke test of the tiny shape, which gains nothing from intra-op
        # threads; on a busy 2-core machine OpenMP's waiting threads cost a scheduler slice per
        # op (steps measured 30x slower), so one thread keeps the run to seconds.
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = resolve_sizes(args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth, source = resolve_bandwidth(args.bandwidth, name)
    api = graphs_api()
    import transformers

    report = Report(args.json, {
        "script": "bench/gpu_decode.py", "argv": sys.argv[1:] if argv is None else argv,
        "complete": False, "in_progress": None,
        "device": {"type": device.type, "name": name, "dtype": str(dtype).removeprefix("torch."),
                   "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": source,
                   "cpu_threads": torch.get_num_threads()},
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "transformers": transformers.__version__},
        "sizes": asdict(sizes), "engine_graphs_api": api, "notes": [RANDOM_WEIGHTS_NOTE],
        "shapes": {}, "skipped": []})
    budget = Budget(args.budget_s)
    failed = False
    previous_s = None
    for index, shape in enumerate(args.shape):
        if index and previous_s is not None and budget.left() < 0.75 * previous_s:
            report.data["skipped"].append(
                f"shape {shape}: {budget.left():.0f} s of the budget left, the previous shape "
                f"took {previous_s:.0f} s")
            print(f"skipping shape {shape}: {report.data['skipped'][-1]}")
            continue
        started = budget.elapsed()
        failed |= run_shape(shape, device, dtype, sizes, bandwidth, api, args, budget, report,
                            compile_allowed=index == 0)
        previous_s = budget.elapsed() - started
    report.data.update(complete=True, in_progress=None, seconds=round(budget.elapsed(), 1))
    report.save()
    for shape, result in report.data["shapes"].items():
        print(format_tables(shape, result, report.data["device"], sizes))
    for line in report.data["skipped"]:
        print(f"skipped: {line}")
    return 1 if failed else 0


def run_shape(shape: str, device: torch.device, dtype: torch.dtype, sizes: Sizes,
              bandwidth: float | None, api: dict, args, budget: Budget, report: Report,
              compile_allowed: bool) -> bool:
    """Every measurement of one shape into report.data["shapes"][shape]; True if one of our
    engine's failed."""
    started = budget.elapsed()
    config = SHAPES[shape]
    report.start(f"{shape}: building the model on {device}", budget)
    model = build_model(config, device, dtype, args.seed, args.std)
    weight_bytes, _ = weights_read_per_step(model)
    result = {"config": asdict(config),
              "parameters": sum(p.numel() for p in _unique_parameters(model)),
              "weight_bytes_per_step": weight_bytes,
              "roofline": [roofline(config, batch, sizes, weight_bytes, dtype, bandwidth)
                           for batch in sizes.batches],
              "decode": [], "calls_per_step": [], "graph_memory": None, "speculative": [],
              "targets": []}
    report.data["shapes"][shape] = result
    prompts = random_prompts(config.vocab_size, max(sizes.batches + sizes.spec_batches),
                             sizes.context, args.seed)
    run_our_decoding(shape, model, prompts, sizes, api, device, result, budget, report)
    hf = run_transformers(shape, model, prompts, sizes, device, result, budget, report)
    run_speculative(shape, model, prompts, sizes, api, device, result, args, budget, report)
    run_compiled_transformers(shape, hf, prompts, sizes, device, result, args, budget, report,
                              compile_allowed)
    del hf
    result["targets"] = targets(shape, device, result)
    result["seconds"] = round(budget.elapsed() - started, 1)
    report.save()
    del model
    _free(device)
    ours = [r for r in result["decode"] + result["speculative"] if r.path.startswith("ours")]
    return any(r.status == "error" for r in ours)


def run_our_decoding(shape: str, model: Transformer, prompts: torch.Tensor, sizes: Sizes,
                     api: dict, device: torch.device, result: dict, budget: Budget,
                     report: Report) -> None:
    """Plain decoding on our engine, eager and with graphs: step times, calls per step,
    memory, and the graph pool's memory."""
    for mode in ("ours_eager", "ours_graphs"):
        for batch in sizes.batches:
            report.start(f"{shape}: {mode} B={batch}", budget)
            row = measure_ours(model, mode, batch, prompts, sizes, api, device)
            result["decode"].append(_with_roofline(row, result["roofline"]))
            _print_row(shape, row)
        if mode == "ours_graphs" and not api["graphs"]:
            result["calls_per_step"].append({"path": mode, "batch": 1, "status": "unavailable",
                                             "detail": api["detail"]})
            continue
        report.start(f"{shape}: {mode} calls per step", budget)
        result["calls_per_step"].append(profile_ours(model, mode, prompts, sizes, api, device))
    if api["graphs"]:
        report.start(f"{shape}: graph memory, shared pool and one pool per graph", budget)
        result["graph_memory"] = graph_memory(model, prompts, sizes, api, device)
    else:
        result["graph_memory"] = {"status": "unavailable", "detail": api["detail"]}


def run_speculative(shape: str, model: Transformer, prompts: torch.Tensor, sizes: Sizes,
                    api: dict, device: torch.device, result: dict, args, budget: Budget,
                    report: Report) -> None:
    report.start(f"{shape}: speculative chains with a random drafter", budget)
    try:
        drafter = build_drafter(model, device, args.seed, args.std)
    except Exception as error:
        for mode in ("ours_eager", "ours_graphs"):
            for batch in sizes.spec_batches:
                for depth in sizes.depths:
                    result["speculative"].append(SpecRow(
                        mode, batch, Strategy(depth, 1, depth + 1).key, status="error",
                        detail=f"building the drafter: {_describe(error)}"))
        return
    for mode in ("ours_eager", "ours_graphs"):
        for batch in sizes.spec_batches:
            report.start(f"{shape}: {mode} speculative chains B={batch}", budget)
            result["speculative"] += measure_speculative(model, drafter, mode, batch, prompts,
                                                         sizes, api)
    del drafter
    _free(device)


def run_transformers(shape: str, model: Transformer, prompts: torch.Tensor, sizes: Sizes,
                     device: torch.device, result: dict, budget: Budget,
                     report: Report) -> torch.nn.Module | None:
    """transformers' generate on the same weights, dynamic and static cache; returns its model
    (None if it could not be built: the rows say why)."""
    variants = ("hf_dynamic", "hf_static")
    report.start(f"{shape}: transformers' model from the same weights", budget)
    try:
        hf = build_hf(model)
        result["hf_logits_check"] = compare_logits(model, hf, prompts, device)
    except Exception as error:
        detail = f"building transformers' model: {_describe(error)}"
        result["hf_logits_check"] = {"status": "error", "detail": detail}
        result["decode"] += [DecodeRow(variant, batch, status="error", detail=detail)
                             for variant in variants for batch in sizes.batches]
        return None
    for variant in variants:
        for batch in sizes.batches:
            report.start(f"{shape}: {variant} B={batch}", budget)
            row = measure_hf(hf, variant, batch, prompts, sizes, device)
            result["decode"].append(_with_roofline(row, result["roofline"]))
            _print_row(shape, row)
        report.start(f"{shape}: {variant} calls per step", budget)
        result["calls_per_step"].append(profile_hf(hf, variant, prompts, sizes, device))
    return hf


def run_compiled_transformers(shape: str, hf: torch.nn.Module | None, prompts: torch.Tensor,
                              sizes: Sizes, device: torch.device, result: dict, args,
                              budget: Budget, report: Report, compile_allowed: bool) -> None:
    """The optional compiled static-cache row, last: compiling takes about a minute."""
    row = DecodeRow("hf_static_compiled", 1)
    why_not = ("transformers' model could not be built" if hf is None else
               compile_skip_reason(args.hf_compile, device, budget, compile_allowed))
    if why_not is None:
        report.start(f"{shape}: hf_static_compiled B=1 (torch.compile)", budget)
        row = measure_hf(hf, "hf_static_compiled", 1, prompts, sizes, device)
    else:
        row.status, row.detail = "skipped", why_not
        report.data["skipped"].append(f"shape {shape}: hf_static_compiled: {why_not}")
    result["decode"].append(_with_roofline(row, result["roofline"]))
    _print_row(shape, row)


# ---- models ------------------------------------------------------------------------------------

def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int,
                std: float) -> Transformer:
    """Our Transformer with random weights, allocated on `device` in `dtype` (built on the meta
    device first: no host copy, no default initialisation of 7B parameters)."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype=dtype).to_empty(device=device)  # rotary frequencies recomputed there
    model.tie_weights()
    init_random_(model, seed, std)
    if device.type != "cpu":  # as load_checkpoint places a model on a GPU: views, no copy
        model.fuse_projections_()
    return model.eval().requires_grad_(False)


def build_drafter(model: Transformer, device: torch.device, seed: int, std: float) -> Drafter:
    with torch.device(device):
        drafter = Drafter(model, DrafterConfig())
    init_random_(drafter, seed + 1, std)
    return drafter.eval().requires_grad_(False)


def init_random_(module: torch.nn.Module, seed: int, std: float) -> None:
    """normal(0, std) weights and biases, norms at one: logits stay finite through 28 layers."""
    generator = None
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if generator is None:
                generator = torch.Generator(parameter.device).manual_seed(seed)
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, std, generator=generator)


def build_hf(model: Transformer) -> torch.nn.Module:
    """transformers' Qwen2ForCausalLM from our config, holding copies of our tensors (parameter
    names are the same)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    weight = model.lm_head.weight
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(weight.dtype)
    try:
        with torch.device(weight.device):
            hf = Qwen2ForCausalLM(Qwen2Config(**model.config.to_hf_config()))
    finally:
        torch.set_default_dtype(default_dtype)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval().requires_grad_(False)


def compare_logits(model: Transformer, hf: torch.nn.Module, prompts: torch.Tensor,
                   device: torch.device) -> dict:
    """Both models' logits on one prompt of up to 64 tokens: the weights are the same."""
    ids = prompts[:1, :64].to(device)  # (1, T)
    positions = torch.arange(ids.shape[1], device=device)[None]  # (1, T)
    with torch.inference_mode():
        ours = model(ids, positions).logits  # (1, T, V)
        theirs = hf(ids).logits.float()  # (1, T, V)
    return {"tokens": ids.shape[1],
            "max_abs_diff": float((ours - theirs).abs().max()),
            "max_abs_logit": float(ours.abs().max()),
            "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}


def random_prompts(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g)  # (B, T) on the host


# ---- our engine --------------------------------------------------------------------------------

def graphs_api() -> dict:
    """Which of the engine's CUDA-graph options this checkout has."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    api = {"graphs": "graphs" in fields, "graph_pool": "graph_pool" in fields,
           "graph_memory": hasattr(RolloutEngine, "graph_memory")}
    api["detail"] = None if api["graphs"] else (
        "EngineConfig has no `graphs` field in this checkout")
    return api


def engine_config(mode: str, batch: int, sizes: Sizes, api: dict,
                  graph_pool: str | None = None) -> EngineConfig:
    options = {}
    if api["graphs"]:
        options["graphs"] = mode == "ours_graphs"
    if graph_pool is not None:
        options["graph_pool"] = graph_pool
    return EngineConfig(max_batch=batch, max_len=sizes.context + sizes.new_tokens, **options)


def requests_for(prompts: torch.Tensor, batch: int, max_tokens: int) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [Request(tuple(row.tolist()), params) for row in prompts[:batch]]


def measure_ours(model: Transformer, mode: str, batch: int, prompts: torch.Tensor, sizes: Sizes,
                 api: dict, device: torch.device) -> DecodeRow:
    row = DecodeRow(mode, batch)
    if mode == "ours_graphs" and not api["graphs"]:
        row.status, row.detail = "unavailable", api["detail"]
        return row
    engine = None
    try:
        engine = RolloutEngine(model, engine_config(mode, batch, sizes, api))
        long = requests_for(prompts, batch, sizes.new_tokens)
        short = requests_for(prompts, batch, 1)
        steps: list[StepOutcome] = []
        engine.generate(long)  # untimed: packing, first kernels, graph capture
        row.step_s = step_seconds(lambda: engine.generate(long, observe=steps.append),
                                  lambda: engine.generate(short), sizes, device)
        row.engine_step_s = statistics.median(s.seconds for s in steps)
        memory = peak_memory(lambda observe: engine.generate(short, observe=observe),
                             lambda observe: engine.generate(long, observe=observe), device)
        row.baseline_bytes, row.prefill_peak_bytes, row.decode_peak_bytes = memory
        row.tokens_per_s = batch / row.step_s
    except Exception as error:  # recorded in the row; the other measurements still run
        row.status, row.detail = "error", _describe(error)
    del engine
    _free(device)
    return row


def profile_ours(model: Transformer, mode: str, prompts: torch.Tensor, sizes: Sizes, api: dict,
                 device: torch.device) -> Calls | dict:
    engine = None
    try:
        engine = RolloutEngine(model, engine_config(mode, 1, sizes, api))
        steps = sizes.profile_steps
        long, short = (requests_for(prompts, 1, 1 + steps), requests_for(prompts, 1, 1))
        engine.generate(long)  # untimed warm-up
        calls = calls_per_step(mode, 1, lambda: engine.generate(long),
                               lambda: engine.generate(short), steps, device)
    except Exception as error:
        calls = {"path": mode, "batch": 1, "status": "error", "detail": _describe(error)}
    del engine
    _free(device)
    return calls


def graph_memory(model: Transformer, prompts: torch.Tensor, sizes: Sizes, api: dict,
                 device: torch.device) -> dict:
    """RolloutEngine.graph_memory() after decoding at every B, with the shared pool and with
    one pool per graph (one engine sized for the largest B: its graphs cover every bucket)."""
    if not (api["graph_pool"] and api["graph_memory"]):
        return {"status": "unavailable",
                "detail": "EngineConfig.graph_pool or RolloutEngine.graph_memory is missing"}
    out = {"status": "ok", "batches": list(sizes.batches)}
    for pool in ("shared", "per_graph"):
        engine = None
        try:
            engine = RolloutEngine(model, engine_config("ours_graphs", max(sizes.batches), sizes,
                                                        api, graph_pool=pool))
            for batch in sizes.batches:
                engine.generate(requests_for(prompts, batch, 4))
            out[pool] = _string_keys(engine.graph_memory())
        except Exception as error:
            out[pool] = {"status": "error", "detail": _describe(error)}
            out["status"] = "error"
        del engine
        _free(device)
    return out


def measure_speculative(model: Transformer, drafter: Drafter, mode: str, batch: int,
                        prompts: torch.Tensor, sizes: Sizes, api: dict) -> list[SpecRow]:
    """One row per depth: the speculative step's phases against the same engine's plain step."""
    strategies = [Strategy(depth, 1, depth + 1) for depth in sizes.depths]
    rows = [SpecRow(mode, batch, s.key) for s in strategies]
    if mode == "ours_graphs" and not api["graphs"]:
        for row in rows:
            row.status, row.detail = "unavailable", api["detail"]
        return rows
    device = model.lm_head.weight.device
    engine = None
    try:
        engine = RolloutEngine(model, engine_config(mode, batch, sizes, api), drafter)
        requests = requests_for(prompts, batch, sizes.new_tokens)
        for strategy in (None, *strategies):  # untimed warm-up of every path
            engine.generate(requests, strategy)
        plain: list[StepOutcome] = []
        engine.generate(requests, observe=plain.append)
        plain_s = statistics.median(s.seconds for s in plain)
        for row, strategy in zip(rows, strategies):
            try:
                outcomes: list[StepOutcome] = []
                result = engine.generate(requests, strategy, observe=outcomes.append)
                stats = result.spec_steps
                row.plain_step_s = plain_s
                row.spec_step_s = statistics.median(s.seconds for s in outcomes
                                                    if s.plan is not None)
                row.draft_s = statistics.median(s.draft_s for s in stats)
                row.verify_s = statistics.median(s.verify_s for s in stats)
                row.accept_s = statistics.median(s.accept_s for s in stats)
                row.break_even_acceptance = (row.draft_s + row.verify_s + row.accept_s) / plain_s
                row.acceptance_length = result.acceptance_length
                row.spec_steps = len(stats)
            except Exception as error:
                row.status, row.detail = "error", _describe(error)
    except Exception as error:
        for row in rows:
            row.status, row.detail = "error", _describe(error)
    del engine
    _free(device)
    return rows


# ---- transformers ------------------------------------------------------------------------------

def hf_generate(hf: torch.nn.Module, variant: str, ids: torch.Tensor, new_tokens: int,
                stopping: list | None = None):
    from transformers import StoppingCriteriaList

    options = {"hf_dynamic": {},
               "hf_static": {"cache_implementation": "static", "disable_compile": True},
               "hf_static_compiled": {"cache_implementation": "static",
                                      "disable_compile": False}}[variant]
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       stopping_criteria=StoppingCriteriaList(stopping or []), **options)


def measure_hf(hf: torch.nn.Module, variant: str, batch: int, prompts: torch.Tensor,
               sizes: Sizes, device: torch.device) -> DecodeRow:
    row = DecodeRow(variant, batch)
    ids = prompts[:batch].to(device)
    try:
        out = hf_generate(hf, variant, ids, sizes.new_tokens)  # untimed warm-up (compiles)
        if out.shape[1] != ids.shape[1] + sizes.new_tokens:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, "
                               f"expected {sizes.new_tokens}")
        row.step_s = step_seconds(lambda: hf_generate(hf, variant, ids, sizes.new_tokens),
                                  lambda: hf_generate(hf, variant, ids, 1), sizes, device)
        memory = peak_memory(
            lambda observe: hf_generate(hf, variant, ids, 1, [_ObservingCriterion(observe)]),
            lambda observe: hf_generate(hf, variant, ids, sizes.new_tokens,
                                        [_ObservingCriterion(observe)]), device)
        row.baseline_bytes, row.prefill_peak_bytes, row.decode_peak_bytes = memory
        row.tokens_per_s = batch / row.step_s
    except Exception as error:  # transformers' failure is a finding, not the end of the run
        row.status, row.detail = "error", _describe(error)
    _free(device)
    return row


def profile_hf(hf: torch.nn.Module, variant: str, prompts: torch.Tensor, sizes: Sizes,
               device: torch.device) -> Calls | dict:
    ids = prompts[:1].to(device)
    steps = sizes.profile_steps
    try:
        hf_generate(hf, variant, ids, 1 + steps)  # untimed warm-up
        return calls_per_step(variant, 1, lambda: hf_generate(hf, variant, ids, 1 + steps),
                              lambda: hf_generate(hf, variant, ids, 1), steps, device)
    except Exception as error:
        return {"path": variant, "batch": 1, "status": "error", "detail": _describe(error)}


class _ObservingCriterion:
    """A stopping criterion that never stops and tells `observe` after every token (the first
    one right after prefill), as the engine's step observer does."""

    def __init__(self, observe: Callable[[Any], None]):
        self.observe = observe

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.observe(None)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def compile_skip_reason(choice: str, device: torch.device, budget: Budget,
                        first_shape: bool) -> str | None:
    if choice == "off":
        return "--hf-compile off"
    if device.type != "cuda":
        return "transformers compiles static-cache decoding on CUDA only"
    if choice == "auto" and not first_shape:
        return "--hf-compile auto compiles on the first shape only"
    if choice == "auto" and budget.left() < COMPILE_NEED_S:
        return (f"--hf-compile auto: {budget.left():.0f} s of the budget left, compiling "
                f"needs about {COMPILE_NEED_S:.0f} s")
    return None


# ---- measuring ---------------------------------------------------------------------------------

def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call takes: CUDA events around it on a GPU, the host clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def step_seconds(long: Callable[[], Any], short: Callable[[], Any], sizes: Sizes,
                 device: torch.device) -> float:
    """Median over repeats of (t(M tokens) - t(1 token)) / (M - 1): one decode step."""
    differences = []
    for _ in range(sizes.repeats):
        differences.append(timed(long, device) - timed(short, device))
    step = statistics.median(differences) / (sizes.new_tokens - 1)
    if not step > 0:
        raise RuntimeError(f"an M-token call was not slower than a 1-token call "
                           f"({differences}): the timing is noise at this size")
    return step


def peak_memory(short: Callable[[Callable], Any], long: Callable[[Callable], Any],
                device: torch.device) -> tuple[int, int, int]:
    """(allocated before, peak over a 1-token call, peak over the decode steps of an M-token
    call). Each fn takes an observer called after every step; the decode peak restarts at the
    first call and keeps the largest reading from then on."""
    _free(device)
    reset_peak_memory(device)
    baseline = (torch.cuda.memory_allocated(device) if device.type == "cuda"
                else peak_memory_bytes(device))  # the CPU's peak RSS restarts at the current
    short(lambda _: None)
    prefill = peak_memory_bytes(device)
    readings: list[int] = []

    def observe(_):
        if readings:
            readings.append(peak_memory_bytes(device))
        else:
            readings.append(0)  # the first step reported: prefill's memory is behind us
        reset_peak_memory(device)

    long(observe)
    return baseline, prefill, max(readings + [peak_memory_bytes(device)])


def calls_per_step(path: str, batch: int, long: Callable[[], Any], short: Callable[[], Any],
                   steps: int, device: torch.device) -> Calls:
    """Profiles of a call with 1 + steps tokens and of a 1-token call, differenced per step."""
    long_counts, short_counts = _profile_counts(long, device), _profile_counts(short, device)
    per_step = {name: (long_counts.get(name, 0) - short_counts.get(name, 0)) / steps
                for name in set(long_counts) | set(short_counts)}

    def total(names) -> float:
        return sum(per_step.get(name, 0.0) for name in names)

    runtime = {name: value for name, value in sorted(per_step.items())
               if name.startswith("cu") and value}
    return Calls(path, batch, host_syncs=total(SYNC_CALLS),
                 dtoh_copies=per_step.get("device:Memcpy DtoH", 0.0),
                 kernel_launches=total(LAUNCH_CALLS), graph_launches=total(GRAPH_CALLS),
                 device_kernels=per_step.get("device:kernels", 0.0),
                 aten_ops=per_step.get("host:aten ops", 0.0), runtime_calls=runtime)


def _profile_counts(fn: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """Event counts of one call: host events by name, plus 'device:kernels', 'device:Memcpy
    DtoH' and 'host:aten ops' (top-level aten ops, not the ones they call)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    counts: dict[str, int] = {"device:kernels": 0, "device:Memcpy DtoH": 0, "host:aten ops": 0}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            if event.name.startswith("Memcpy DtoH"):
                counts["device:Memcpy DtoH"] += 1
            elif not event.name.startswith(("Memcpy", "Memset")):
                counts["device:kernels"] += 1
            continue
        counts[event.name] = counts.get(event.name, 0) + 1
        parent = event.cpu_parent
        if event.name.startswith("aten::") and not (parent and parent.name.startswith("aten::")):
            counts["host:aten ops"] += 1
    return counts


# ---- derived numbers ---------------------------------------------------------------------------

def roofline(config: ModelConfig, batch: int, sizes: Sizes, weight_bytes: int,
             dtype: torch.dtype, bandwidth: float | None) -> dict:
    """Bytes one decode step must read at B rows and the mean context, and the steps/s the
    bandwidth allows."""
    context = sizes.context + sizes.new_tokens / 2
    kv_bytes = int(batch * context * config.num_layers * 2 * config.num_kv_heads *
                   config.head_dim * dtype.itemsize)
    total = weight_bytes + kv_bytes
    return {"batch": batch, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "bytes_per_step": total,
            "steps_per_s": None if bandwidth is None else bandwidth / total}


def _with_roofline(row: DecodeRow, rooflines: list[dict]) -> DecodeRow:
    limit = next((r["steps_per_s"] for r in rooflines if r["batch"] == row.batch), None)
    if row.step_s and limit:
        row.roofline_fraction = (1 / row.step_s) / limit
    return row


def targets(shape: str, device: torch.device, result: dict) -> list[dict]:
    """The project's goals (module docstring) as pass/fail where both sides were measured."""
    def step(path: str, batch: int) -> float | None:
        return next((r.step_s for r in result["decode"]
                     if r.path == path and r.batch == batch and r.status == "ok"), None)

    binding = shape == "7b" and device.type == "cuda"
    hf_static = "hf_static_compiled" if step("hf_static_compiled", 1) else "hf_static"
    largest = max(r["batch"] for r in result["roofline"])
    ours_b1 = [r for r in result["decode"] if r.path.startswith("ours") and r.batch == 1
               and r.roofline_fraction is not None]
    best_b1 = max(ours_b1, key=lambda r: r.roofline_fraction, default=None)
    spec_b1 = [r for r in result["speculative"] if r.batch == 1 and r.status == "ok"]
    rows = [
        _target(f"ours_graphs vs {hf_static} at B=1 (speed-up)", _ratio(step(hf_static, 1),
                                                                      step("ours_graphs", 1)),
                ">=", 0.9),
        _target(f"ours_graphs vs hf_dynamic at B={largest} (speed-up)",
                _ratio(step("hf_dynamic", largest), step("ours_graphs", largest)), ">=", 1.5),
        _target(f"{best_b1.path if best_b1 else 'ours'} share of the bandwidth roofline at B=1",
                best_b1.roofline_fraction if best_b1 else None, ">=", 0.7),
        _target("ours_graphs vs ours_eager at B=1 (speed-up)",
                _ratio(step("ours_eager", 1), step("ours_graphs", 1)), ">=", 1.5),
    ]
    for row in spec_b1:
        rows.append(_target(f"break-even acceptance {row.strategy} on {row.path} at B=1",
                            row.break_even_acceptance, "<=", 1.5))
    for row in rows:
        row["binding"] = binding
    return rows


def _target(name: str, measured: float | None, relation: str, threshold: float) -> dict:
    passed = None if measured is None else (
        measured >= threshold if relation == ">=" else measured <= threshold)
    return {"target": name, "measured": measured, "relation": relation,
            "threshold": threshold, "passed": passed}


def _ratio(slower: float | None, faster: float | None) -> float | None:
    return None if not slower or not faster else slower / faster


# ---- output ------------------------------------------------------------------------------------

def format_tables(shape: str, result: dict, device: dict, sizes: Sizes) -> str:
    gib = 2 ** 30
    bandwidth = device["bandwidth_bytes_per_s"]
    lines = [f"\n{shape} on {device['name']} ({device['dtype']}), context {sizes.context}, "
             f"{sizes.new_tokens} new tokens, roofline at "
             f"{'-' if bandwidth is None else f'{bandwidth / 1e12:.2f} TB/s'}",
             f"{'path':<20}{'B':>4}{'ms/step':>10}{'tok/s':>10}{'roofline':>10}"
             f"{'prefill GiB':>13}{'decode GiB':>12}  status"]
    for r in result["decode"]:
        lines.append(
            f"{r.path:<20}{r.batch:>4}{_num(r.step_s, 1e3, '.2f'):>10}"
            f"{_num(r.tokens_per_s, 1, '.0f'):>10}{_num(r.roofline_fraction, 100, '.0f', '%'):>10}"
            f"{_num(r.prefill_peak_bytes, 1 / gib, '.2f'):>13}"
            f"{_num(r.decode_peak_bytes, 1 / gib, '.2f'):>12}  "
            f"{r.status}{'' if r.detail is None else ': ' + r.detail[:80]}")
    lines.append(f"\n{'calls per step (B=1)':<20}{'syncs':>7}{'DtoH':>6}{'launches':>10}"
                 f"{'graphs':>8}{'kernels':>9}{'aten ops':>10}")
    for c in result["calls_per_step"]:
        if isinstance(c, Calls):
            lines.append(f"{c.path:<20}{c.host_syncs:>7.1f}{c.dtoh_copies:>6.1f}"
                         f"{c.kernel_launches:>10.1f}{c.graph_launches:>8.1f}"
                         f"{c.device_kernels:>9.1f}{c.aten_ops:>10.1f}")
        else:
            lines.append(f"{c['path']:<20}  {c['status']}: {(c['detail'] or '')[:80]}")
    lines.append(f"\n{'speculative':<14}{'B':>4}{'strategy':>10}{'plain ms':>10}{'draft':>8}"
                 f"{'verify':>8}{'accept':>8}{'break-even':>12}  status")
    for r in result["speculative"]:
        lines.append(f"{r.path:<14}{r.batch:>4}{r.strategy:>10}"
                     f"{_num(r.plain_step_s, 1e3, '.2f'):>10}{_num(r.draft_s, 1e3, '.2f'):>8}"
                     f"{_num(r.verify_s, 1e3, '.2f'):>8}{_num(r.accept_s, 1e3, '.2f'):>8}"
                     f"{_num(r.break_even_acceptance, 1, '.2f'):>12}  "
                     f"{r.status}{'' if r.detail is None else ': ' + r.detail[:80]}")
    lines.append("\ntargets" + ("" if result["targets"] and result["targets"][0]["binding"]
                                else " (informational: binding on the 7b shape on a GPU)"))
    for t in result["targets"]:
        verdict = {True: "pass", False: "FAIL", None: "not measured"}[t["passed"]]
        lines.append(f"  {t['target']}: {_num(t['measured'], 1, '.2f')} "
                     f"({t['relation']} {t['threshold']}) {verdict}")
    return "\n".join(lines)


def _num(value: float | None, scale: float, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def _print_row(shape: str, row: DecodeRow) -> None:
    if row.status == "ok":
        print(f"         {shape} {row.path} B={row.batch}: {row.step_s * 1e3:.2f} ms/step, "
              f"{row.tokens_per_s:.0f} tok/s", flush=True)
    else:
        print(f"         {shape} {row.path} B={row.batch}: {row.status}: {row.detail}", flush=True)


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return asdict(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def _string_keys(value: Any) -> Any:
    """A JSON-ready copy: dict keys as strings (graph keys may be tuples), at every level."""
    if isinstance(value, dict):
        return {str(key): _string_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(item) for item in value]
    return value


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _unique_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    seen, unique = set(), []
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            unique.append(parameter)
    return unique


# ---- command line ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where to run (default: cuda); cpu defaults to the tiny shape and "
                             "small sizes, for CI")
    parser.add_argument("--shape", type=_names, default=None,
                        help=f"comma-separated shapes from {', '.join(SHAPES)}, run in order "
                             "(default: 7b,1.5b on cuda, tiny on cpu)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every number here, rewritten after each measurement "
                             "(default: print only)")
    parser.add_argument("--batches", type=_ints, default=None,
                        help=f"plain-decode batch sizes (default: {_join(GPU_SIZES.batches)} on "
                             f"cuda, {_join(CPU_SIZES.batches)} on cpu)")
    parser.add_argument("--context", type=int, default=None,
                        help=f"prompt tokens per row (default: {GPU_SIZES.context} / "
                             f"{CPU_SIZES.context})")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help=f"tokens generated per row and call, M >= 2 (default: "
                             f"{GPU_SIZES.new_tokens} / {CPU_SIZES.new_tokens})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed calls per measurement, the median kept (default: "
                             f"{GPU_SIZES.repeats} / {CPU_SIZES.repeats})")
    parser.add_argument("--spec-batches", type=_ints, default=None,
                        help=f"batch sizes of the speculative chains (default: "
                             f"{_join(GPU_SIZES.spec_batches)} / {_join(CPU_SIZES.spec_batches)})")
    parser.add_argument("--depths", type=_ints, default=None,
                        help=f"chain depths D, each run as Strategy(D, 1, D + 1) (default: "
                             f"{_join(GPU_SIZES.depths)})")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help=f"decode steps per profile, P (default: {GPU_SIZES.profile_steps} "
                             f"/ {CPU_SIZES.profile_steps})")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in bytes/s for the roofline (default: by GPU "
                             "name from HBM_BANDWIDTH, e.g. 4.8e12 for an H200; none on the CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the optional parts may run to (later shapes, the compiled "
                             "transformers row); default: no limit")
    parser.add_argument("--hf-compile", choices=("auto", "on", "off"), default="auto",
                        help="the compiled static-cache transformers row at B=1: auto (default) "
                             f"tries it on the first shape when >= {COMPILE_NEED_S:.0f} s of "
                             "the budget are left; on always (CUDA); off never")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts (default: 0)")
    parser.add_argument("--std", type=float, default=0.02,
                        help="standard deviation of the random weights (default: 0.02)")
    args = parser.parse_args(argv)
    if args.shape is None:
        args.shape = ["7b", "1.5b"] if args.device == "cuda" else ["tiny"]
    unknown = [s for s in args.shape if s not in SHAPES]
    if unknown:
        parser.error(f"--shape: unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    for name in ("context", "repeats", "profile_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.new_tokens is not None and args.new_tokens < 2:
        parser.error(f"--new-tokens: must be >= 2 (a decode step past prefill's token), got "
                     f"{args.new_tokens}")
    if args.bandwidth is not None and not args.bandwidth > 0:
        parser.error(f"--bandwidth: must be > 0 bytes/s, got {args.bandwidth}")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s: must be > 0, got {args.budget_s}")
    if not args.std > 0:
        parser.error(f"--std: must be > 0, got {args.std}")
    return args


def resolve_sizes(args: argparse.Namespace) -> Sizes:
    base = GPU_SIZES if args.device == "cuda" else CPU_SIZES
    given = {name: getattr(args, name) for name in
             ("batches", "context", "new_tokens", "repeats", "spec_batches", "depths",
              "profile_steps") if getattr(args, name) is not None}
    return dataclasses.replace(base, **given)


def resolve_bandwidth(override: float | None, name: str) -> tuple[float | None, str]:
    if override is not None:
        return override, "--bandwidth"
    for key, value in HBM_BANDWIDTH:
        if key in name:
            return value, f"HBM_BANDWIDTH[{key!r}]"
    return None, f"unknown for {name!r}: pass --bandwidth"


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _join(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


if __name__ == "__main__":
    sys.exit(main())
