"""The inference pass with a KV cache (`Transformer.step`, `Transformer.next_token_logits`),
over weights packed for it.

Decoding a small model on a CPU is bound by per-op dispatch (5-10 us an op), not arithmetic, so
this pass spends the fewest ops per layer that compute what `Transformer.forward` computes: q, k
and v from one matmul, gate and up from one, RoPE for q and k together as
`x * cos + roll(x, d/2) * sin_signed`, K and V written with one indexed store, and no attention
mask when every row has the same length (a batch of one always does). In the "fold" and
"panels" layouts the residual adds ride in the product (`addmm`, the panel kernel's addend);
in float32 the RMSNorm weights are folded into the matmul after them (the norm is then
`x * rsqrt(|x|^2 / H + eps)`, four cheap ops where `F.rms_norm` dispatches seven), and in
bfloat16 on the CPU each norm is one kernel call (tlt_core.ops.add_rms_norm).

How the weights are held is a layout (tlt_core.model.weight_layout): copies made for speed ("fold",
"onednn", "panels"; the copies are at most a quarter of the machine's memory) or the parameters
themselves ("views", no copy). The parameters stay the one source of truth: a copy is rebuilt
whenever any of them changed (a tensor's storage and version counter identify its contents), so an
optimizer step, a load_state_dict or a .to() is seen by the next pass without anyone calling a
refresh. In the views layout (the GPU's) a changed pack is refreshed in place: its few copies
(joined biases, q/k norms) are written into the tensors already held, so a CUDA graph that captured
the pass reads the new weights; only when that is impossible (a parameter replaced by a tensor of
another shape, a copying layout) is the pack rebuilt and `generation` bumped, which tells graph
owners to capture again. The pack holds no autograd history: the packed pass is for inference.
Logits are computed only at the positions a caller asks for (prefill needs each row's last).

The drafter runs its one layer through the same code (PackedLayers, run_layers).

Shapes: B rows, T new tokens per row, H hidden size, d head_dim, H_q / H_kv query / key-value
heads, I intermediate size, S cache slots read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import tlt_core.ops as ops
from tlt_core.model.attention_plan import AttentionPlan, attention_plan
from tlt_core.model.weight_layout import (PANEL_MAX_ROWS, PackedMatrix, PanelWeight,
                                         choose_layout, matmul, pack_matrix)
from tlt_core.ops.decoder_layers import DecoderLayers, DecoderLayerWeights, DecoderShape
from tlt_core.ops.panel_matmul import panel_shape
from tlt_core.ops.rms_norm import launch as launch_rms_norm
from tlt_core.ops.silu_mul import launch as launch_silu_mul


@dataclass(frozen=True)
class PackedLayer:
    """One decoder layer's weights in a weight layout (tlt_core.model.weight_layout). A joined
    matrix is one packed tensor, or (views layout, parameters not adjacent) the parts' tuple."""

    layout: str
    qkv: torch.Tensor | tuple[torch.Tensor, ...]  # [q | k | v] projections, (H_q + 2 H_kv) d out
    qkv_bias: torch.Tensor | None  # ((H_q + 2 H_kv) d,)
    o: torch.Tensor  # H_q d -> H
    o_bias: torch.Tensor | None  # (H,)
    gate_up: torch.Tensor | tuple[torch.Tensor, ...]  # [gate | up], 2 I out
    down: torch.Tensor  # I -> H
    qk_norm: torch.Tensor | None  # (H_q + H_kv, d): q_norm's weight per q head, k_norm's per k head
    # None when folded into qkv / gate_up (float32 weights); else the layer's own RMSNorm, which
    # normalises in float32 whatever the weights' dtype, as transformers does. A layer without
    # an input norm (nn.Identity: the EAGLE-1 drafter) keeps its Identity here: no
    # normalisation at all.
    input_norm: nn.Module | None
    post_attention_norm: nn.Module | None


