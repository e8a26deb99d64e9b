"""How the packed inference pass (`tlt_core.model.packed`) holds each weight matrix, and the one
product it needs from it: `matmul(x, weight) = x @ W.T (+ bias)`.

Three layouts, one per regime, chosen by `choose_layout` (or forced: `Transformer.
inference_layout`):

- "fold" (small float32 models on the CPU): transposed copies with the RMSNorm weights folded
  in, used with `torch.mm` / `addmm`. A small model's step is bound by per-op dispatch, and
  folding saves ops.
- "onednn" (bfloat16, and larger float32 models, on the CPU): each matrix prepacked once in
  oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`; float32 ones with the
  norms folded in first) and multiplied with `_linear_pointwise`. In bf16 the same bits as
  `F.linear`, which reorders the weight on every call; prepacking once makes SmolLM2-135M's
  whole bf16 decoding step 1.4x faster at batch 1 and 1.2x at batch 32 on this project's CPUs
  (`python bench/profile_step.py --model DIR`).
- "panels" (float32 models on a CPU with AVX2 + FMA, and bfloat16 ones where oneDNN has no
  bfloat16 product): each matrix packed in panels of 16 output features
  (tlt_core.ops.panel_matmul), which read each weight once at close to the memory's rate (a
  bfloat16 weight widened as it is loaded) and take the residual add in the product, as "fold"
  does. In float32 they serve products of up to `PANEL_MAX_ROWS` rows (a decode step's rows, a
  speculative step's trees) with the RMSNorm weights folded in; beside them a wide pack for
  prefill (oneDNN's, or fold's for a model small enough that fold beats oneDNN), twice one copy
  in all. In bfloat16 the weights stay the model's (folding would round them) and the panels
  serve every product: the alternative on such a CPU, PyTorch's bfloat16 fallback, is 2.4x slower
  at one row and 10x at 64 (SmolLM2-135M's layers, 2 AVX2 cores). On a CPU with AVX512-BF16
  bfloat16 weights pack in pairs (`pack_panels(W, pairs=True)`), multiplied by its dot-product
  instruction, beside oneDNN's pack for prefill: on SmolLM2-135M's layers (2 Zen 5 cores) they
  beat oneDNN's prepacked products at every row count a decode step or a tree has
  (`python bench/panel_layers.py`).
- "views" (CUDA, or any copy over the memory budget): the parameters themselves, no copy.
  q|k|v and gate|up run as one matmul when the parameters are adjacent views of one tensor
  (`fuse_projections_`, which `load_checkpoint` applies), else as separate matmuls.

A copy ("fold", "onednn") is made only while it costs at most `COPY_BUDGET_SHARE` of the
machine's memory; above it the pass falls back to "views", so a 7B model is never held twice.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt_core.ops.panel_matmul import (launch as launch_panels, pack_panels, pairs_vectorised,
                                       vectorised)

LAYOUTS = ("auto", "fold", "onednn", "panels", "views")
COPY_BUDGET_SHARE = 0.25  # of physical memory: the most a packed copy may take
# Below this many bytes of layer weights a float32 model's step is dispatch-bound and "fold"
# (fewer ops) wins; above it oneDNN's prepacked products do. Decoding tokens/s of onednn over
# fold (bench/profile_step.py --dtype float32): SmolLM2-135M (400 MiB) 1.8x at batch 1, 2.4x at
# 32; the embedded model (6 MiB) 0.6x at batch 1, 0.9x at 32.
ONEDNN_MIN_BYTES = 64 << 20
# Below this many bytes of float32 weights "fold" stays the choice: they stay in the CPU's caches
# from one step to the next, where reading them once gains little (the embedded model, 6 MiB,
# `python bench/profile_step.py --batch 1,8,32`: fold 1.02x panels at batch 1, panels 1.15x at
# 8, fold 1.01x at 32); above it they stream from memory on every step, the panels' regime
# (SmolLM2-135M's drafter, a 14 MiB layer and a 19 MiB head: one drafting level 1.9x faster at
# batch 1 than in fold, 3.1x at batch 4).
PANELS_MIN_BYTES = 8 << 20
# Products of at most this many rows use the panels; wider ones (prefill) the wide pack. Against
# oneDNN on SmolLM2-135M's layer matrices, cold in cache, 2 AVX2 cores: 1.6x at 5 rows, 1.5x at
# 8, 1.3x at 16, 1.1x at 32 to 80, 1.06x at 128, 1.01x at 160 (the panels' micro-kernel has no
# GEMM's cache blocking).
PANEL_MAX_ROWS = 128


def panels_wide_layout(model_bytes: int, dtype: torch.dtype = torch.float32) -> str | None:
    """The layout of the panels layout's wide products for a model of `model_bytes` of `dtype`
    matrices. float32: oneDNN's where it beats fold (ONEDNN_MIN_BYTES), else fold's. bfloat16:
    oneDNN's where it multiplies bfloat16, else None (the panels themselves)."""
    if dtype == torch.bfloat16:
        return "onednn" if onednn_supports(dtype) else None
    return ("onednn" if model_bytes >= ONEDNN_MIN_BYTES and onednn_supports(torch.float32)
            else "fold")


