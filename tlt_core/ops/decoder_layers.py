"""`DecoderLayers`: a bfloat16 Llama-family model's decoder layers over one pass's new tokens,
in one kernel call on the CPU (csrc/include/tlt/decoder_layers.h).

Each layer runs the kernels the packed pass otherwise calls one by one from Python
(add_rms_norm, panel_matmul, rope_kv_write, decode_attention, silu_mul), in the same order on
the same arguments, so the bits are the same; what goes is the glue between them, a fifth of a
one-token pass of SmolLM2-135M on 2 cores (`python bench/pass_kernels.py`). The weights'
tensors are checked once, when a DecoderLayers is built; a call checks the tensors of its pass.

Shapes: B rows, T new tokens per row, R = B T, H hidden size, d head_dim, H_q / H_kv query /
key-value heads, I intermediate size, L layers, P RoPE table positions, S cache slots read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from tlt_core import _C
from tlt_core.ops._cpu_tensors import FLOAT_TYPE_CODES, described
from tlt_core.ops.panel_matmul import panel_shape


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer's bfloat16 CPU weights: RMSNorm weights (H,), products packed by pack_panels
    (either layout), biases (N,) or None. input_norm None: the layer has none (EAGLE's drafter
    layer), its q|k|v product reads h itself."""

    input_norm: torch.Tensor | None
    input_eps: float
    qkv: torch.Tensor  # H -> (H_q + 2 H_kv) d
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # H_q d -> H
    o_bias: torch.Tensor | None
    post_attention_norm: torch.Tensor
    post_attention_eps: float
    gate_up: torch.Tensor  # H -> [gate | up], 2 I
    down: torch.Tensor  # I -> H
    # Qwen3: each q head's and each k head's RMSNorm weight (d,) after the q|k|v product, both
    # or neither
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0


@dataclass(frozen=True)
class DecoderShape:
    hidden: int  # H
    q_heads: int  # H_q
    kv_heads: int  # H_kv
    head_dim: int  # d
    intermediate: int  # I