def _pack_layer(layer: nn.Module, num_heads: int, num_kv_heads: int, layout: str,
                model_bytes: int) -> PackedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    # Folding the norms' weights needs float32 matrices (a bf16 product would round them)
    fold = layout == "fold" or (layout in ("onednn", "panels")
                                and attn.q_proj.weight.dtype == torch.float32)
    no_input_norm = isinstance(layer.input_layernorm, nn.Identity)
    # rms_norm(x) * w @ W.T == (x * rsqrt(...)) @ (W * w).T: the norm's weight scales W's inputs
    input_scale = layer.input_layernorm.weight if fold and not no_input_norm else None
    post_scale = layer.post_attention_layernorm.weight if fold else None
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = _adjacent((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
        if qkv_bias is None:
            qkv_bias = torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
    qk_norm = None
    if attn.qk_norm:
        qk_norm = torch.cat((attn.q_norm.weight.expand(num_heads, -1),
                             attn.k_norm.weight.expand(num_kv_heads, -1)))
    return PackedLayer(
        layout=layout,
        qkv=_joined((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), input_scale,
                    layout, model_bytes),
        qkv_bias=qkv_bias, o=pack_matrix(attn.o_proj.weight, layout, model_bytes),
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.clone(),
        gate_up=_joined((mlp.gate_proj.weight, mlp.up_proj.weight), post_scale, layout,
                        model_bytes),
        down=pack_matrix(mlp.down_proj.weight, layout, model_bytes), qk_norm=qk_norm,
        input_norm=layer.input_layernorm if no_input_norm or not fold else None,
        post_attention_norm=None if fold else layer.post_attention_layernorm)


def _joined(weights: tuple[torch.Tensor, ...], scale: torch.Tensor | None, layout: str,
            model_bytes: int) -> torch.Tensor | PanelWeight | tuple[torch.Tensor, ...]:
    """The (out, in) matrices stacked along out, in `layout` (scale: a folded norm weight;
    model_bytes: as pack_matrix's)."""
    if layout == "views":
        fused = _adjacent(weights)
        return weights if fused is None else fused
    stacked = torch.cat(weights)
    return pack_matrix(stacked if scale is None else stacked * scale, layout, model_bytes)


def _adjacent(parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """parts stacked along dim 0 as a view, when they already lie back to back in one storage
    (Transformer.fuse_projections_); else None."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if (not part.is_contiguous() or part.shape[1:] != first.shape[1:]
                or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or part.storage_offset() != offset):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


class PackedLayers:
    """Packed copies of decoder layers, rebuilt when any of their parameters changed."""

    def __init__(self, layers: Callable[[], Sequence[nn.Module]], config,
                 layout: Callable[[], str] = lambda: "auto"):
        self.layers_of = layers  # called on refresh: the modules may be replaced (assign=True)
        self.config = config
        self.requested_layout = layout  # called on refresh: the owner's current request
        self.layout = "views"
        self.packed: list[PackedLayer] = []
        # Where each layer parameter lives ((module._parameters, name)) and what it held when
        # packed: reading them back per pass costs ~10 us, walking parameters() ~500 us.
        self.sources: list[tuple[dict, str]] = []
        self.key: tuple = ()
        self.eps: torch.Tensor | None = None  # () float32 on the weights' device
        self.generation = 0  # bumped when the packed tensors are replaced, not refreshed in place
        self._param_storages: set[int] = set()  # the parameters' storages when last packed
        # True while a caller that leaves the parameters alone holds the pack
        # (Transformer.inference_pack_held): get() then skips the key. Right after a pass has
        # streamed the weights through the caches, reading back SmolLM2's 270 parameters'
        # pointers and versions costs ~0.4 ms, 4% of its one-token pass (~40 us when warm).
        self.held = False
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin_signed
        # decoder_kernel's, and the pack it was built from
        self._kernel: DecoderLayers | None = None
        self._kernel_of: list[PackedLayer] | None = None

    def __deepcopy__(self, memo) -> PackedLayers:
        """An empty pack reading the copied owner's layers (the callables are bound methods,
        which deepcopy maps to the copy): the pack is a cache of the weights, packed afresh
        from the copy's own, and a oneDNN-layout tensor cannot be copied at all."""
        return PackedLayers(copy.deepcopy(self.layers_of, memo), self.config,
                            copy.deepcopy(self.requested_layout, memo))

    def rope(self, rotary: nn.Module, positions: torch.Tensor, bound: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed (B, T, 1, d) at positions (all < bound), looked up in tables the
        rotary module fills (the same float32 math, two index ops instead of eight)."""
        self.reserve_rope(rotary, bound, dtype, positions.device)
        cos, sin_signed = self.rope_tables
        return cos[positions], sin_signed[positions]

    def reserve_rope(self, rotary: nn.Module, bound: int, dtype: torch.dtype,
                     device: torch.device) -> None:
        """Tables for positions < bound. A graph owner reserves its largest bound before
        capturing: a table grown later would be a new tensor that earlier graphs do not read."""
        if self.rope_tables is None or self.rope_tables[0].shape[0] < bound or \
                self.rope_tables[0].dtype != dtype or self.rope_tables[0].device != device:
            held = 0 if self.rope_tables is None else self.rope_tables[0].shape[0]
            size = max(bound, 2 * held, 256)
            cos, sin = rotary(torch.arange(size, device=device), dtype)  # (P, d)
            half = cos.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self.rope_tables = cos[:, None], sin_signed[:, None]  # (P, 1, d) each

    def _key(self) -> tuple:
        return tuple((params[name].data_ptr(), params[name]._version)
                     for params, name in self.sources) + (self.requested_layout(),)

    def get(self) -> list[PackedLayer]:
        if self.sources and (self.held or self._key() == self.key):
            return self.packed
        config, layers = self.config, list(self.layers_of())
        self.sources = [(module._parameters, name) for layer in layers for module in layer.modules()
                        for name, param in module._parameters.items() if param is not None]
        weight = layers[0].mlp.down_proj.weight
        copy_bytes = sum(params[name].nbytes for params, name in self.sources)
        layout = choose_layout(self.requested_layout(), weight.dtype, weight.device, copy_bytes)
        if self.eps is None or self.eps.device != weight.device:
            self.eps = torch.tensor(config.rms_norm_eps, device=weight.device)
        old = self.packed if layout == self.layout == "views" else []
        self.packed, self.layout = [], layout  # a copying layout's old pack is freed first
        with torch.no_grad():
            fresh = [_pack_layer(layer, config.num_heads, config.num_kv_heads, layout,
                                 copy_bytes) for layer in layers]
            if old and _refresh_in_place(old, fresh, self._param_storages):
                fresh = old
            else:
                self.generation += 1
        self._param_storages = {params[name].untyped_storage().data_ptr()
                                for params, name in self.sources}
        self.packed, self.key = fresh, self._key()
        return self.packed

    def decoder_kernel(self, packed: list[PackedLayer] | None = None) -> DecoderLayers | None:
        """The pack (get()'s, or `packed` when the caller has just read it) as one
        tlt_core.ops.decoder_layers call, or None where some layer is not bf16 panels with its
        own RMSNorms (or no input norm); built once per pack."""
        packed = self.get() if packed is None else packed
        if self._kernel_of is not packed:
            self._kernel_of, self._kernel = packed, _decoder_kernel(packed, self.config)
        return self._kernel

    def copy_bytes(self) -> int:
        """Memory the pack takes beyond the parameters (0 for the views layout)."""
        if self.layout == "views":
            return 0
        return sum(_nbytes(getattr(packed, name)) for packed in self.packed
                   for name in ("qkv", "o", "gate_up", "down"))


def _decoder_kernel(packed: list[PackedLayer], config) -> DecoderLayers | None:
    H, d, I = config.hidden_size, config.head_dim, config.intermediate_size
    H_q, H_kv = config.num_heads, config.num_kv_heads
    sizes = (((H_q + 2 * H_kv) * d, H), (H, H_q * d), (2 * I, H), (H, I))  # (out, in) each

    def fits(weight, out_features: int, in_features: int) -> bool:
        return (isinstance(weight, PanelWeight) and weight.panels.dtype == torch.bfloat16
                and weight.panels.device.type == "cpu" and weight.out_features == out_features
                and weight.panels.shape == panel_shape(out_features, in_features,
                                                       weight.panels.dim() == 4))

    def eligible(layer: PackedLayer) -> bool:
        products = (layer.qkv, layer.o, layer.gate_up, layer.down)
        norms = (layer.post_attention_norm,) + (
            () if isinstance(layer.input_norm, nn.Identity) else (layer.input_norm,))
        return (layer.layout == "panels"
                and (layer.qk_norm is None or layer.qk_norm.dtype == torch.bfloat16)
                and all(fits(w, *size) for w, size in zip(products, sizes))
                and all(_bf16_rms_norm(norm) for norm in norms))

    if not packed or not all(eligible(layer) for layer in packed):
        return None
    shape = DecoderShape(H, H_q, H_kv, d, I)
    return DecoderLayers(shape, [DecoderLayerWeights(
        input_norm=None if isinstance(layer.input_norm, nn.Identity)
        else layer.input_norm.weight.detach(),
        input_eps=getattr(layer.input_norm, "eps", 0.0),
        qkv=layer.qkv.panels, qkv_bias=layer.qkv_bias, o=layer.o.panels, o_bias=layer.o_bias,
        post_attention_norm=layer.post_attention_norm.weight.detach(),
        post_attention_eps=layer.post_attention_norm.eps, gate_up=layer.gate_up.panels,
        down=layer.down.panels, q_norm=None if layer.qk_norm is None else layer.qk_norm[0],
        k_norm=None if layer.qk_norm is None else layer.qk_norm[H_q],
        qk_eps=config.rms_norm_eps) for layer in packed])


def _refresh_in_place(old: list[PackedLayer], fresh: list[PackedLayer],
                      param_storages: set[int]) -> bool:
    """Writes `fresh`'s values into `old`'s tensors where those are the pack's own copies
    (param_storages: the storages of the parameters `old` was packed from; a view of one must
    be a view of the same memory in `fresh`: never written through); False, with nothing
    written, when some part cannot be refreshed (another shape, a replaced parameter, another
    module or layout)."""
    pairs = []

    def collect(a, b) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if (a.shape, a.stride(), a.dtype, a.device) != (b.shape, b.stride(), b.dtype, b.device):
                return False
            if a.data_ptr() == b.data_ptr():
                return True
            if a.untyped_storage().data_ptr() in param_storages:  # a parameter's, replaced
                return False
            pairs.append((a, b))
            return True
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(collect(x, y) for x, y in zip(a, b))
        return a is b or a == b  # modules, layout names, None

    if len(old) != len(fresh) or not all(
            collect(getattr(a, name), getattr(b, name)) for a, b in zip(old, fresh)
            for name in PackedLayer.__dataclass_fields__):
        return False
    for a, b in pairs:
        a.copy_(b)
    return True


def _nbytes(tensor: torch.Tensor | PanelWeight) -> int:
    if isinstance(tensor, PanelWeight):
        return tensor.nbytes
    if tensor.layout == torch._mkldnn:  # opaque: its element count is the logical one
        return tensor.numel() * tensor.element_size()
    return tensor.nbytes


def plan_for(input_ids: torch.Tensor, cache, tree_mask: torch.Tensor | None,
             read_len: int | None = None) -> AttentionPlan:
    """attention_plan, short-cut when every row has the same length (a batch of one always
    does): one token per row needs no mask at all, several a causal mask shared by the rows.
    The lengths come from the cache's host mirror (no device read). read_len: attention_plan's
    fixed-shape plan, with no short cut (a captured graph replays for any lengths)."""
    B, T = input_ids.shape
    if read_len is not None or tree_mask is not None:
        return attention_plan((B, T), cache, tree_mask, input_ids.device, read_len=read_len)
    lengths = cache.lengths
    shortest, longest = int(cache.host_lengths.min()), int(cache.host_lengths.max())
    if T > 1 and shortest != longest:
        return attention_plan((B, T), cache, None, input_ids.device)
    if longest + T > cache.shape.max_len:
        cache.check_room(T)  # raises, naming the row
    device, read_len = input_ids.device, longest + T
    if T == 1:  # no mask when all rows are equal; else each row's prefix and its new slot
        mask = (None if shortest == longest else
                (torch.arange(read_len, device=device) <= lengths[:, None])[:, None, None, :])
        return AttentionPlan(mask, lengths[:, None], read_len)
    # Equal rows, causal: new token i sees slots <= longest + i, for every row alike.
    mask = torch.ones(T, read_len, dtype=torch.bool, device=device).tril(longest)
    return AttentionPlan(mask[None, None], lengths[:, None] + torch.arange(T, device=device),
                         read_len)


# False: the tensor-op path on the CPU too (what tests and bench/profile_speculative.py compare
# the kernel with; both compute the same bits).
ROPE_KV_KERNEL = True
# Layouts whose products take the residual add (weight_layout.matmul's addend): one op fewer
RESIDUAL_IN_PRODUCT = ("fold", "panels")
# False: attention through PyTorch's scaled_dot_product_attention on the CPU too (the kernel
# agrees with it to float32 rounding: tlt_core.ops.attention)
ATTENTION_KERNEL = True
# False: the SwiGLU activation as PyTorch's split, silu and multiply on the CPU too (the kernel
# rounds once where PyTorch's bf16 rounds twice: tlt_core.ops.silu_mul)
SILU_MUL_KERNEL = True
# False: bf16 RMSNorms as tensor ops on the CPU too (the kernel's sum of squares may move a
# value by one bf16 place: tlt_core.ops.rms_norm)
RMS_NORM_KERNEL = True


# False: the layers one kernel call at a time from Python on the CPU too (tlt_core.ops.
# decoder_layers calls the same kernels in the same order: the same bits)
DECODER_LAYERS_KERNEL = True


def run_layers(layers: PackedLayers, h: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
               cache: torch.Tensor, plan: AttentionPlan,
               hidden_layers: Sequence[int] = ()) -> tuple[torch.Tensor, dict]:
    """The packed layers over h (B T, H) at positions (B, T); cache[i] is layer i's (2, B,
    H_kv, T_max, d) K/V. Returns (output (B T, H), {layer: (B, T, H) output}); h itself may be
    overwritten."""
    config = layers.config
    (B, T), d = positions.shape, config.head_dim
    H_q, H_kv, half = config.num_heads, config.num_kv_heads, config.head_dim // 2
    cache_dtype = cache.dtype
    pack = layers.get()
    kernel = layers.decoder_kernel(pack) if _whole_pass_kernel(h, cache, B * T) else None
    if kernel is not None:  # bf16 panels on the CPU: every layer in one call
        layers.reserve_rope(rotary, plan.read_len, h.dtype, h.device)
        cos_table, sin_table = (table[:, 0] for table in layers.rope_tables)  # (P, d) each
        h, saved = kernel(h, positions.contiguous(), plan.write_slots.contiguous(), cache,
                          cos_table, sin_table, plan.mask, plan.read_len, hidden_layers)
        return h, {index: out.view(B, T, -1) for index, out in saved.items()}
    same_dtype = cache_dtype == h.dtype  # skip .to() calls: each costs a dispatch
    # On the CPU one kernel call per layer does RoPE, the K/V write and q's layout for
    # attention (tlt_core.ops.rope), set up once for the pass; elsewhere the same math in
    # tensor ops (a GPU replays the pass as a CUDA graph, where ops cost nothing extra).
    fused = (ROPE_KV_KERNEL and h.device.type == "cpu"
             and h.dtype in (torch.float32, torch.bfloat16))
    if fused:
        layers.reserve_rope(rotary, plan.read_len, h.dtype, h.device)
        cos_table, sin_table = (table[:, 0] for table in layers.rope_tables)  # (P, d) each
        q = torch.empty(B, H_q, T, d, dtype=cache_dtype, device=h.device)
        write_rope_kv = ops.RopeKVWriter(cos_table, sin_table, positions.contiguous(),
                                         plan.write_slots.contiguous(), q, H_kv)
    else:
        cos, sin_signed = layers.rope(rotary, positions, plan.read_len, h.dtype)  # (B, T, 1, d)
        rows = torch.arange(B, device=h.device)[:, None]  # (B, 1)
    # Attention over a float32 or bf16 cache on the CPU: one kernel call a layer that reads q as
    # the RoPE kernel wrote it and writes what the o projection reads (tlt_core.ops.attention)
    attend = (ops.DecodeAttention(q, plan.mask, plan.read_len, H_kv, h.dtype)
              if fused and ATTENTION_KERNEL and cache_dtype in (torch.float32, torch.bfloat16)
              else None)
    # bf16 on the CPU: each RMSNorm, with the residual add before it, in one kernel call
    # (tlt_core.ops.rms_norm); elsewhere tensor ops (a GPU replays the pass as a CUDA graph)
    norm_kernel = RMS_NORM_KERNEL and h.device.type == "cpu" and h.dtype == torch.bfloat16
    swiglu_kernel = (SILU_MUL_KERNEL and h.device.type == "cpu"
                     and h.dtype in (torch.float32, torch.bfloat16))
    saved = {}
    for index, packed in enumerate(pack):
        layout = packed.layout
        h, x = _add_norm(h, None, packed.input_norm, layers.eps, norm_kernel)  # (B T, H) each
        qkv = _joined_matmul(x, packed.qkv, layout, packed.qkv_bias)  # (B T, (H_q + 2 H_kv) d)
        qkv = qkv.view(B, T, H_q + 2 * H_kv, d)
        if packed.qk_norm is not None and norm_kernel and packed.qk_norm.dtype == h.dtype:
            # bf16 on the CPU: q's heads, then k's, each one add_rms_norm call over its rows
            # (what the one-call pass does per token)
            for first, count in ((0, H_q), (H_q, H_kv)):
                heads = qkv[:, :, first:first + count].reshape(-1, d).contiguous()  # (B T count, d)
                _, normed = launch_rms_norm(heads, None, packed.qk_norm[first],
                                            config.rms_norm_eps)
                qkv[:, :, first:first + count] = normed.view(B, T, count, d)
        elif packed.qk_norm is not None:
            qkv[:, :, :H_q + H_kv] = F.rms_norm(qkv[:, :, :H_q + H_kv], (d,),
                                                eps=config.rms_norm_eps) * packed.qk_norm
        layer_kv = cache[index]  # (2, B, H_kv, T_max, d)
        if fused:
            write_rope_kv(qkv, layer_kv)  # q: (B, H_q, T, d), cache dtype
        else:
            qk = qkv[:, :, :H_q + H_kv]  # (B, T, H_q + H_kv, d)
            # RoPE in transformers' half-split layout: rotate_half(x) * sin = roll(x) * sin_signed
            qkv[:, :, :H_q + H_kv] = torch.addcmul(qk * cos, qk.roll(half, -1), sin_signed)
            # Advanced indices split by a slice put the index dims first: the target is
            # (B, T, 2, H_kv, d), exactly the k|v part of qkv.
            new_kv = qkv[:, :, H_q:].view(B, T, 2, H_kv, d)
            layer_kv[:, rows, :, plan.write_slots] = (new_kv if same_dtype
                                                      else new_kv.to(cache_dtype))
            q = qkv[:, :, :H_q].transpose(1, 2)  # (B, H_q, T, d)
            q = q if same_dtype else q.to(cache_dtype)
        # Attention in the cache's dtype (kv_cache.cache_dtype), so the cache is read as stored;
        # only q and the output convert where it differs from the model's.
        if attend is not None:
            out = attend(layer_kv)  # (B T, H_q d)
        else:
            keys, values = layer_kv[0, :, :, :plan.read_len], layer_kv[1, :, :, :plan.read_len]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.mask,
                                                 enable_gqa=H_q != H_kv)  # (B, H_q, T, d)
            out = out.transpose(1, 2).reshape(B * T, H_q * d)
            if not same_dtype:
                out = out.to(h.dtype)
        if layout in RESIDUAL_IN_PRODUCT:  # + o_proj folded into the residual add
            h = matmul(out, packed.o, layout, packed.o_bias, addend=h)
            h, x = _add_norm(h, None, packed.post_attention_norm, layers.eps, norm_kernel)
        else:
            h, x = _add_norm(h, matmul(out, packed.o, layout, packed.o_bias),
                             packed.post_attention_norm, layers.eps, norm_kernel)
        gate_up = _joined_matmul(x, packed.gate_up, layout)  # (B T, 2 I)
        if swiglu_kernel and gate_up.is_contiguous():
            act = launch_silu_mul(gate_up)  # (B T, I)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # (B T, I) each
            act = F.silu(gate) * up
        if layout in RESIDUAL_IN_PRODUCT:  # residual + SwiGLU MLP
            h = matmul(act, packed.down, layout, addend=h)
        else:
            h = h + matmul(act, packed.down, layout)
        if index in hidden_layers:
            saved[index] = h.view(B, T, -1)
    return h, saved


def _whole_pass_kernel(h: torch.Tensor, cache: torch.Tensor, rows: int) -> bool:
    """Whether a pass may run as tlt_core.ops.decoder_layers: bf16 on the CPU over a float32 or
    bf16 cache, each kernel the layers call switched on, at most PANEL_MAX_ROWS rows (wider products
    go to the wide pack)."""
    return (DECODER_LAYERS_KERNEL and ROPE_KV_KERNEL and ATTENTION_KERNEL and RMS_NORM_KERNEL
            and SILU_MUL_KERNEL and h.dtype == torch.bfloat16 and h.device.type == "cpu"
            and cache.dtype in (torch.float32, torch.bfloat16) and rows <= PANEL_MAX_ROWS)


def _joined_matmul(x: torch.Tensor, weights: torch.Tensor | tuple[torch.Tensor, ...],
                   layout: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weights, tuple):  # views of parameters that are not adjacent: one matmul each
        out = torch.cat([F.linear(x, weight) for weight in weights], dim=-1)
        return out if bias is None else out + bias
    return matmul(x, weights, layout, bias)


def _add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module | None,
              eps: torch.Tensor | None, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, _norm of it); delta None: (h, _norm(h)). With kernel, a bf16 RMSNorm (a
    module with a weight and an eps: the layer's own) runs as one call of
    tlt_core.ops.add_rms_norm, the add with it."""
    if kernel and _bf16_rms_norm(norm):
        # the pass's own dense bf16 rows and the layer's weight: no check needed
        return launch_rms_norm(h, delta, norm.weight, norm.eps)
    if delta is not None:
        h = h + delta
    return h, _norm(h, norm, eps)


def _norm(h: torch.Tensor, norm: nn.Module | None, eps: torch.Tensor) -> torch.Tensor:
    """RMSNorm of h (B T, H); without its weight when that is folded (norm None); `norm`
    itself when given (the layer's RMSNorm, or an Identity: no norm)."""
    if norm is not None:
        return norm.forward(h)
    size = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # (B T, 1) |h|
    return h * torch.addcmul(eps, size, size, value=1.0 / h.shape[-1]).rsqrt_()


def _bf16_rms_norm(norm: nn.Module | None) -> bool:
    """Whether `norm` is an RMSNorm add_rms_norm runs: a bf16 weight and an eps."""
    weight = getattr(norm, "weight", None)
    return weight is not None and weight.dtype == torch.bfloat16 and hasattr(norm, "eps")


def _final_norm(h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The model's final RMSNorm of h (M, H): in bf16 on the CPU one add_rms_norm call (PyTorch's
    bf16 norm is four ops, 0.1-0.2 ms at a few rows of SmolLM2 on 2 cores), else the module."""
    kernel = (RMS_NORM_KERNEL and h.device.type == "cpu" and h.dtype == torch.bfloat16
              and h.is_contiguous())
    return _add_norm(h, None, norm, None, kernel)[1]


class PackedDecoder:
    """Transformer.step: the target's inference pass over its packed layers (and, in a copying
    layout, a packed LM head)."""

    def __init__(self, model: nn.Module):
        self.model = model
        # Bound methods, not closures over `model`: copy.deepcopy maps a bound method's owner
        # to the copy, while a closure would keep packing the original model's weights.
        self.layers = PackedLayers(self._decoder_layers, model.config, self._requested_layout)
        # the LM head in the layers' layout ("fold": F.linear on the parameter, no copy)
        self.head = PackedMatrix()

    def _decoder_layers(self) -> Sequence[nn.Module]:
        return self.model.model.layers

    def _requested_layout(self) -> str:
        return self.model.inference_layout

    def copy_bytes(self) -> int:
        """Memory the packed copies take beyond the parameters."""
        return self.layers.copy_bytes() + self.head.copy_bytes()

    def refresh(self) -> tuple[int, int]:
        """Brings the pack up to date with the parameters now (a captured graph never runs the
        pass's own check); returns the generations of the layers' and the head's packs, which
        change only when their tensors were replaced."""
        self.layers.get()
        self.head.refresh(self.model.lm_head.weight, self.layers.layout)
        return self.layers.generation, self.head.generation

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                 tree_mask: torch.Tensor | None, hidden_layers: list[int],
                 read_len: int | None = None, logit_index: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Transformer.forward with a cache, for inference: input_ids, positions (B, T) int64;
        returns logits (B, T, V) float32 — or (B, P, V) at logit_index (B, P), the positions
        whose next-token logits the caller uses — and the (B, T, H) outputs of
        `hidden_layers` (non-negative indices). Inputs are checked by the Transformer."""
        model, stack = self.model, self.model.model
        B, T = input_ids.shape
        plan = plan_for(input_ids, cache, tree_mask, read_len)
        h = F.embedding(input_ids.reshape(B * T), stack.embed_tokens.weight)  # (B T, H)
        h, saved = run_layers(self.layers, h, positions, stack.rotary_emb, cache.data, plan,
                              hidden_layers)
        if logit_index is not None:  # only the positions used: (B P, H) instead of (B T, H)
            rows = torch.arange(B, device=h.device)[:, None]  # (B, 1)
            h = h.view(B, T, -1)[rows, logit_index].reshape(-1, h.shape[-1])
        logits = self.head(_final_norm(h, stack.norm), model.lm_head.weight,
                           layout=self.layers.layout).float()  # (B T | B P, V)
        return logits.view(B, -1, logits.shape[-1]), tuple(saved[i] for i in hidden_layers)
