"""The EAGLE-3 drafter, as published checkpoints define it: a drafter with its own decoder layer,
final norm and LM head over a reduced vocabulary, that the engine and the draft tree run exactly
like `Drafter` (tlt_core.drafting.drafter).

Why a class of its own: an EAGLE-3 layer is not a `DecoderLayer` after a fusion linear. Its
attention reads the token's embedding and the hidden state side by side (q/k/v take 2H inputs),
each with its own RMSNorm, the residual comes from the hidden state alone, and the logits come
from its own norm and head, not the target's (Li et al., EAGLE-3, 2025; SafeAILab/EAGLE
eagle/model/cnets.py `LlamaDecoderLayeremb` and `Model`, SGLang
python/sglang/srt/models/llama_eagle3.py, SpecForge specforge/modeling/draft/llama3_eagle.py,
speculators src/speculators/models/eagle3/model_definitions.py). At position t, with x_{t+1}
the next token:

    g_t    = fc([a_t; b_t; c_t])                the target's residual stream after three of
                                                its layers (low, middle, high), 3H -> H
    r      = hidden_norm(g_t)  if norm_before_residual  else  g_t
    u      = r + attn([input_norm(embed(x_{t+1})); hidden_norm(g_t)])
    g'     = u + mlp(post_attention_norm(u))    fed back as g at deeper draft levels (no fc)
    logits = lm_head(norm(g'))                  (V',) over the draft vocabulary

Draft index i is target token draft_to_target[i] (the checkpoints' d2t stores the offsets:
target = i + d2t[i]). A checkpoint without its own head (`head_from_target`) scores the whole
vocabulary with the target's LM head instead: what SGLang does for a config without
draft_vocab_size and vLLM for a checkpoint without lm_head.weight. The embedding is the target's (module `published`, where the checkpoints
are read, says why); the rotary embedding is the drafter's own, from its layer config, since
EAGLE-3 drafters are trained with their own RoPE settings (SpecForge's Llama-3 config has no
rope_theta: 10000 against the target's 500000).

It is a `LearnedDrafter` (tlt_core.drafting.learned), as `Drafter` is: the engine, its
fixed-shape passes and the draft plans run both alike. The position bookkeeping is the same: the
drafter's cache holds the pair (g_t, x_{t+1}) of every position the target's cache holds, at
position t.

Shapes: B rows, T tokens, H hidden size, F fused target layers, V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tlt_core.drafting.drafter import check_draft_ids
from tlt_core.model.attention_plan import AttentionPlan, attention_plan
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tlt_core.model.packed import plan_for
from tlt_core.model.transformer import (MLP, Attention, ModelConfig, RMSNorm, RotaryEmbedding,
                                        Transformer)


@dataclass(frozen=True)
class Eagle3Config:
    # The drafter's one decoder layer: hidden size (the target's), heads, kv heads, head_dim,
    # intermediate size, rms_norm_eps, its own RoPE; vocab_size is the target's.
    layer: ModelConfig
    # Target layers whose outputs (the `hidden_layers` of tlt_core.model.Transformer: the output
    # of layer i, before the final norm for the last) fc fuses, in fc's input order.
    feature_layers: tuple[int, ...]
    draft_vocab: int  # V'
    # speculators' norm_before_residual: the residual is hidden_norm(g) instead of g.
    norm_before_residual: bool = False
    # No head of its own: logits = target.lm_head(norm(g')) over the whole vocabulary (the
    # target's tensor, read live, so it follows the target's updates); needs draft_vocab = V.
    head_from_target: bool = False

    def __post_init__(self):
        layers = tuple(int(i) for i in self.feature_layers)
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"feature_layers: need one or more distinct layer indices >= 0, got "
                             f"{self.feature_layers!r}")
        object.__setattr__(self, "feature_layers", layers)
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 1:
            raise ValueError(f"draft_vocab: must be an int >= 1, got {self.draft_vocab!r}")
        if self.layer.num_layers != 1 or self.layer.family != "llama":
            raise ValueError(f"layer: an EAGLE-3 drafter has one Llama layer, got "
                             f"{self.layer.num_layers} {self.layer.family} layers")


class FusedInputAttention(Attention):
    """Attention whose q/k/v projections read 2H inputs: [input_norm(embed); hidden_norm(g)]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        wide, bias = 2 * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(wide, self.q_proj.out_features, bias=bias)
        self.k_proj = nn.Linear(wide, self.k_proj.out_features, bias=bias)
        self.v_proj = nn.Linear(wide, self.v_proj.out_features, bias=bias)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (`midlayer`): the module docstring's u and g'."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.self_attn = FusedInputAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, plan: AttentionPlan,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        normed = self.hidden_norm.forward(hidden)  # (B, T, H)
        residual = normed if self.norm_before_residual else hidden
        both = torch.cat((self.input_layernorm.forward(embedded), normed), dim=-1)  # (B, T, 2H)
        h = residual + self.self_attn.forward(both, cos, sin, plan, kv)  # (B, T, H)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))  # (B, T, H)


