"""The GPU check's environment record: what machine and software measured the numbers, and which
attention kernel our attention shapes actually get.

    python bench/gpu_environment.py OUT.json [--device cuda|cpu]

Writes one JSON object:
- `device`: the GPU's name, memory, compute capability and SM count (the CPU's model and cores
  with --device cpu), and the driver version where nvidia-smi answers;
- `software`: Python, torch, its CUDA and cuDNN versions, nvcc, transformers, whether
  tlt_core._C was built with the CUDA kernels;
- `sdpa`: one row per case of `F.scaled_dot_product_attention` as the target model calls it
  (tlt_core.model.packed): bf16, grouped-query heads H_q = 28 / H_kv = 4 with head_dim 128
  (Qwen2.5-7B), rows of ragged lengths over S = 1024 cache slots with a boolean mask
  (B, 1, T, S), for B in {1, 16} and T in {1, 8} new tokens (a decode step, an 8-node verify).
  Each backend is tried alone under `torch.nn.attention.sdpa_kernel`, with `enable_gqa=True`
  (our call) and with K/V expanded to H_q heads (to tell a GQA limit from a mask limit). A
  backend that runs is compared with float32 math (`max_abs_diff_vs_float32_math`); one that
  does not keeps its error and torch's warnings, which say why. `default` names the aten
  kernel that runs with every backend allowed (from the profiler), with the mask and, for
  T = 1, without one (equal-length rows: our packed pass passes no mask then). Flash attention
  takes no arbitrary mask, so masked cases are expected to land on efficient, cuDNN or math.

Shapes: B rows, T new tokens, S cache slots, H_q / H_kv query / key-value heads, d head_dim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

H_Q, H_KV, HEAD_DIM, SLOTS = 28, 4, 128, 1024  # Qwen2.5-7B attention, ~1k-token context
BATCHES, NEW_TOKENS = (1, 16), (1, 8)
# aten kernels scaled_dot_product_attention dispatches to, by backend
KERNELS = {"aten::_scaled_dot_product_flash_attention": "flash",
           "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
           "aten::_scaled_dot_product_efficient_attention": "efficient",
           "aten::_scaled_dot_product_cudnn_attention": "cudnn",
           "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
           "aten::_scaled_dot_product_attention_math": "math"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The JSON's fields are described in the module docstring "
               "(python -c 'import bench.gpu_environment as m; help(m)').")
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where to probe attention (default: cuda)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    device = torch.device(args.device)
    info = {"device": device_info(device), "software": software_info(),
            "sdpa": sdpa_probe(device)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({"device": info["device"], "software": info["software"]}, indent=1))
    for row in info["sdpa"]:
        runs = [f"{name}{'' if gqa else ' (expanded K/V)'}" for gqa, results in
                ((True, row["enable_gqa"]), (False, row["expanded_kv"]))
                for name, result in results.items() if result["ok"]]
        print(f"sdpa B={row['B']} T={row['T']}: default {row['default']['masked']}; "
              f"runs alone: {', '.join(runs) or 'none'}")
    return 0


def device_info(device: torch.device) -> dict:
    if device.type == "cpu":
        model = next((line.partition(":")[2].strip() for line in _read("/proc/cpuinfo")
                      if line.startswith("model name")), platform.processor())
        return {"type": "cpu", "name": model, "cores": os.cpu_count()}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "driver": _command(["nvidia-smi", "--query-gpu=driver_version",
                                "--format=csv,noheader"])}


def software_info() -> dict:
    import tlt_core.ops as ops

    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    nvcc = _command(["nvcc", "--version"])
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
            else None,
            "nvcc": nvcc.splitlines()[-1] if nvcc else None,
            "transformers": transformers_version,
            "tlt_core_built_with_cuda": ops.built_with_cuda}


def sdpa_probe(device: torch.device) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for B in BATCHES:
        for T in NEW_TOKENS:
            q = torch.randn(B, H_Q, T, HEAD_DIM, generator=g, device=device,
                            dtype=torch.bfloat16)  # (B, H_q, T, d)
            k, v = (torch.randn(B, H_KV, SLOTS, HEAD_DIM, generator=g, device=device,
                                dtype=torch.bfloat16) for _ in range(2))  # (B, H_kv, S, d)
            mask = ragged_mask(B, T, device)  # (B, 1, T, S)
            expanded = [x.repeat_interleave(H_Q // H_KV, dim=1) for x in (k, v)]  # (B, H_q, S, d)
            with sdpa_kernel(SDPBackend.MATH):  # float32 math: what every backend is held to
                reference = F.scaled_dot_product_attention(
                    q.float(), *(x.float() for x in expanded), attn_mask=mask)  # (B, H_q, T, d)
            row = {"B": B, "T": T, "S": SLOTS, "H_q": H_Q, "H_kv": H_KV, "head_dim": HEAD_DIM,
                   "dtype": "bfloat16", "mask": "ragged rows, bool (B, 1, T, S)",
                   "enable_gqa": {}, "expanded_kv": {}}
            for name, backend in backends.items():
                row["enable_gqa"][name] = _try_backend(
                    backend, reference, q, k, v, attn_mask=mask, enable_gqa=True)
                row["expanded_kv"][name] = _try_backend(
                    backend, reference, q, *expanded, attn_mask=mask)
            row["default"] = {"masked": _default_kernel(q, k, v, attn_mask=mask,
                                                        enable_gqa=True)}
            if T == 1:
                row["default"]["unmasked"] = _default_kernel(q, k, v, enable_gqa=True)
            rows.append(row)
    return rows


def ragged_mask(B: int, T: int, device: torch.device) -> torch.Tensor:
    """(B, 1, T, S) bool as tlt_core.model.attention_plan builds it: row b's committed prefix
    (rows of different lengths) plus its new tokens, causal among themselves."""
    lengths = torch.tensor([SLOTS - T - (37 * b) % 256 for b in range(B)], device=device)  # (B,)
    rel = torch.arange(SLOTS, device=device) - lengths[:, None]  # (B, S)
    new = torch.arange(T, device=device)[:, None]  # (T, 1)
    sees = (rel[:, None, :] < 0) | ((rel[:, None, :] >= 0) & (rel[:, None, :] <= new))  # (B, T, S)
    return sees[:, None]


def _try_backend(backend, reference: torch.Tensor, *args, **kwargs) -> dict:
    from torch.nn.attention import sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*args, **kwargs)
            _synchronize(out.device)
            diff = (out.float() - reference).abs().max()
            result = {"ok": True, "max_abs_diff_vs_float32_math": float(diff)}
        except RuntimeError as error:
            result = {"ok": False, "error": str(error).strip().splitlines()[0]}
    reasons = sorted({str(w.message).strip() for w in caught})
    if reasons:
        result["warnings"] = reasons
    return result


def _default_kernel(*args, **kwargs) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = F.scaled_dot_product_attention(*args, **kwargs)
        _synchronize(out.device)
    names = {event.key for event in prof.key_averages()}
    return ", ".join(KERNELS[name] for name in KERNELS if name in names) or "unknown"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _command(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
