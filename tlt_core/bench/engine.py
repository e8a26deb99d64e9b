"""`tlt bench engine`: the engine's plain decoding against Hugging Face transformers' `generate`
on the same model, weights and dtype, side by side in one run, with the machine's rooflines.

Both decode greedily from the same equal-length random prompts for exactly `new_tokens` tokens
(no stop tokens; transformers with min_new_tokens = max_new_tokens), so they do the same work;
ours and theirs alternate rep by rep (the machine is shared and noisy) and the best rep of each
counts. A row reports generated tokens per second for each, ratio = ours / transformers, and two
rooflines of a decoding step at that batch, from this machine's measured rates:

- bandwidth: every weight read once per step (the decoder layers and the LM head; the KV cache
  at these lengths is under 1% of it) over the measured read bandwidth (a large `sum`, of the
  dtype or of float32 over the same bytes, whichever reads faster; the best before the rows
  and between each row's reps, since a shared machine's rate moves);
- compute: 2 FLOPs per weight per row over the measured matmul rate (a large matmul in the
  dtype; on a CPU, the faster of that and float32's: a CPU without bfloat16 instructions
  multiplies bfloat16 weights by widening them to float32, which is what its roof is).

`roofline_share` = ours / min(bandwidth, compute roofline): how close we are to the nearer one.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tlt_core.bench.model_workload import DEVICES, DTYPES
from tlt_core.config_flags import add_dataclass_arguments, int_list, option
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import save_checkpoint


@dataclass(frozen=True)
class EngineOptions:
    """`tlt bench engine`: the model, batch sizes and lengths of the comparison."""
    json: Path | None = option("write rows (batch, ours_tok_s, hf_tok_s, ratio, ...) as JSON",
                               None, metavar="FILE")
    model: Path | None = option("a local Hugging Face checkpoint folder; default: the "
                                "pre-trained embedded model", None, metavar="PATH")
    batch: tuple[int, ...] = option("batch sizes", (1, 8, 32, 64), parse=int_list,
                                    metavar="B,...")
    new_tokens: int = option("tokens generated per row", 128)
    reps: int = option("timed runs per case, alternating ours and theirs (best kept)", 3)
    dtype: str = option("weights' dtype of both sides (auto: as tlt generate chooses; the "
                        "embedded model float32)", "auto", choices=DTYPES)
    device: str = option("where both sides run", "cpu", choices=DEVICES)


CLI_OPTIONS = (EngineOptions,)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tlt bench engine`'s flags: one per field of CLI_OPTIONS, its help the field's."""
    for options in CLI_OPTIONS:
        add_dataclass_arguments(parser, options)


@dataclass(frozen=True)
class MachineRates:
    read_gb_s: float  # GB/s a large sum reads
    matmul_tflop_s: float  # TFLOP/s of a large matmul in the dtype (CPU: or float32, if faster)


@dataclass(frozen=True)
class EngineCase:
    batch: int
    dtype: str
    ours_tok_s: float
    hf_tok_s: float
    ratio: float
    bandwidth_roofline_tok_s: float
    compute_roofline_tok_s: float
    roofline_share: float
    new_tokens: int
    prompt_len: int
    read_gb_s: float  # the read bandwidth the row's roofline is from


class ReadProbe:
    """Times a read of a buffer past every cache: the same bytes summed as the dtype and as
    float32, the faster counting (a bfloat16 sum widens every element and can run below the
    memory's rate: 66.7 against 83.9 GB/s on a 2-core Zen 5, which would put the roof under what
    the decode itself reads)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        big = torch.ones(1 << 30 if device.type == "cuda" else 256 << 20, dtype=torch.uint8,
                         device=device)
        self.nbytes, self.device = big.nbytes, device
        self._sums = [big.view(dtype).sum, big.view(torch.float32).sum]
        for total in self._sums:  # untimed: first-call costs
            total()

    def gb_s(self) -> float:
        """The faster of one read each way, in GB/s."""
        return self.nbytes / min(_timed(total, self.device) for total in self._sums) / 1e9


def measure_rates(dtype: torch.dtype, device: torch.device, reps: int = 5,
                  probe: ReadProbe | None = None) -> MachineRates:
    """The device's read bandwidth and matmul rate, best of `reps` (see the module docstring)."""
    probe = probe or ReadProbe(dtype, device)
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # untimed: first-call costs
    read_gb_s = max(probe.gb_s() for _ in range(reps))
    matmul = min(_timed(lambda: torch.mm(a, b), device) for _ in range(reps))
    if device.type == "cpu" and dtype != torch.float32:
        a, b = a.float(), b.float()
        torch.mm(a, b)
        matmul = min([matmul] + [_timed(lambda: torch.mm(a, b), device) for _ in range(reps)])
    return MachineRates(read_gb_s, 2 * size ** 3 / matmul / 1e12)