class Eagle3Drafter(nn.Module):
    def __init__(self, target: Transformer, config: Eagle3Config,
                 draft_to_target: torch.Tensor | Sequence[int]):
        """draft_to_target: (V',) the target id of each draft index (distinct, in [0, V))."""
        super().__init__()
        c, layer = target.config, config.layer
        if (layer.hidden_size, layer.vocab_size) != (c.hidden_size, c.vocab_size):
            raise ValueError(f"target: the drafter's layer has hidden_size {layer.hidden_size} "
                             f"and vocab_size {layer.vocab_size}, the target {c.hidden_size} and "
                             f"{c.vocab_size}; an EAGLE-3 drafter shares the target's embedding")
        if config.head_from_target and config.draft_vocab != c.vocab_size:
            raise ValueError(f"draft_vocab: a drafter scoring with the target's LM head drafts "
                             f"over its whole vocabulary ({c.vocab_size}), got "
                             f"{config.draft_vocab}")
        bad = [i for i in config.feature_layers if i >= c.num_layers]
        if bad:
            raise ValueError(f"feature_layers: layer {bad[0]} is out of range for a target with "
                             f"{c.num_layers} layers")
        self.config = config
        self._target = (target,)  # a tuple hides it from nn.Module: shared, not owned
        hidden = c.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(layer, config.norm_before_residual)
        self.norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.lm_head = (None if config.head_from_target
                        else nn.Linear(hidden, config.draft_vocab, bias=False))
        self.rotary_emb = RotaryEmbedding(layer)
        self.register_buffer("draft_to_target",
                             check_draft_ids(draft_to_target, config.draft_vocab, c.vocab_size,
                                             ascending=False))
        if config.head_from_target and not torch.equal(self.draft_to_target,
                                                       torch.arange(c.vocab_size)):
            raise ValueError("draft_to_target: the target's LM head scores token ids in order; "
                             "a drafter using it maps draft index i to token i")
        self.to(dtype=target.lm_head.weight.dtype, device=target.lm_head.weight.device)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    @property
    def vocab_size(self) -> int:
        """Width of logits(): V'."""
        return self.config.draft_vocab

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Indices into logits()'s last dimension -> target token ids."""
        return self.draft_to_target[draft_ids]

    def reserve_positions(self, bound: int) -> None:
        """Nothing to prepare: the rotary embedding computes every pass's angles from its
        frequencies, so a CUDA graph reads no table that a longer context could replace."""

    def refresh_inference(self) -> tuple[int, ...]:
        """The passes read the parameters and buffers themselves (no packed copies), so they
        are always up to date; their addresses are the generation, which changes only when one
        was replaced (what a CUDA graph that read it must be captured again after)."""
        return tuple(t.data_ptr() for t in itertools.chain(self.parameters(), self.buffers()))

    def new_cache(self, batch: int, max_len: int, budget_bytes: int | None = None) -> KVCache:
        layer = self.config.layer
        return KVCache(CacheShape(1, batch, layer.num_kv_heads, max_len, layer.head_dim),
                       dtype=cache_dtype(self.fc.weight.dtype, self.fc.weight.device),
                       device=self.fc.weight.device, budget_bytes=budget_bytes)

    def features(self, target_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """g_t (..., H) from the target's outputs at feature_layers (each (..., H), in order)."""
        return F.linear(torch.cat(tuple(target_hidden), dim=-1), self.fc.weight)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, *, tree_mask: torch.Tensor | None = None,
                plan: AttentionPlan | None = None) -> torch.Tensor:
        """tokens (B, T) int64: x_{t+1}; features (B, T, H): g_t (or the drafter's own g');
        positions (B, T) int64: t. The cache contract is Drafter.forward's. Returns g'
        (B, T, H), before the drafter's final norm."""
        embedded = F.embedding(tokens, self.target.model.embed_tokens.weight.detach())
        if plan is None:
            plan = (attention_plan(tokens.shape, None, tree_mask, tokens.device)
                    if cache is None else plan_for(tokens, cache, tree_mask))
        if cache is not None and plan.mask is None:
            # With a cache, a plan without a mask reads every slot it names (how the packed
            # pass, tlt_core.model.packed, reads it); the eager Attention would take no mask
            # as causal, so spell it out.
            everything = torch.ones(1, 1, tokens.shape[1], plan.read_len, dtype=torch.bool,
                                    device=tokens.device)
            plan = AttentionPlan(everything, plan.write_slots, plan.read_len)
        cos, sin = self.rotary_emb(positions, features.dtype)  # (B, T, d) each
        return self.midlayer(embedded.to(features.dtype), features, cos, sin, plan,
                             None if cache is None else cache.layer(0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) drafter outputs -> (..., V') float32 logits over the draft vocabulary,
        through the drafter's own final norm and head (or the target's, head_from_target)."""
        head = (self.target.lm_head.weight.detach() if self.lm_head is None
                else self.lm_head.weight)  # (V', H)
        return F.linear(self.norm.forward(hidden), head).float()
