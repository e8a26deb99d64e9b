"""`decode_attention`: a decode step's new tokens attending over one layer's KV cache on the
CPU, in one kernel call that writes the output as the o projection reads it
(csrc/include/tlt/attention.h).

PyTorch's scaled_dot_product_attention costs a small model about 60 us a layer on this
project's CPUs for a few hundred thousand multiply-adds, and its (B, H_q, T, d) output then
needs a transpose, a copy and a narrowing before the o projection. Each query's bits here
depend only on its own q and the slots it sees, so a token verified inside a draft tree gets
the bits it would get decoded alone. The cache float32 or bfloat16 (the model's dtype on the
CPU: tlt_core.model.kv_cache.cache_dtype), q of the cache's dtype, each bfloat16 element widened
exactly (a bfloat16 cache gives the bits a float32 one holding the same values gives, for half
the bytes read); output float32 or bfloat16. CPU tensors only: on a GPU the passes replay as
CUDA graphs.

`DecodeAttention` is the kernel for a whole pass: q, the mask and the output's dtype are
checked once, each layer's call checks only its cache planes.

Shapes: B rows, T new tokens per row, H_q / H_kv query / key-value heads, d head_dim, S cache
slots read.
"""

from __future__ import annotations

import math

import torch

from tlt_core import _C
from tlt_core.ops import _arrays as arr
from tlt_core.ops._cpu_tensors import FLOAT_TYPE_CODES, described


def decode_attention(q: torch.Tensor, cache_kv: torch.Tensor, slots: int,
                     mask: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the first `slots` slots of cache_kv, for q (B, H_q, T,
    d) contiguous and cache_kv (2, B, H_kv, max_len, d) (one layer's keys and values; any
    strided view whose slots are dense rows of d), both float32 or both bfloat16; query head h
    reads KV head h // (H_q / H_kv). mask: None (every query sees every slot read) or bool (B or
    1, 1, T or 1, slots), True where the query sees the slot (what scaled_dot_product_attention's
    attn_mask means). Returns (B T, H_q d) of out_dtype (float32 or bfloat16): row b T + t holds
    query t of row b, heads side by side. A query that sees no slot gets zeros."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected a 4-D torch tensor (B, H_q, T, d), got {described(q)}")
    H_q = q.shape[1]
    if not isinstance(cache_kv, torch.Tensor) or cache_kv.dim() != 5:
        raise ValueError(f"cache_kv: expected a 5-D torch tensor (2, B, H_kv, max_len, d), got "
                         f"{described(cache_kv)}")
    kv_heads = cache_kv.shape[2]
    if kv_heads < 1 or H_q % kv_heads:
        raise ValueError(f"cache_kv: its H_kv = {kv_heads} heads must divide q's H_q = {H_q}")
    return DecodeAttention(q, mask, slots, kv_heads, out_dtype)(cache_kv)


class DecodeAttention:
    """decode_attention with what every layer of a pass shares checked once; call it with each
    layer's cache_kv. It reads q and mask at each call (the pass writes q between calls)."""

    def __init__(self, q: torch.Tensor, mask: torch.Tensor | None, slots: int, kv_heads: int,
                 out_dtype: torch.dtype = torch.float32):
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.layout != torch.strided:
            raise ValueError(f"q: expected a 4-D strided torch tensor (B, H_q, T, d), got "
                             f"{described(q)}")
        if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"q: decode_attention runs on float32 or bfloat16 CPU tensors (on "
                             f"a GPU the passes are CUDA graphs), got {described(q)}")
        arr.require_contiguous(q, "q")
        B, H_q, T, d = q.shape
        if min(H_q, T, d) < 1:
            raise ValueError(f"q: heads, tokens and head_dim must be >= 1, got {tuple(q.shape)}")
        if (not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1
                or H_q % kv_heads):
            raise ValueError(f"kv_heads: must be an int >= 1 dividing H_q = {H_q}, got "
                             f"{kv_heads!r}")
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots: must be an int >= 1, got {slots!r}")
        if out_dtype not in FLOAT_TYPE_CODES:
            raise ValueError(f"out_dtype: must be float32 or bfloat16, got {out_dtype}")
        mask_strides = (0, 0)
        if mask is not None:
            if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                    or mask.layout != torch.strided or mask.device.type != "cpu" or mask.dim() != 4
                    or mask.shape[0] not in (1, B) or mask.shape[1] != 1
                    or mask.shape[2] not in (1, T) or mask.shape[3] != slots
                    or (slots > 1 and mask.stride(3) != 1)):
                raise ValueError(f"mask: expected a CPU bool tensor of shape ({B} or 1, 1, {T} or "
                                 f"1, {slots}) with dense slots, got {described(mask)}")
            mask_strides = (0 if mask.shape[0] == 1 else mask.stride(0),
                            0 if mask.shape[2] == 1 else mask.stride(2))
        self.kv_heads, self.slots, self.out_dtype = kv_heads, slots, out_dtype
        self._held = q, mask  # what the kernel reads
        self._args = (q.data_ptr(), B, H_q, T, d)
        self._kv_dtype = q.dtype  # the cache's, which q shares
        self._element = q.element_size()
        self._mask = (0 if mask is None else mask.data_ptr(), *mask_strides)
        self._scale = 1.0 / math.sqrt(d)
        self._cache_heads, self._head_dim, self._dense = (2, B, kv_heads), d, (d, 1)
        self._out_shape, self._out_type = (B * T, H_q * d), FLOAT_TYPE_CODES[out_dtype]

    def __call__(self, cache_kv: torch.Tensor) -> torch.Tensor:
        # one comparison per property: a pass makes this call once a layer
        try:
            shape, strides = cache_kv.shape, cache_kv.stride()
            good = (cache_kv.dtype == self._kv_dtype and shape[:3] == self._cache_heads
                    and shape[4] == self._head_dim and strides[3:] == self._dense
                    and shape[3] >= self.slots and not cache_kv.is_cuda)
        except (AttributeError, IndexError, TypeError, RuntimeError):  # not a strided tensor
            good = False
        if not good or cache_kv.device.type != "cpu":
            expected = self._cache_heads + (f">= {self.slots}", self._head_dim)
            raise ValueError(f"cache_kv: expected a CPU {self._kv_dtype} view (q's dtype) of "
                             f"shape {expected} with dense slots, got {described(cache_kv)}")
        out = torch.empty(self._out_shape, dtype=self.out_dtype)
        keys = cache_kv.data_ptr()
        _C.decode_attention(*self._args, keys, keys + self._element * strides[0],
                            FLOAT_TYPE_CODES[self._kv_dtype], self.kv_heads, strides[1],
                            strides[2], shape[3], self.slots, *self._mask, self._scale,
                            out.data_ptr(), self._out_type)
        return out