@dataclass(frozen=True, eq=False)
class PanelWeight:
    """A matrix W (out_features, in) in the "panels" layout: its panels (pack_panels) and, for
    products wider than PANEL_MAX_ROWS rows, its pack in `wide_layout` (None: the panels serve
    every product)."""

    panels: torch.Tensor  # (ceil(out / 16), in, 16), or in pairs (ceil(out / 16), in / 2, 16, 2)
    wide: torch.Tensor | None  # pack_matrix(W, wide_layout)
    wide_layout: str | None  # panels_wide_layout's: "onednn", "fold" or None
    out_features: int

    @property
    def nbytes(self) -> int:
        wide = (0 if self.wide is None  # a oneDNN tensor has no .nbytes
                else self.wide.numel() * self.wide.element_size())
        return self.panels.nbytes + wide


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks and multiplies `dtype` matrices on this CPU. float32: wherever
    torch has oneDNN. bfloat16: only where the CPU has the instructions oneDNN's bf16 path
    needs (avx512bw/vl/dq or avx_ne_convert; an AVX2-only CPU has neither), which torch tells
    only by raising at the reorder, so one tiny product is tried."""
    if not onednn_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), packed, None,
                                           "none", [], "")
    except RuntimeError:
        return False
    return True


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no budget known
        return None


def choose_layout(requested: str, dtype: torch.dtype, device: torch.device,
                  copy_bytes: int) -> str:
    """The layout for weights of `dtype` on `device` whose packed copy would take `copy_bytes`."""
    if requested not in LAYOUTS:
        raise ValueError(f"inference_layout: expected one of {LAYOUTS}, got {requested!r}")
    if requested == "onednn" and (device.type != "cpu" or not onednn_supports(dtype)):
        raise ValueError(f"inference_layout: 'onednn' needs CPU weights and a torch whose "
                         f"oneDNN multiplies {dtype} on this CPU; use 'auto' or 'views'")
    if requested == "fold" and dtype != torch.float32:
        raise ValueError(f"inference_layout: 'fold' needs float32 weights, got {dtype}")
    if requested == "panels" and (device.type != "cpu"
                                  or dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"inference_layout: 'panels' needs float32 or bfloat16 weights on the "
                         f"CPU, got {dtype} on {device}")
    if requested != "auto":
        return requested
    if device.type != "cpu":
        return "views"
    memory = physical_memory_bytes()
    if memory is not None and copy_bytes > COPY_BUDGET_SHARE * memory:
        return "views"
    if (dtype == torch.float32 and copy_bytes >= PANELS_MIN_BYTES and vectorised()
            and (memory is None or 2 * copy_bytes <= COPY_BUDGET_SHARE * memory)):
        return "panels"
    if dtype == torch.bfloat16 and vectorised() and not onednn_supports(dtype):
        return "panels"
    if (dtype == torch.bfloat16 and pairs_vectorised()
            and (memory is None or 2 * copy_bytes <= COPY_BUDGET_SHARE * memory)):
        return "panels"
    if dtype == torch.float32 and (copy_bytes < ONEDNN_MIN_BYTES or not onednn_supports(dtype)):
        return "fold"
    if onednn_supports(dtype):
        return "onednn"
    return "views"


def pack_matrix(weight: torch.Tensor, layout: str, model_bytes: int | None = None
                ) -> torch.Tensor | PanelWeight:
    """`weight` (out, in) in the layout's form: transposed (fold), prepacked (onednn), in panels
    (panels; its wide pack as `panels_wide_layout(model_bytes)`, the bytes of all the matrices
    packed with it, by default its own) or as is."""
    if layout == "panels":
        weight = weight.contiguous()
        wide = panels_wide_layout(weight.nbytes if model_bytes is None else model_bytes,
                                  weight.dtype)
        pairs = weight.dtype == torch.bfloat16 and pairs_vectorised()
        return PanelWeight(pack_panels(weight, pairs=pairs),
                           None if wide is None else pack_matrix(weight, wide), wide,
                           weight.shape[0])
    if layout == "fold":
        return weight.t().contiguous()  # (in, out)
    if layout == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return weight


def matmul(x: torch.Tensor, packed: torch.Tensor | PanelWeight, layout: str,
           bias: torch.Tensor | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ W.T (+ bias) (+ addend (M, out)) -> (M, out), for `packed` =
    pack_matrix(W, layout). x and addend are the pass's own activations, of the weights' dtype,
    in the panels layout, so they are not checked again here (tlt_core.ops.panel_matmul checks a
    caller's)."""
    if layout == "panels":
        if x.dtype != packed.panels.dtype:  # the kernel reads x as the panels' element type
            raise ValueError(f"x: expected {packed.panels.dtype} like the weight, got {x.dtype}")
        rows = x.shape[0]
        if rows > PANEL_MAX_ROWS and packed.wide is not None:
            return matmul(x, packed.wide, packed.wide_layout, bias, addend)
        x = x.contiguous()
        out = torch.empty(rows, packed.out_features, dtype=x.dtype, device=x.device)
        return launch_panels(x, packed.panels, packed.out_features, bias,
                             None if addend is None else addend.contiguous(), out)
    if addend is not None:
        if layout == "fold":
            out = torch.addmm(addend, x, packed)
            return out if bias is None else out + bias
        return addend + matmul(x, packed, layout, bias)
    if layout == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if layout == "fold":
        return torch.mm(x, packed) if bias is None else torch.addmm(bias, x, packed)
    return F.linear(x, packed, bias)