class DecoderLayers:
    """The layers, their weights' addresses gathered once. The tensors are held, so they live
    as long as this object; writing them in place is seen by the next call."""

    def __init__(self, shape: DecoderShape, layers: Sequence[DecoderLayerWeights]):
        H, d, I = shape.hidden, shape.head_dim, shape.intermediate
        if min(H, shape.q_heads, shape.kv_heads, I) < 1 or d < 2 or d % 2:
            raise ValueError(f"shape: sizes must be >= 1 and head_dim even, got {shape}")
        if shape.q_heads % shape.kv_heads:
            raise ValueError(f"shape: kv_heads {shape.kv_heads} must divide q_heads "
                             f"{shape.q_heads}")
        self.shape = shape
        self._held = tuple(layers)
        self._kernel = _C.DecoderLayersBf16(H, shape.q_heads, shape.kv_heads, d, I)
        qkv_width = (shape.q_heads + 2 * shape.kv_heads) * d
        for index, layer in enumerate(self._held):
            where = f"layers[{index}]"
            for name in ("input_norm", "post_attention_norm"):
                if name == "post_attention_norm" or layer.input_norm is not None:
                    _check(getattr(layer, name), f"{where}.{name}", (H,))
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError(f"{where}.q_norm: q_norm and k_norm come together or not at "
                                 f"all, got {described(layer.q_norm)} and "
                                 f"{described(layer.k_norm)}")
            for name in ("q_norm", "k_norm"):
                if getattr(layer, name) is not None:
                    _check(getattr(layer, name), f"{where}.{name}", (d,))
            for name in ("input_eps", "post_attention_eps", "qk_eps"):
                eps = getattr(layer, name)
                if not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
                    raise ValueError(f"{where}.{name}: must be a finite number >= 0, got {eps!r}")
            self._kernel.add_layer(
                0 if layer.input_norm is None else layer.input_norm.data_ptr(),
                float(layer.input_eps),
                _weight(layer.qkv, layer.qkv_bias, qkv_width, H, f"{where}.qkv"),
                0 if layer.q_norm is None else layer.q_norm.data_ptr(),
                0 if layer.k_norm is None else layer.k_norm.data_ptr(), float(layer.qk_eps),
                _weight(layer.o, layer.o_bias, H, shape.q_heads * d, f"{where}.o"),
                layer.post_attention_norm.data_ptr(), float(layer.post_attention_eps),
                _weight(layer.gate_up, None, 2 * I, H, f"{where}.gate_up"),
                _weight(layer.down, None, H, I, f"{where}.down"))

    def __len__(self) -> int:
        return len(self._held)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 cache: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                 mask: torch.Tensor | None, read_len: int, saved_layers: Sequence[int] = ()
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over h (R, H) bfloat16, updated in place and returned with {layer: its
        output (R, H)} for saved_layers. positions, slots (B, T) int64: each new token's RoPE
        position (a row of cos / sin_signed (P, d) bfloat16: rope.h) and the cache slot its K
        and V go to. cache (L, 2, B, H_kv, max_len, d) float32 or bfloat16, slots dense rows of
        d. mask and read_len: decode_attention's (None: every query sees slots [0, read_len))."""
        shape = self.shape
        for name, tensor in (("h", h), ("positions", positions), ("slots", slots),
                             ("cache", cache), ("cos", cos), ("sin_signed", sin_signed)):
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                raise TypeError(f"{name}: expected a strided torch tensor, got "
                                f"{described(tensor)}")
        if positions.dim() != 2 or positions.dtype != torch.int64:
            raise ValueError(f"positions: expected (B, T) int64, got {described(positions)}")
        B, T = positions.shape
        for name, tensor in (("positions", positions), ("slots", slots)):
            if (tensor.shape != positions.shape or tensor.dtype != torch.int64
                    or tensor.device.type != "cpu" or not tensor.is_contiguous()):
                raise ValueError(f"{name}: expected a contiguous CPU int64 tensor ({B}, {T}), "
                                 f"got {described(tensor)}")
        _check(h, "h", (B * T, shape.hidden))
        _check(cos, "cos", (None, shape.head_dim))
        _check(sin_signed, "sin_signed", tuple(cos.shape))
        d, layers = shape.head_dim, len(self._held)
        if (cache.dim() != 6 or cache.dtype not in (torch.float32, torch.bfloat16)
                or cache.device.type != "cpu" or cache.shape[0] < layers
                or cache.shape[1:3] != (2, B) or cache.shape[3] != shape.kv_heads
                or cache.shape[5] != d or cache.stride()[4:] != (d, 1) or min(cache.stride()) < 0):
            raise ValueError(f"cache: expected a CPU float32 or bfloat16 view ({layers}, 2, {B}, "
                             f"{shape.kv_heads}, max_len, {d}) with dense slots, got "
                             f"{described(cache)}")
        max_len = cache.shape[4]
        if (isinstance(read_len, bool) or not isinstance(read_len, int)
                or not 1 <= read_len <= max_len):
            raise ValueError(f"read_len: must be an int in [1, {max_len}], got {read_len!r}")
        mask_args = (0, 0, 0)
        if mask is not None:
            if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                    or mask.device.type != "cpu" or mask.dim() != 4
                    or mask.shape[0] not in (1, B) or mask.shape[1] != 1
                    or mask.shape[2] not in (1, T) or mask.shape[3] != read_len
                    or (read_len > 1 and mask.stride(3) != 1)):
                raise ValueError(f"mask: expected a CPU bool tensor ({B} or 1, 1, {T} or 1, "
                                 f"{read_len}) with dense slots, got {described(mask)}")
            mask_args = (mask.data_ptr(), 0 if mask.shape[0] == 1 else mask.stride(0),
                         0 if mask.shape[2] == 1 else mask.stride(2))
        saved = {}
        for layer in saved_layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
                raise ValueError(f"saved_layers: {layer!r} is not a layer index in [0, {layers})")
            saved[layer] = torch.empty_like(h)
        strides = cache.stride()
        self._kernel.run(h.data_ptr(), B, T, cache.data_ptr(), FLOAT_TYPE_CODES[cache.dtype],
                         strides[0], strides[1], strides[2], strides[3], max_len,
                         cos.data_ptr(), sin_signed.data_ptr(), cos.shape[0],
                         positions.data_ptr(), slots.data_ptr(), *mask_args, read_len,
                         [(layer, out.data_ptr()) for layer, out in saved.items()])
        return h, saved


def _weight(panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
            in_features: int, name: str) -> tuple[int, int, bool, int]:
    """A packed product's (address, N, pairs, bias address or 0), checked."""
    pairs = isinstance(panels, torch.Tensor) and panels.dim() == 4
    _check(panels, name, panel_shape(out_features, in_features, pairs))
    if bias is not None:
        _check(bias, f"{name}_bias", (out_features,))
    return panels.data_ptr(), out_features, pairs, 0 if bias is None else bias.data_ptr()


def _check(tensor, name: str, shape: tuple[int | None, ...]) -> None:
    """A contiguous CPU bfloat16 tensor of `shape` (None: any size >= 1 there)."""
    if (not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided
            or tensor.dtype != torch.bfloat16 or tensor.device.type != "cpu"
            or not tensor.is_contiguous() or tensor.dim() != len(shape)
            or any(size < 1 if want is None else size != want
                   for size, want in zip(tensor.shape, shape))):
        wanted = ", ".join("n" if size is None else str(size) for size in shape)
        raise ValueError(f"{name}: expected a contiguous CPU bfloat16 tensor ({wanted}), got "
                         f"{described(tensor)}")
