"""The target model: an eager PyTorch decoder for the Llama, Qwen2 and Qwen3 families.

The model maps token ids + positions + KV cache to logits and hidden states; it knows nothing
about tokenizers or sampling. One `forward` serves every pass the toolkit makes:

- no cache: causal self-attention over the T tokens (training, full-sequence recomputation);
  `tree_mask`, if given, replaces the causal mask;
- with a `tlt_core.model.KVCache`: new token i of row b writes its K/V to slot
  `cache.lengths[b] + i` of every layer and attends to the row's committed slots plus the new
  tokens `tree_mask[b, i]` allows (default causal) — prefill, plain decoding and tree
  verification alike. `cache.lengths` is never changed: the engine commits.

Parameter names mirror transformers' (`model.layers.{i}.self_attn.q_proj.weight`, ...) so HF
state dicts map 1:1 (`tlt_core.model.checkpoint`). Numerics follow transformers too: RMSNorm in
float32, RoPE angles in float32 whatever the weights' dtype, Llama-3 frequency scaling.

Shapes: B rows, T new tokens, S cache slots read, H hidden size, V vocabulary, L layers,
H_q / H_kv query / key-value heads, d head_dim.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tlt_core.model.attention_plan import AttentionPlan, attention_plan
from tlt_core.model.kv_cache import KVCache
from tlt_core.model.packed import PackedDecoder

FAMILIES = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
# config.json keys whose null transformers reads as "derive it" (or, for rope_theta, "take it
# from rope_parameters"); any other null is refused.
NULL_IS_ABSENT = frozenset({"architectures", "head_dim", "num_key_value_heads", "rope_scaling",
                            "rope_parameters", "rope_theta"})
_NO_DEFAULT = object()


def _hf_value(hf: dict[str, Any], key: str, kind: type, default: Any = _NO_DEFAULT, *,
              field: str | None = None) -> Any:
    """hf[key] (or `default` when absent), checked to be of JSON type `kind`: int excludes
    bool and float, float takes finite ints and floats, bool takes only true/false."""
    field = field or key
    if key not in hf:
        if default is _NO_DEFAULT:
            raise ValueError(f"{field}: missing")
        return default
    value = hf[key]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{field}: must be a number, got {_json_repr(value)}")
        if not math.isfinite(value):
            raise ValueError(f"{field}: must be finite, got {value}")
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = {int: "an integer", bool: "true or false", str: "a string",
                    dict: "an object"}[kind]
        raise TypeError(f"{field}: must be {expected}, got {_json_repr(value)}")
    if kind is int and value < 1:
        raise ValueError(f"{field}: must be >= 1, got {value}")
    return value


def _json_repr(value: Any) -> str:
    kind = {type(None): "null", bool: "bool", int: "integer", float: "number", str: "string",
            list: "list", dict: "object"}.get(type(value), type(value).__name__)
    return f"{kind} {json.dumps(value, default=repr) if kind != 'object' else '{...}'}"[:80]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder; the defaults are a tiny Llama that runs anywhere."""

    family: str = "llama"  # "llama" | "qwen2" | "qwen3"
    vocab_size: int = 256  # V
    hidden_size: int = 64  # H
    intermediate_size: int = 128
    num_layers: int = 2  # L
    num_heads: int = 4  # H_q
    num_kv_heads: int = 2  # H_kv (grouped-query attention when < num_heads)
    head_dim: int = 16  # d
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or Llama-3 scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    # q/k/v biases: always on in Qwen2. For Llama and Qwen3, transformers' attention_bias also
    # gives o_proj a bias, and so do we.
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k, before RoPE

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            scaling = self.rope_scaling
            if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
                raise ValueError("rope_scaling: only None or Llama-3 scaling "
                                 f"(rope_type 'llama3') is supported, got {scaling!r}")
            missing = [key for key in LLAMA3_ROPE_KEYS if key not in scaling]
            if missing:
                raise ValueError(f"rope_scaling: Llama-3 scaling needs {missing}")
            if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")
        if self.qk_norm != (self.family == "qwen3"):
            raise ValueError(f"qk_norm: the qwen3 family, and only it, normalises q and k per head "
                             f"(family {self.family!r}, qk_norm {self.qk_norm})")
        if self.family == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias: the qwen2 family always has q/k/v biases")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a transformers config.json dict (Llama/Qwen2/Qwen3ForCausalLM), old-style
        `rope_theta` + `rope_scaling` or transformers-5 `rope_parameters`.

        JSON types are strict: a string is not a bool ("false" would read as true), a bool is
        not an int, and null means "absent" only where transformers derives the value from
        null (NULL_IS_ABSENT). Errors name the config.json key."""
        if not isinstance(hf, dict):
            raise TypeError(f"config: must be a JSON object, got {type(hf).__name__}")
        hf = {key: value for key, value in hf.items()
              if not (value is None and key in NULL_IS_ABSENT)}
        names = hf.get("architectures")
        if names is not None and (not isinstance(names, list)
                                  or not all(isinstance(name, str) for name in names)):
            raise TypeError(f"architectures: must be a list of strings, got {names!r}")
        model_type = _hf_value(hf, "model_type", str, None)
        names = names or [arch for arch, family in ARCHITECTURES.items() if family == model_type]
        arch = names[0] if names else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"architectures: {arch or 'none given'} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        absent = [key for key in ("vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads") if key not in hf]
        if absent:
            raise ValueError(f"{', '.join(absent)}: missing from the {arch} config")
        if _hf_value(hf, "hidden_act", str, "silu") != "silu":
            raise ValueError(f"hidden_act: only silu (SwiGLU) is supported, got {hf['hidden_act']!r}")
        if _hf_value(hf, "mlp_bias", bool, False):
            raise ValueError("mlp_bias: MLP biases are not supported")
        if _hf_value(hf, "use_sliding_window", bool, False):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        hidden = _hf_value(hf, "hidden_size", int)
        heads = _hf_value(hf, "num_attention_heads", int)
        # transformers' Qwen3Config defaults head_dim to 128; the others derive it.
        head_dim = _hf_value(hf, "head_dim", int,
                             128 if family == "qwen3" else hidden // heads)
        # Legacy rope_scaling wins over rope_parameters, as in transformers 5.
        for key in ("rope_scaling", "rope_parameters"):
            _hf_value(hf, key, dict, {})
        rope_key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = dict(hf.get(rope_key) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if not isinstance(rope_type, str):
            raise TypeError(f"{rope_key}: rope_type must be a string, got {rope_type!r}")
        rope_scaling = None
        if rope_type == "llama3":
            rope.setdefault("original_max_position_embeddings",
                            hf.get("max_position_embeddings", 2048))
            rope_scaling = {"rope_type": "llama3"}
            for key in LLAMA3_ROPE_KEYS:
                if key in rope:
                    kind = int if key == "original_max_position_embeddings" else float
                    rope_scaling[key] = _hf_value(rope, key, kind, field=f"{rope_key}.{key}")
        elif rope_type != "default":
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported "
                             "(supported: default, llama3)")
        rope_theta = _hf_value(hf, "rope_theta", float, 10000.0)
        if "rope_theta" in rope:
            rope_theta = _hf_value(rope, "rope_theta", float, field=f"{rope_key}.rope_theta")
        return cls(
            family=family, vocab_size=_hf_value(hf, "vocab_size", int), hidden_size=hidden,
            intermediate_size=_hf_value(hf, "intermediate_size", int),
            num_layers=_hf_value(hf, "num_hidden_layers", int), num_heads=heads,
            num_kv_heads=_hf_value(hf, "num_key_value_heads", int, heads),
            head_dim=head_dim, rms_norm_eps=_hf_value(hf, "rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=_hf_value(hf, "max_position_embeddings", int,
                                              2048 if family == "llama" else 32768),
            tie_word_embeddings=_hf_value(hf, "tie_word_embeddings", bool, False),
            attention_bias=(True if family == "qwen2"
                            else _hf_value(hf, "attention_bias", bool, False)),
            qk_norm=family == "qwen3")

    def num_parameters(self) -> int:
        """Parameters a Transformer of this config holds (the tied LM head counted once)."""
        hidden, q_size = self.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        attention = hidden * (q_size + 2 * kv_size) + q_size * hidden
        if self.attention_bias:
            attention += q_size + 2 * kv_size + (hidden if self.family != "qwen2" else 0)
        if self.qk_norm:
            attention += 2 * self.head_dim
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden  # + 2 RMSNorms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + hidden  # + the final norm

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict transformers loads (both the 4.x keys and 5.x `rope_parameters`)."""
        arch = next(name for name, family in ARCHITECTURES.items() if family == self.family)
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        hf = {"architectures": [arch], "model_type": self.family, "vocab_size": self.vocab_size,
              "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
              "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
              "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
              "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
              "rope_theta": self.rope_theta,
              "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
              "rope_parameters": rope_parameters,
              "max_position_embeddings": self.max_position_embeddings,
              "tie_word_embeddings": self.tie_word_embeddings}
        if self.family == "llama":
            hf.update(attention_bias=self.attention_bias, mlp_bias=False)
        else:
            hf.update(use_sliding_window=False)
            if self.family == "qwen3":
                hf.update(attention_bias=self.attention_bias)
        return hf