def weights_read_per_step(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes, elements) of the weights a decoding step multiplies by: every decoder layer's
    and the LM head (the embedding is a lookup, unless tied to the head)."""
    seen, nbytes, elements = set(), 0, 0
    for name, parameter in model.named_parameters():
        if name == "model.embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        nbytes += parameter.nbytes
        elements += parameter.numel()
    return nbytes, elements


def run(model: torch.nn.Module, *, folder: str | Path | None = None, batches=(1, 32),
        new_tokens: int = 128, prompt_len: int = 16, reps: int = 3, seed: int = 0,
        progress=print) -> list[EngineCase]:
    """Rows for each batch size; `folder`: the checkpoint transformers loads (default: `model`
    exported to a temporary folder); both run in `model`'s dtype on its device."""
    from transformers import AutoModelForCausalLM

    dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device
    with tempfile.TemporaryDirectory() as scratch:
        if folder is None:
            save_checkpoint(model, scratch)
        hf_model = AutoModelForCausalLM.from_pretrained(folder or scratch, dtype=dtype)
    hf_model = hf_model.to(device).eval()
    probe = ReadProbe(dtype, device)
    rates = measure_rates(dtype, device, probe=probe)
    weight_bytes, weight_elements = weights_read_per_step(model)
    kind = str(dtype)[6:] + (" (or float32's, if faster)" if device.type == "cpu"
                             and dtype != torch.float32 else "")
    progress(f"machine: read {rates.read_gb_s:.1f} GB/s, {kind} matmul "
             f"{rates.matmul_tflop_s:.2f} TFLOP/s; weights read per step "
             f"{weight_bytes / 2**20:.0f} MiB")
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    results = []
    for batch in batches:
        prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g).to(device)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
        engine = RolloutEngine(model, EngineConfig(max_batch=batch,
                                                   max_len=prompt_len + new_tokens))
        requests = [Request(p.tolist(), params) for p in prompts]

        def ours():
            return engine.generate(requests)

        def hf():
            with torch.inference_mode():
                return hf_model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         do_sample=False, pad_token_id=0)

        ours(), hf()  # untimed: one-time costs (kernel compilation per shape, packing)
        ours_s = hf_s = float("inf")
        read_gb_s = rates.read_gb_s  # and read again between reps: the machine's rate moves
        for _ in range(reps):  # alternating, so both see the same machine
            ours_s = min(ours_s, _timed(ours, device))
            hf_s = min(hf_s, _timed(hf, device))
            read_gb_s = max(read_gb_s, probe.gb_s())
        tokens = batch * new_tokens
        bandwidth = batch / (weight_bytes / (read_gb_s * 1e9))
        compute = batch / (2 * weight_elements * batch / (rates.matmul_tflop_s * 1e12))
        case = EngineCase(batch, str(dtype).removeprefix("torch."), tokens / ours_s,
                          tokens / hf_s, hf_s / ours_s, bandwidth, compute,
                          tokens / ours_s / min(bandwidth, compute), new_tokens, prompt_len,
                          read_gb_s)
        progress(format_table([case], header=not results))
        results.append(case)
    return results


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def as_rows(results: list[EngineCase]) -> list[dict]:
    return [asdict(r) for r in results]


def format_table(results: list[EngineCase], header: bool = True) -> str:
    lines = [f"{'batch':>6}{'dtype':>10}{'ours_tok_s':>12}{'hf_tok_s':>11}{'ratio':>8}"
             f"{'bw_roof':>10}{'flop_roof':>11}{'of_roof':>9}"] if header else []
    for r in results:
        lines.append(f"{r.batch:>6}{r.dtype:>10}{r.ours_tok_s:>12.1f}{r.hf_tok_s:>11.1f}"
                     f"{r.ratio:>7.2f}x{r.bandwidth_roofline_tok_s:>10.0f}"
                     f"{r.compute_roofline_tok_s:>11.0f}{100 * r.roofline_share:>8.0f}%")
    return "\n".join(lines)
