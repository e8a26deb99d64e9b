"""`rope_kv_write`: rotary embedding of a layer's fused q|k|v projection, k and v written into
the KV cache and q laid out for attention, in one kernel call (csrc/include/tlt/rope.h).

A small model decoding on a CPU pays per tensor op (dispatch and Python), not per flop; this
replaces the dozen ops a layer spends between its qkv matmul and attention. CPU tensors only:
on a GPU the decode passes replay as CUDA graphs, which remove that cost already.

`RopeKVWriter` is the same kernel for a whole forward pass: the tables, positions, slots and
q buffer are checked once, and each layer's call checks only what differs per layer (its qkv
and its cache planes), so a pass of L layers pays for the arguments' checks once, not L times.

Shapes: B rows, T new tokens per row, H_q / H_kv query / key-value heads, d head_dim,
P table positions, S cache slots per row.
"""

from __future__ import annotations

import torch

from tlt_core import _C
from tlt_core.ops import _arrays as arr
from tlt_core.ops._cpu_tensors import FLOAT_TYPE_CODES, described


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, cache_kv: torch.Tensor,
                  q_out: torch.Tensor) -> None:
    """qkv (B, T, H_q + 2 H_kv, d), float32 or bfloat16; cos and sin_signed (P, d) in its dtype
    (sin_signed: sin with its first half negated); positions, slots (B, T) int64; cache_kv
    (2, B, H_kv, S, d): one layer's keys and values, float32 or bfloat16, any view whose last
    two dimensions are dense (the engine's running rows of its cache); q_out (B, H_q, T, d)
    contiguous in the cache's dtype. Writes rope(q) to q_out, and rope(k) and v to the cache at
    slots (rope.h), nothing else."""
    for name, tensor in (("qkv", qkv), ("q_out", q_out)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D torch tensor, got {described(tensor)}")
    kv_width = qkv.shape[2] - q_out.shape[1]  # 2 H_kv
    if kv_width < 2 or kv_width % 2:
        raise ValueError(f"qkv: holds {qkv.shape[2]} heads, which is not q_out's H_q = "
                         f"{q_out.shape[1]} plus 2 H_kv >= 2")
    RopeKVWriter(cos, sin_signed, positions, slots, q_out, kv_width // 2)(qkv, cache_kv)


class RopeKVWriter:
    """rope_kv_write with the arguments every layer of a pass shares checked once; call it with
    each layer's (qkv, cache_kv)."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, q_out: torch.Tensor, kv_heads: int):
        for name, tensor in (("cos", cos), ("sin_signed", sin_signed),
                             ("positions", positions), ("slots", slots), ("q_out", q_out)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: expected a torch tensor, got {type(tensor).__name__}")
            if tensor.device.type != "cpu":
                raise ValueError(f"{name}: rope_kv_write runs on CPU tensors (on a GPU the "
                                 f"passes are CUDA graphs), got one on {tensor.device}")
            arr.require_contiguous(tensor, name)
        arr.check_shape(q_out, "q_out", (None, None, None, None))
        B, q_heads, T, d = q_out.shape
        if not isinstance(kv_heads, int) or kv_heads < 1:
            raise ValueError(f"qkv: needs H_q + 2 H_kv heads with H_kv >= 1 (H_q = {q_heads} "
                             "from q_out)")
        if cos.dtype not in FLOAT_TYPE_CODES:
            raise TypeError(f"cos: dtype must be float32 or bfloat16, got {cos.dtype}")
        arr.check_shape(cos, "cos", (None, d))
        if sin_signed.dtype != cos.dtype or sin_signed.shape != cos.shape:
            raise ValueError(f"sin_signed: must match cos ({tuple(cos.shape)} {cos.dtype}), got "
                             f"{tuple(sin_signed.shape)} {sin_signed.dtype}")
        for name, tensor in (("positions", positions), ("slots", slots)):
            if tensor.dtype != torch.int64:
                raise TypeError(f"{name}: dtype must be int64, got {tensor.dtype}")
            arr.check_shape(tensor, name, (B, T))
        if q_out.dtype not in FLOAT_TYPE_CODES:
            raise TypeError(f"q_out: dtype must be float32 or bfloat16, got {q_out.dtype}")
        self.model_dtype, self.cache_dtype = cos.dtype, q_out.dtype
        self.qkv_shape = torch.Size((B, T, q_heads + 2 * kv_heads, d))
        self.cache_heads, self.head_dim = (2, B, kv_heads), d
        self._element = q_out.element_size()
        self._held = cos, sin_signed, positions, slots, q_out  # what the kernel reads and writes
        self._args = (FLOAT_TYPE_CODES[self.model_dtype], B, T, q_heads, kv_heads, d,
                      cos.data_ptr(), sin_signed.data_ptr(), cos.shape[0],
                      positions.data_ptr(), slots.data_ptr())
        self._q_out = q_out.data_ptr()

    def __call__(self, qkv: torch.Tensor, cache_kv: torch.Tensor) -> None:
        if (not isinstance(qkv, torch.Tensor) or qkv.shape != self.qkv_shape
                or qkv.dtype != self.model_dtype or qkv.device.type != "cpu"
                or not qkv.is_contiguous()):
            raise ValueError(f"qkv: expected a contiguous CPU {self.model_dtype} tensor of shape "
                             f"{tuple(self.qkv_shape)}, got {described(qkv)}")
        d = self.head_dim
        if (not isinstance(cache_kv, torch.Tensor) or cache_kv.dim() != 5
                or cache_kv.shape[:3] != self.cache_heads or cache_kv.shape[4] != d
                or cache_kv.dtype != self.cache_dtype or cache_kv.device.type != "cpu"
                or cache_kv.stride()[3:] != (d, 1)):
            raise ValueError(f"cache_kv: expected a CPU {self.cache_dtype} view of shape "
                             f"({', '.join(map(str, self.cache_heads))}, S, {d}) with dense "
                             f"slots, got {described(cache_kv)}")
        planes, rows, heads = cache_kv.stride()[:3]
        keys = cache_kv.data_ptr()
        _C.rope_kv_write(qkv.data_ptr(), *self._args, keys, keys + planes * self._element,
                         FLOAT_TYPE_CODES[self.cache_dtype], rows, heads, cache_kv.shape[3],
                         self._q_out)
