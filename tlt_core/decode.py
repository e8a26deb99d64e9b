"""The one-token decode step (`Transformer.decode`), over weights packed for it.

Decoding a small model on a CPU is bound by per-op dispatch (5-10 us an op), not arithmetic, so
this step spends the fewest ops per layer that compute what `Transformer.forward` computes for one
new token: q, k and v from one matmul, gate and up from one, both residual adds folded into
`addmm`, float32 RMSNorm weights folded into the matmul after them (the norm itself is then
`x * rsqrt(|x|^2 / H + eps)`, four cheap ops where `F.rms_norm` dispatches seven), RoPE for q and
k together as `x * cos + roll(x, d/2) * sin_signed`, K and V written with
one indexed store, and no attention mask when every row has the same length (a batch of one
always does).

The packed weights are transposed, concatenated copies of the model's parameters. The parameters
stay the one source of truth: the pack is rebuilt whenever any of them changed (a tensor's storage
and version counter identify its contents), so an optimizer step, a load_state_dict or a .to()
is seen by the next decode without anyone calling a refresh. The price is one extra copy of the
decoder layers' weights (the embedding and LM head are used in place). The pack holds no autograd
history: decode is for inference.

Shapes: B rows, H hidden size, d head_dim, H_q / H_kv query / key-value heads, I intermediate
size, S cache slots read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PackedLayer:
    qkv: torch.Tensor  # (H, (H_q + 2 H_kv) d): [q | k | v] projections, transposed
    qkv_bias: torch.Tensor | None  # ((H_q + 2 H_kv) d,)
    o: torch.Tensor  # (H_q d, H)
    o_bias: torch.Tensor | None  # (H,)
    gate_up: torch.Tensor  # (H, 2 I): [gate | up], transposed
    down: torch.Tensor  # (I, H)
    qk_norm: torch.Tensor | None  # (H_q + H_kv, d): q_norm's weight per q head, k_norm's per k head
    # None when folded into qkv / gate_up (float32 weights); else the layer's own RMSNorm, which
    # normalises in float32 whatever the weights' dtype, as transformers does.
    input_norm: nn.Module | None
    post_attention_norm: nn.Module | None


def _pack_layer(layer: nn.Module, num_heads: int, num_kv_heads: int) -> PackedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    fold = attn.q_proj.weight.dtype == torch.float32
    # rms_norm(x) * w @ W.T == (x * rsqrt(...)) @ (W * w).T: the norm's weight scales W's inputs
    input_scale = layer.input_layernorm.weight if fold else 1.0
    post_scale = layer.post_attention_layernorm.weight if fold else 1.0
    qkv = (torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
           * input_scale).t()
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
    qk_norm = None
    if attn.qk_norm:
        qk_norm = torch.cat((attn.q_norm.weight.expand(num_heads, -1),
                             attn.k_norm.weight.expand(num_kv_heads, -1)))
    return PackedLayer(
        qkv=qkv.contiguous(), qkv_bias=qkv_bias, o=attn.o_proj.weight.t().contiguous(),
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.clone(),
        gate_up=(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)) * post_scale
                 ).t().contiguous(),
        down=mlp.down_proj.weight.t().contiguous(), qk_norm=qk_norm,
        input_norm=None if fold else layer.input_layernorm,
        post_attention_norm=None if fold else layer.post_attention_layernorm)


class PackedDecoder:
    """Runs one decode step of a `tlt_core.model.Transformer`; owned by it, rebuilt on change."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: list[PackedLayer] = []
        # Where each layer parameter lives ((module._parameters, name)) and what it held when
        # packed: reading them back per step costs ~10 us, walking parameters() ~500 us.
        self.sources: list[tuple[dict, str]] = []
        self.key: tuple = ()
        self.eps: torch.Tensor | None = None  # () float32 on the weights' device

    def _key(self) -> tuple:
        return tuple((params[name].data_ptr(), params[name]._version)
                     for params, name in self.sources)

    def _refresh(self) -> None:
        if self.sources and self._key() == self.key:
            return
        config, layers = self.model.config, self.model.model.layers
        self.sources = [(module._parameters, name) for module in layers.modules()
                        for name, param in module._parameters.items() if param is not None]
        self.eps = torch.tensor(config.rms_norm_eps, device=layers[0].mlp.down_proj.weight.device)
        with torch.no_grad():
            self.layers = [_pack_layer(layer, config.num_heads, config.num_kv_heads)
                           for layer in layers]
        self.key = self._key()

    def __call__(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """tokens (B,) int64, row b's token at position cache.lengths[b], written to that slot;
        returns (B, V) float32 logits. Inputs are checked by Transformer.decode."""
        self._refresh()
        model, config = self.model, self.model.config
        stack = model.model
        B, d = tokens.shape[0], config.head_dim
        H_q, H_kv, half = config.num_heads, config.num_kv_heads, config.head_dim // 2
        lengths = cache.lengths  # (B,) the new token's slot and position
        shortest, longest = (int(n) for n in torch.aminmax(lengths))  # the step's one host sync
        read_len = longest + 1
        if read_len > cache.shape.max_len:
            cache.check_room(torch.ones_like(lengths))  # raises, naming the row
        mask = None  # rows of equal length read exactly their prefix and the new slot
        if shortest != longest:
            slots = torch.arange(read_len, device=tokens.device)  # (S,)
            mask = (slots <= lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
        cos, sin = stack.rotary_emb(lengths, model.lm_head.weight.dtype)  # (B, d) each
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]  # (B, 1, d)
        cos = cos[:, None]  # (B, 1, d)
        rows = torch.arange(B, device=tokens.device)
        h = F.embedding(tokens, stack.embed_tokens.weight)  # (B, H)
        for index, packed in enumerate(self.layers):
            x = self._norm(h, packed.input_norm)  # (B, H)
            qkv = (torch.mm(x, packed.qkv) if packed.qkv_bias is None
                   else torch.addmm(packed.qkv_bias, x, packed.qkv))
            qkv = qkv.view(B, H_q + 2 * H_kv, d)
            qk = qkv[:, :H_q + H_kv]  # (B, H_q + H_kv, d)
            if packed.qk_norm is not None:
                qk = F.rms_norm(qk, (d,), eps=config.rms_norm_eps) * packed.qk_norm
            # RoPE in transformers' half-split layout: rotate_half(x) * sin = roll(x) * sin_signed
            qkv[:, :H_q + H_kv] = torch.addcmul(qk * cos, qk.roll(half, -1), sin_signed)
            layer_kv = cache.data[index]  # (2, B, H_kv, T_max, d)
            # Advanced indices split by a slice put the index dim first: the target is
            # (B, 2, H_kv, d), exactly the k|v part of qkv.
            layer_kv[:, rows, :, lengths] = qkv[:, H_q:].view(B, 2, H_kv, d).to(layer_kv.dtype)
            out = F.scaled_dot_product_attention(
                qkv[:, :H_q, None], layer_kv[0, :, :, :read_len].to(qkv.dtype),
                layer_kv[1, :, :, :read_len].to(qkv.dtype), attn_mask=mask,
                enable_gqa=H_q != H_kv)  # (B, H_q, 1, d)
            h = torch.addmm(h, out.view(B, H_q * d), packed.o)  # residual + o_proj
            if packed.o_bias is not None:
                h = h + packed.o_bias
            gate_up = torch.mm(self._norm(h, packed.post_attention_norm), packed.gate_up)
            gate, up = gate_up.chunk(2, dim=-1)  # (B, I) each
            h = torch.addmm(h, F.silu(gate) * up, packed.down)  # residual + SwiGLU MLP
        return F.linear(stack.norm.forward(h), model.lm_head.weight).float()  # (B, V)

    def _norm(self, h: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        """RMSNorm of h (B, H); without its weight when that is folded (norm None)."""
        if norm is not None:
            return norm.forward(h)
        norm = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # (B, 1) |h|
        return h * torch.addcmul(self.eps, norm, norm, value=1.0 / h.shape[-1]).rsqrt_()