class PackedMatrix:
    """One matrix multiplied on its own (the target's LM head, the drafter's fc and head) in a
    weight layout, packed again only when the source changed. The layout is the caller's (the
    target's head follows its layers') or, by default, "onednn" where choose_layout picks it and
    the tensor itself otherwise. Why: in bf16 on the CPU, F.linear reorders the weight into
    oneDNN's blocked layout on every call, which for a drafter's head costs more than the
    product itself. "fold" is never used for a lone product: its transposed copy saves no op.

    The source is identified by its storage, shape, strides and version counter, and a
    reference to it is kept, so its memory cannot be reused by another tensor while the pack is
    held: an optimizer step, a load_state_dict or a regathered head is seen by the next call. An
    inference tensor keeps no version counter: one is taken as unchanged while it lives (the
    drafter's gathered head rows are replaced, never written in place)."""

    def __init__(self):
        self.layout = "views"
        self._source: torch.Tensor | None = None
        self._key: tuple = ()
        self._packed: torch.Tensor | None = None
        # bumped when the pack is other memory than before (in the views layout: the source
        # was replaced, not written in place): a CUDA graph that read the old one is stale
        self.generation = 0

    def __deepcopy__(self, memo) -> PackedMatrix:
        """An empty pack: the pack is a cache of its owner's weight, which a copied owner packs
        afresh from its own (and a oneDNN-layout tensor cannot be copied at all)."""
        return PackedMatrix()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 layout: str | None = None) -> torch.Tensor:
        """x (M, in) @ weight.T (+ bias) -> (M, out), weight (out, in); layout: "onednn",
        "panels" or "views" ("fold" means views here), None: chosen for the weight."""
        return matmul(x, self.refresh(weight, layout), self.layout, bias)

    def refresh(self, weight: torch.Tensor, layout: str | None = None) -> torch.Tensor:
        """The pack of `weight` (arguments as in __call__), packed again if it changed."""
        version = None if weight.is_inference() else weight._version
        key = (weight.data_ptr(), weight.shape, weight.stride(), version, weight.dtype,
               weight.device, layout)
        if self._source is None or key != self._key:
            if layout is None:
                layout = choose_layout("auto", weight.dtype, weight.device, weight.nbytes)
            # the old pack's address, where it has one (a oneDNN tensor has no storage)
            before = None if self._packed is None else (self._packed.data_ptr()
                                                        if self.layout == "views" else -1)
            self.layout = layout if layout in ("onednn", "panels") else "views"
            self._packed = None  # the old pack is freed before the new one is built
            with torch.no_grad():
                self._packed = pack_matrix(weight.detach(), self.layout)
            if before is None or self.layout != "views" or self._packed.data_ptr() != before:
                self.generation += 1
            self._source, self._key = weight, key
        return self._packed

    def copy_bytes(self) -> int:
        """Memory the pack takes beyond its source (0 when it is the source)."""
        if self._packed is None or self.layout == "views":
            return 0
        if isinstance(self._packed, PanelWeight):
            return self._packed.nbytes
        return self._packed.numel() * self._packed.element_size()