@dataclass(frozen=True)
class ModelOutput:
    logits: torch.Tensor  # (B, T, V) float32
    # One (B, T, H) tensor per requested layer, in request order: the output of decoder layer i
    # (the input of layer i + 1); the last layer's is taken before the final norm.
    hidden_states: tuple[torch.Tensor, ...]


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies (d/2,) float32, computed exactly as transformers does
    (`_compute_default_rope_parameters`, `_compute_llama3_parameters`)."""
    d = config.head_dim
    exponent = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d  # (d/2,)
    inv_freq = 1.0 / (config.rope_theta ** exponent)  # (d/2,)
    if config.rope_scaling is None:
        return inv_freq
    scaling = config.rope_scaling  # Llama 3.1: stretch low frequencies, keep high ones
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq  # (d/2,)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # (d/2,)
    smooth = (old_context / wavelen - low) / (high - low)  # (d/2,)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # (d/2,)
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # (d/2,)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (d/2,)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the frequencies to the weights' dtype; transformers keeps
        # them in float32, so only follow the device and recompute them there.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config, self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, d/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, d)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d); cos, sin (B, T, d). Rotates the two halves of each head (HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, heads, T, d)
    return x * cos[:, None] + rotated * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op; the same float32 math as below (decoding is dispatch-bound).
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # Normalise in float32, as transformers does, then scale in the weights' dtype.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias and config.family != "qwen2")
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        # Submodules are called through .forward / F.linear: decoding a small model is bound by
        # per-call Python overhead, and nn.Module.__call__ (hooks we never use) doubles it.
        B, T, _ = x.shape
        q = _linear(self.q_proj, x).view(B, T, self.num_heads, self.head_dim)  # (B, T, H_q, d)
        k = _linear(self.k_proj, x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, d)
        v = _linear(self.v_proj, x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, d)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H_q, T, d)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, H_kv, T, d)
        v = v.transpose(1, 2)  # (B, H_kv, T, d)
        if kv is not None:
            k_cache, v_cache = kv  # (B, H_kv, T_max, d) views into the cache
            index = plan.write_slots[:, None, :, None].expand_as(k)  # (B, H_kv, T, d)
            k_cache.scatter_(2, index, k.to(k_cache.dtype))
            v_cache.scatter_(2, index, v.to(v_cache.dtype))
            k = k_cache[:, :, :plan.read_len].to(q.dtype)  # (B, H_kv, S, d)
            v = v_cache[:, :, :plan.read_len].to(q.dtype)  # (B, H_kv, S, d)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.mask, is_causal=plan.mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads)  # (B, H_q, T, d)
        return _linear(self.o_proj, out.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)


def _fuse_parameters(modules: list[nn.Module], name: str) -> None:
    parts = [getattr(module, name) for module in modules]
    fused = torch.cat([part.detach() for part in parts])  # the group's one storage
    start = 0
    for module, part in zip(modules, parts):
        rows = part.shape[0]
        setattr(module, name, nn.Parameter(fused[start:start + rows],
                                           requires_grad=part.requires_grad))
        start += rows


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self.gate_proj, x), _linear(self.up_proj, x)  # (B, T, I)
        return _linear(self.down_proj, F.silu(gate) * up)  # SwiGLU, (B, T, H)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        attended = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, plan, kv)
        h = h + attended  # (B, T, H)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))  # (B, T, H)


class DecoderStack(nn.Module):
    """The parameters under transformers' `model.` prefix; Transformer.forward runs them."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # How Transformer.step holds the weights (tlt_core.model.weight_layout.LAYOUTS):
        # "auto" picks per dtype and device; set it to force one.
        self.inference_layout = "auto"
        self._decoder = PackedDecoder(self)

    def tie_weights(self) -> None:
        """With tie_word_embeddings, lm_head uses embed_tokens' Parameter itself (one tensor,
        one gradient), also after load_state_dict(assign=True) replaced either."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, *, tree_mask: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = ()) -> ModelOutput:
        """input_ids, positions (B, T) int64; tree_mask (B, T, T) bool, True where new token i
        may attend to new token j (default causal); hidden_layers: layer indices (-1 = last)
        whose outputs to return. See the module docstring for the cache contract."""
        self._check_inputs(input_ids, positions, cache, tree_mask)
        wanted = [self._layer_index(i) for i in hidden_layers]
        plan = attention_plan(input_ids.shape, cache, tree_mask, input_ids.device)
        cos, sin = self.model.rotary_emb(positions, self.lm_head.weight.dtype)  # (B, T, d) each
        h = self.model.embed_tokens(input_ids)  # (B, T, H)
        saved = {}
        for index, layer in enumerate(self.model.layers):
            h = layer.forward(h, cos, sin, plan, None if cache is None else cache.layer(index))
            if index in wanted:
                saved[index] = h
        logits = _linear(self.lm_head, self.model.norm.forward(h)).float()  # (B, T, V)
        return ModelOutput(logits, tuple(saved[index] for index in wanted))

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, *,
             tree_mask: torch.Tensor | None = None, hidden_layers: Sequence[int] = (),
             read_len: int | None = None, logit_index: torch.Tensor | None = None
             ) -> ModelOutput:
        """forward() with a cache, for inference (no autograd through the weights): the same
        contract and results (tests hold it to forward), in the fewest ops per layer
        (tlt_core.model.packed), since a small model's inference is bound by per-op overhead.
        Prefill, decoding and tree verification all go through here. read_len: attend over
        exactly that many cache slots, with no room check (the caller's): fixed shapes for any
        lengths, capturable in a CUDA graph (None: the slots some row uses). logit_index
        (B, P) int64: logits only at those positions, (B, P, V) (at a real vocabulary, logits
        at every prompt position are most of prefill's memory)."""
        self._check_inputs(input_ids, positions, cache, tree_mask)
        if logit_index is not None and (logit_index.dim() != 2 or logit_index.dtype != torch.int64
                                        or logit_index.shape[0] != input_ids.shape[0]):
            raise ValueError(f"logit_index: expected ({input_ids.shape[0]}, P) int64, got "
                             f"{tuple(logit_index.shape)} {logit_index.dtype}")
        wanted = [self._layer_index(i) for i in hidden_layers]
        logits, hidden = self._decoder(input_ids, positions, cache, tree_mask, wanted, read_len,
                                       logit_index)
        return ModelOutput(logits, hidden)

    @property
    def inference_layout_in_use(self) -> str:
        """The layout `step` last packed its weights in ("auto" resolved)."""
        return self._decoder.layers.layout

    def refresh_inference(self) -> tuple[int, int]:
        """Brings step()'s packed weights up to date with the parameters now; returns their
        generations, which change only when the packed tensors were replaced (a parameter
        replaced by another shape or storage) rather than refreshed in place: what a CUDA
        graph of step() must be captured again after."""
        return self._decoder.refresh()

    @contextlib.contextmanager
    def inference_pack_held(self) -> Iterator[None]:
        """Within it, step() takes its packed layers as current without comparing them with the
        parameters on every pass: for a caller that does not change the parameters inside (a
        generate call). The pack is brought up to date on entry; nested holds are one."""
        layers = self._decoder.layers
        if layers.held:
            yield
            return
        layers.get()
        layers.held = True
        try:
            yield
        finally:
            layers.held = False

    def reserve_positions(self, bound: int) -> None:
        """Precomputes step()'s RoPE tables for positions < bound: what a CUDA graph of step()
        reads must not be replaced by a larger table later."""
        weight = self.model.embed_tokens.weight
        self._decoder.layers.reserve_rope(self.model.rotary_emb, bound, weight.dtype,
                                          weight.device)

    def inference_copy_bytes(self) -> int:
        """Memory `step`'s packed weights take beyond the parameters (0 in the views layout)."""
        return self._decoder.copy_bytes()

    def fuse_projections_(self) -> None:
        """Re-lays each layer's q|k|v and gate|up parameters (and q|k|v biases) as adjacent
        views of one tensor, values unchanged: the packed pass's views layout then multiplies
        each group as one matrix without copying it. Undone by anything that replaces the
        parameters one by one (.to(), load_state_dict(assign=True)); harmless then."""
        with torch.no_grad():
            for layer in self.model.layers:
                attn = layer.self_attn
                _fuse_parameters([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
                if attn.q_proj.bias is not None:
                    _fuse_parameters([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
                _fuse_parameters([layer.mlp.gate_proj, layer.mlp.up_proj], "weight")

    def next_token_logits(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row: row b's token at position cache.lengths[b], written to that slot.
        Returns the (B, V) float32 logits of the token after it: step(tokens[:, None],
        cache.lengths[:, None], cache).logits[:, 0]."""
        if tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens: expected (B,) int64, got {tuple(tokens.shape)} {tokens.dtype}")
        return self.step(tokens[:, None], cache.lengths[:, None], cache).logits[:, 0]

    def _layer_index(self, index: int) -> int:
        num_layers = self.config.num_layers
        if not -num_layers <= index < num_layers:
            raise ValueError(f"hidden_layers: layer {index} out of range for {num_layers} layers")
        return index % num_layers

    def _check_inputs(self, input_ids, positions, cache, tree_mask) -> None:
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids: expected (B, T) int64, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        if positions.shape != input_ids.shape or positions.dtype != torch.int64:
            raise ValueError(f"positions: expected {tuple(input_ids.shape)} int64 like input_ids, "
                             f"got {tuple(positions.shape)} {positions.dtype}")
        B, T = input_ids.shape
        if tree_mask is not None and (tree_mask.shape != (B, T, T) or tree_mask.dtype != torch.bool):
            raise ValueError(f"tree_mask: expected ({B}, {T}, {T}) bool, got "
                             f"{tuple(tree_mask.shape)} {tree_mask.dtype}")
        if cache is not None:
            c, shape = self.config, cache.shape
            expected = (c.num_layers, B, c.num_kv_heads, c.head_dim)
            got = (shape.num_layers, shape.batch, shape.num_kv_heads, shape.head_dim)
            if got != expected:
                raise ValueError(f"cache: (layers, batch, kv heads, head_dim) {got} does not match "
                                 f"the model and input, {expected}")
