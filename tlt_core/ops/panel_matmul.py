"""`panel_matmul`: `x @ W.T (+ bias) (+ addend)` in float32 or bfloat16 for the few rows of a
decode step on the CPU, over W packed once by `pack_panels` (csrc/include/tlt/panel_matmul.h).

A decode step at batch 1 to 16 streams each weight once and does little arithmetic on it; this
product reads the weights at close to the memory's rate whatever the row count (up to 16), and
each row's bits are independent of the other rows (a fused multiply-add per k, in order). In
bfloat16 the same float32 arithmetic runs on the widened operands and each output is rounded
once; the weights stream at half the bytes. The packed inference pass uses it through the
"panels" weight layout (tlt_core.model.weight_layout).

On a CPU with AVX512-BF16, bfloat16 weights pack in pairs instead (`pack_panels(W, pairs=True)`):
two k of sixteen features to a 64-byte line, multiplied by one dot-product instruction per line
and row, with that instruction's order and flushing of subnormals (the header states the bits).
"""

from __future__ import annotations

import torch

from tlt_core import _C
from tlt_core.ops._cpu_tensors import check_cpu_matrix, isa_code

PANEL_WIDTH: int = _C.panel_width
DTYPES = (torch.float32, torch.bfloat16)


def vectorised() -> bool:
    """Whether this CPU runs the AVX2 + FMA path (else the portable loop, correct but slow)."""
    return bool(_C.panel_matmul_vectorised())


def pairs_vectorised() -> bool:
    """Whether this CPU runs the bfloat16 pairs product's AVX512-BF16 path (else its portable
    loop, which gives the same bits slowly)."""
    return bool(_C.panel_matmul_pairs_vectorised())


def pack_panels(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """W (N, K) float32 or bfloat16 -> its panels (ceil(N / 16), K, 16) of its dtype:
    panels[p, k, j] = W[16 p + j, k], zero past N. pairs (bfloat16 only): (ceil(N / 16),
    ceil(K / 2), 16, 2) with panels[p, i, j, t] = W[16 p + j, 2 i + t], zero past N and K.
    A new tensor; `weight` is not written."""
    dtype = _dtype_of(weight, "weight")
    _check(weight, "weight", None, dtype)
    if pairs and dtype != torch.bfloat16:
        raise ValueError(f"pairs: the pairs layout is bfloat16 only, got a {dtype} weight")
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_WIDTH)
    depth = in_features + in_features % 2 if pairs else in_features
    padded = weight.new_zeros(num_panels * PANEL_WIDTH, depth)
    padded[:out_features, :in_features] = weight
    if pairs:
        return (padded.view(num_panels, PANEL_WIDTH, depth // 2, 2).permute(0, 2, 1, 3)
                .contiguous())
    return padded.view(num_panels, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()


def panel_shape(out_features: int, in_features: int, pairs: bool) -> tuple[int, ...]:
    """The shape pack_panels gives a W (out_features, in_features)."""
    num_panels = -(-out_features // PANEL_WIDTH)
    if pairs:
        return num_panels, -(-in_features // 2), PANEL_WIDTH, 2
    return num_panels, in_features, PANEL_WIDTH


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, isa: str = "auto") -> torch.Tensor:
    """x (M, K) @ W.T, then + bias (N,), then + addend (M, N), for panels = pack_panels(W) of W
    (out_features, K), in either layout (the pairs one by its four dimensions); contiguous CPU
    tensors, all float32 or all bfloat16 (x and addend may have a row stride). Into `out` (M, N)
    when given (it may be `addend`: the add in place), else a new tensor. Sums are float32 either
    way; a bfloat16 output is rounded once at the end. isa: "auto" (the vector path where the
    CPU has it) or "portable" (the header's loop, the same bits)."""
    dtype = _dtype_of(x, "x")
    _check(x, "x", None, dtype, rows_strided=True)
    rows, in_features = x.shape
    if not isinstance(out_features, int) or isinstance(out_features, bool) or out_features < 1:
        raise ValueError(f"out_features: expected an int >= 1, got {out_features!r}")
    pairs = isinstance(panels, torch.Tensor) and panels.dim() == 4
    if pairs and dtype != torch.bfloat16:
        raise ValueError(f"panels: the pairs layout (4 dimensions) is bfloat16 only, x is {dtype}")
    _check(panels, "panels", panel_shape(out_features, in_features, pairs), dtype)
    if bias is not None:
        _check(bias, "bias", (out_features,), dtype)
    if addend is not None:
        _check(addend, "addend", (rows, out_features), dtype, rows_strided=True)
    if out is None:
        out = x.new_empty(rows, out_features)
    else:
        _check(out, "out", (rows, out_features), dtype, rows_strided=True)
        if out is not addend and addend is not None and _overlaps(out, addend):
            raise ValueError("out: overlaps addend without being it; pass addend itself as out "
                             "for an add in place")
    if _overlaps(out, x) or _overlaps(out, panels) or (bias is not None and _overlaps(out, bias)):
        raise ValueError("out: overlaps an input (x, panels or bias)")
    return launch(x, panels, out_features, bias, addend, out, isa_code(isa))


def launch(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           addend: torch.Tensor | None, out: torch.Tensor, isa_code: int = 0) -> torch.Tensor:
    """panel_matmul without its checks, for arguments already known good (panel_matmul's after
    checking them; the packed pass's own activations, whose every call a check would cost
    ~30 us): rows dense, shapes and dtypes as panel_matmul's, `out` overlapping no input but
    `addend`."""
    kernel = (_C.panel_matmul_f32 if panels.dtype == torch.float32
              else _C.panel_matmul_bf16_pairs if panels.dim() == 4 else _C.panel_matmul_bf16)
    kernel(x.data_ptr(), x.shape[0], x.shape[1], _row_stride(x), panels.data_ptr(), out_features,
           0 if bias is None else bias.data_ptr(), 0 if addend is None else addend.data_ptr(),
           out_features if addend is None else _row_stride(addend), out.data_ptr(),
           _row_stride(out), isa_code)
    return out


def _row_stride(tensor: torch.Tensor) -> int:
    return tensor.stride(0) if tensor.shape[0] > 1 else tensor.shape[1]


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of a contiguous tensor or a matrix with dense rows."""
    elements = ((tensor.shape[0] - 1) * tensor.stride(0) + tensor.shape[1] if tensor.dim() == 2
                else tensor.numel())
    return tensor.data_ptr(), tensor.data_ptr() + elements * tensor.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    return a_start < b_end and b_start < a_end


def _dtype_of(tensor, name: str) -> torch.dtype:
    """The dtype the call runs in: `tensor`'s, where it is one of DTYPES."""
    if not isinstance(tensor, torch.Tensor):
        return torch.float32  # _check then names it: not a torch tensor
    dtype = tensor.dtype
    if dtype not in DTYPES:
        raise ValueError(f"{name}: expected a float32 or bfloat16 tensor, got {dtype}")
    return dtype


def _check(tensor, name: str, shape: tuple[int, ...] | None, dtype: torch.dtype,
           rows_strided: bool = False) -> None:
    check_cpu_matrix(tensor, name, dtype, shape, columns="features", rows_strided=rows_strided)
