"""The EAGLE-style drafter: one decoder layer that predicts the target's next hidden state.

At position t the drafter takes the target's feature f_t (the hidden state after x_t) and the
embedding of the next token x_{t+1}, fuses them (linear 2H -> H), runs one decoder layer and
returns f'_{t+1}, its guess of the target's feature at t+1; the target's final norm and LM head
turn that into a distribution over x_{t+2}. Drafting deeper feeds f' back in place of f.

EAGLE-3 style fusion: with `feature_layers` naming several target layers (e.g. low, middle and
high), f_t is the concatenation of their outputs, reduced to H by a `fuse` linear first; the
drafter's own outputs are already H wide and skip it.

Two forms of the same drafter (`DrafterConfig.form`), differing only in where the target's final
norm sits:
- "tlt": f_t is the last layer's output BEFORE the final norm; the decoder layer
  normalises its input (input_layernorm); logits = lm_head(final_norm(f')). f' regresses onto
  the target's pre-norm hidden state.
- "eagle": EAGLE-1 as serving engines run it (SafeAILab/EAGLE cnets.py, SGLang's
  LlamaForCausalLMEagle, vLLM's EagleLlamaForCausalLM): f_t is the hidden state
  AFTER the final norm (what the LM head sees); the layer has no input norm (identity);
  logits = lm_head(f'), no norm. f' regresses onto the target's normed hidden state. Only this
  form has an exact serving representation (tlt_core.drafting.export); it needs feature_layers (-1,).
The default is "eagle" for a drafter that reads the last layer alone (it also drafted better:
acceptance 5.6-5.8 against 4.4-4.9 for "tlt" on the embedded model, same training budget), and
"tlt" for several feature layers (EAGLE-3 style fusion, which only form "tlt" has).

Reduced draft vocabulary (EAGLE-3's d2t, FR-Spec): with `draft_vocab` V' set, the drafter's head
is the target's LM head restricted to V' target ids (`draft_to_target`, ascending; in practice
the V' most frequent tokens of the target's own outputs), so its logits are (..., V') and the
tree maps the ids it picks back with `to_target_ids`. The rows are gathered from the target's
head when it changes (its version counter), not per call. Verification is unchanged: drafts are
deterministic, so a draft that can never propose some tokens only accepts less, never skews
what is sampled.

The embedding, final norm and LM head are the target's own tensors, used detached: they are
never copied into the drafter, never receive gradients and are never written (the drafter holds
the target outside its module tree, so its state_dict, parameters() and .to() never include
them). The drafter's trainable tensors are `fuse` (EAGLE-3 only), `fc` and `layer`. `fc` has a
bias only with `fc_bias` (EAGLE-1's default in SafeAILab/EAGLE cnets1.py and SGLang's
LlamaForCausalLMEagle; our own drafters train without one).

Position bookkeeping (the engine's invariant): the drafter's cache holds the pairs
(f_t, x_{t+1}) for every position t the target's cache holds, so both caches have the same
length, and the drafter's output at the last pair predicts the token after the root.

Shapes: B rows, T tokens, H hidden size, F number of feature layers, V vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tlt_core.model.attention_plan import AttentionPlan, attention_plan
from tlt_core.model.kv_cache import CacheShape, KVCache, cache_dtype
from tlt_core.model.packed import PackedLayers, plan_for, run_layers
from tlt_core.model.transformer import DecoderLayer, Transformer
from tlt_core.model.weight_layout import PackedMatrix
from tlt_core.persistence.checkpoint_io import write_safetensors

DRAFTER_CONFIG_FILE = "drafter_config.json"
DRAFTER_WEIGHTS_FILE = "drafter.safetensors"
FORMS = ("tlt", "eagle")  # DrafterConfig.form


@dataclass(frozen=True)
class DrafterConfig:
    # Target layers whose outputs form the feature f_t: (-1,) is EAGLE-1/2 (the last layer's
    # output); several layers is EAGLE-3 style fusion.
    feature_layers: tuple[int, ...] = (-1,)
    # Where the target's final norm sits (module docstring): "tlt" (pre-norm features, the
    # layer's own input norm, final norm before the head) or "eagle" (normed features, no input
    # norm, no norm before the head; exportable to vLLM and SGLang). None: "eagle" for
    # feature_layers (-1,), "tlt" for several layers.
    form: str | None = None
    # V': the head covers only these many target ids (`Drafter.draft_to_target`); None: the
    # target's whole vocabulary.
    draft_vocab: int | None = None
    # fc = nn.Linear(2H, H) with a bias: published EAGLE-1 drafters have one (load_drafter
    # reads them); ours train without.
    fc_bias: bool = False

    def __post_init__(self):
        layers = tuple(int(i) for i in self.feature_layers)
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"feature_layers: need one or more distinct layer indices, got "
                             f"{self.feature_layers!r}")
        object.__setattr__(self, "feature_layers", layers)
        if self.draft_vocab is not None and (not isinstance(self.draft_vocab, int)
                                             or self.draft_vocab < 1):
            raise ValueError(f"draft_vocab: must be an int >= 1 or None, got "
                             f"{self.draft_vocab!r}")
        if not isinstance(self.fc_bias, bool):
            raise ValueError(f"fc_bias: must be a bool, got {self.fc_bias!r}")
        if self.form is None:
            object.__setattr__(self, "form", "eagle" if layers == (-1,) else "tlt")
        if self.form not in FORMS:
            raise ValueError(f"form: expected one of {FORMS}, got {self.form!r}")
        if self.form == "eagle" and layers != (-1,):
            raise ValueError(f"feature_layers: form 'eagle' reads the target's last layer only "
                             f"(feature_layers=(-1,)), as EAGLE-1 does; got {layers}. Use form "
                             "'tlt' for EAGLE-3 style fusion")


class Drafter(nn.Module):
    def __init__(self, target: Transformer, config: DrafterConfig = DrafterConfig(),
                 draft_to_target: torch.Tensor | Sequence[int] | None = None):
        """draft_to_target: the V' target ids of a reduced draft vocabulary (distinct, in
        [0, V)); needed when config.draft_vocab is set, unless a state_dict is loaded next."""
        super().__init__()
        layers = target.config.num_layers
        bad = [i for i in config.feature_layers if not -layers <= i < layers]
        if bad:
            raise ValueError(f"feature_layers: layer {bad[0]} is out of range for a target with "
                             f"{layers} layers")
        vocab = target.config.vocab_size
        if config.draft_vocab is not None and config.draft_vocab > vocab:
            raise ValueError(f"draft_vocab: {config.draft_vocab} exceeds the target's "
                             f"vocabulary ({vocab})")
        self.config = config
        self._target = (target,)  # a tuple hides it from nn.Module: shared, not owned
        hidden = target.config.hidden_size
        width = len(config.feature_layers)
        self.fuse = nn.Linear(width * hidden, hidden, bias=False) if width > 1 else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layer = DecoderLayer(target.config)
        if config.form == "eagle":  # EAGLE-1: the layer's input is not normalised (cnets.py)
            self.layer.input_layernorm = nn.Identity()
        self._packed = PackedLayers(lambda: [self.layer], target.config)  # for inference
        if config.draft_vocab is not None:
            ids = (torch.arange(config.draft_vocab) if draft_to_target is None
                   else check_draft_ids(draft_to_target, config.draft_vocab, vocab))
            self.register_buffer("draft_to_target", ids)
        elif draft_to_target is not None:
            raise ValueError("draft_to_target: given without config.draft_vocab")
        else:
            self.draft_to_target = None
        self._head_rows: tuple[tuple, torch.Tensor] | None = None  # (target head's version, rows)
        # fc and the head packed for inference (tlt_core.model.weight_layout.PackedMatrix)
        self._packed_fc, self._packed_head = PackedMatrix(), PackedMatrix()
        self.to(dtype=target.lm_head.weight.dtype, device=target.lm_head.weight.device)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    @property
    def vocab_size(self) -> int:
        """Width of logits(): V' with a reduced draft vocabulary, else the target's V."""
        if self.draft_to_target is not None:
            return self.draft_to_target.shape[0]
        return self.target.config.vocab_size

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Indices into logits()'s last dimension -> target token ids (the same tensor when the
        vocabulary is not reduced)."""
        if self.draft_to_target is None:
            return draft_ids
        return self.draft_to_target[draft_ids]

    def head(self) -> torch.Tensor:
        """(V', H) the LM head rows the drafter scores (the target's head, detached, or its rows
        at draft_to_target, gathered again only after the target's head changed)."""
        head = self.target.lm_head.weight.detach()
        if self.draft_to_target is None:
            return head
        key = (head.data_ptr(), head._version, head.dtype, self.draft_to_target.data_ptr(),
               self.draft_to_target._version)
        if self._head_rows is None or self._head_rows[0] != key:
            # gathered as a normal tensor even inside a rollout's inference mode: the spot
            # trainer's backward pass may read rows a rollout gathered; into the same tensor
            # when it fits, so a CUDA graph that read the rows reads the new ones
            with torch.inference_mode(False), torch.no_grad():
                rows = None if self._head_rows is None else self._head_rows[1]
                if rows is not None and (rows.dtype, rows.device, rows.shape[1]) == (
                        head.dtype, head.device, head.shape[1]):
                    torch.index_select(head, 0, self.draft_to_target, out=rows)
                else:
                    rows = head.index_select(0, self.draft_to_target)
                self._head_rows = key, rows
        return self._head_rows[1]

    def reserve_positions(self, bound: int) -> None:
        """Precomputes the inference pass's RoPE tables for positions < bound (as
        Transformer.reserve_positions)."""
        self._packed.reserve_rope(self.target.model.rotary_emb, bound, self.fc.weight.dtype,
                                  self.fc.weight.device)

    def refresh_inference(self) -> tuple[int, ...]:
        """Brings the packed inference weights up to date now (a captured graph never runs
        their own checks); returns their generations, which change only when a pack's tensors
        were replaced rather than refreshed in place."""
        self._packed.get()
        self._packed_fc.refresh(self.fc.weight)
        self._packed_head.refresh(self.head())
        return self._packed.generation, self._packed_fc.generation, self._packed_head.generation

    def new_cache(self, batch: int, max_len: int, budget_bytes: int | None = None) -> KVCache:
        c = self.target.config
        return KVCache(CacheShape(1, batch, c.num_kv_heads, max_len, c.head_dim),
                       dtype=cache_dtype(self.fc.weight.dtype, self.fc.weight.device),
                       device=self.fc.weight.device,
                       budget_bytes=budget_bytes)

    # ---- the computation ---------------------------------------------------------------------

    def features(self, target_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """f_t (..., H) from the target's outputs at feature_layers (each (..., H), in order;
        the raw layer outputs, before any norm). Form "eagle" normalises them here."""
        if self.config.form == "eagle":
            return self._final_norm(target_hidden[0])
        if self.fuse is None:
            return target_hidden[0]
        return self.fuse(torch.cat(tuple(target_hidden), dim=-1))

    def feature_target(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """What f'_{t+1} regresses onto, from the target's last-layer output (..., H) at t + 1:
        the output itself (form "tlt") or its final norm (form "eagle", what the head sees)."""
        return self._final_norm(last_hidden) if self.config.form == "eagle" else last_hidden

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, *, tree_mask: torch.Tensor | None = None,
                plan: AttentionPlan | None = None) -> torch.Tensor:
        """tokens (B, T) int64: x_{t+1}; features (B, T, H): f_t (or the drafter's own f');
        positions (B, T) int64: t. With a cache, token i of row b is written to slot
        cache.lengths[b] + i and sees the committed slots plus what tree_mask allows (causal
        by default), exactly like the target; `plan` replaces that plan outright (the draft
        tree, whose nodes see their ancestors among uncommitted slots). Returns f' (B, T, H);
        logits(f') is the distribution of the token after each x_{t+1}."""
        target = self.target
        joined = self._pairs(tokens, features)  # (B, T, 2H)
        if cache is not None and not torch.is_grad_enabled():  # inference: the packed layer
            if plan is None:
                plan = plan_for(tokens, cache, tree_mask)
            B, T = tokens.shape
            h = self._packed_fc(joined.view(B * T, -1), self.fc.weight, self.fc.bias)  # (B T, H)
            h, _ = run_layers(self._packed, h, positions, target.model.rotary_emb,
                              cache.data[:1], plan)
            return h.view(B, T, -1)
        if plan is None:
            plan = attention_plan(tokens.shape, cache, tree_mask, tokens.device)
        return self._differentiable(joined, positions, plan,
                                    None if cache is None else cache.layer(0))

    def forward_over_keys(self, tokens: torch.Tensor, features: torch.Tensor,
                          positions: torch.Tensor, plan: AttentionPlan,
                          kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """forward's differentiable pass over keys the caller holds rather than a KVCache:
        kv (K, V), each (B, H_kv, S, d), which the new tokens' keys and values are written into
        at plan.write_slots (in place) and whose first plan.read_len slots they attend under
        plan.mask. Autograd follows the writes, so gradients reach earlier passes through the
        keys they left there (the unrolled loss, tlt_core.drafting.unrolled). Returns f'
        (B, T, H), as forward."""
        return self._differentiable(self._pairs(tokens, features), positions, plan, kv)

    def _pairs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(x_{t+1} embedded, f_t) side by side, (B, T, 2H), through the target's embedding."""
        embedding = self.target.model.embed_tokens.weight.detach()
        return torch.cat((F.embedding(tokens, embedding), features), dim=-1)

    def _differentiable(self, joined: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                        kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The layer on (x_{t+1} embedded, f_t) pairs (B, T, 2H), unpacked (autograd sees it)."""
        h = F.linear(joined, self.fc.weight, self.fc.bias)  # (B, T, H)
        cos, sin = self.target.model.rotary_emb(positions, h.dtype)  # (B, T, d) each
        return self.layer(h, cos, sin, plan, kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) drafter outputs -> (..., V') float32 logits over the draft vocabulary
        (to_target_ids maps an index to its token), through the target's LM head (detached),
        after its final norm in form "tlt"; form "eagle" applies none (its outputs predict the
        normed hidden state, as EAGLE-1's do)."""
        if self.config.form == "tlt":
            hidden = self._final_norm(hidden)
        if torch.is_grad_enabled():
            return F.linear(hidden, self.head()).float()
        flat = hidden.reshape(-1, hidden.shape[-1])  # (M, H)
        return self._packed_head(flat, self.head()).float().view(*hidden.shape[:-1], -1)

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm with its weight detached: the same math as
        tlt_core.model.transformer.RMSNorm (float32 normalisation, scale in the weights' dtype)."""
        norm = self.target.model.norm
        if hidden.dtype == torch.float32:
            return F.rms_norm(hidden, (hidden.shape[-1],), norm.weight.detach(), norm.eps)
        normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=norm.eps).to(hidden.dtype)
        return norm.weight.detach() * normed

    # ---- checkpoints -------------------------------------------------------------------------

    def save(self, folder: str | Path, metadata: dict | None = None) -> None:
        """Writes the trainable tensors (safetensors) and the config, plus free-form metadata
        (provenance); the target's tensors are not written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        write_safetensors(tensors, folder / DRAFTER_WEIGHTS_FILE)
        record = {"drafter": {"feature_layers": list(self.config.feature_layers),
                              "form": self.config.form,
                              "draft_vocab": self.config.draft_vocab,
                              "fc_bias": self.config.fc_bias},
                  "target": self.target.config.to_hf_config(), "metadata": metadata or {}}
        (folder / DRAFTER_CONFIG_FILE).write_text(json.dumps(record, indent=1) + "\n")

    @classmethod
    def load(cls, folder: str | Path, target: Transformer) -> Drafter:
        """A drafter saved by save(), attached to `target` (which must have the same shape as
        the target it was trained for)."""
        folder = Path(folder)
        config_path, weights_path = folder / DRAFTER_CONFIG_FILE, folder / DRAFTER_WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"folder: {folder} has no {path.name}; is it a drafter "
                                        "saved by Drafter.save?")
        record = json.loads(config_path.read_text())
        # drafters saved before forms existed are form "tlt"
        config = DrafterConfig(tuple(record["drafter"]["feature_layers"]),
                               record["drafter"].get("form", "tlt"),
                               record["drafter"].get("draft_vocab"),
                               record["drafter"].get("fc_bias", False))
        saved_for = record["target"]
        mine = target.config.to_hf_config()
        for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size"):
            if saved_for.get(key) != mine.get(key):
                raise ValueError(f"target: this drafter was trained for {key} = "
                                 f"{saved_for.get(key)}, the target has {mine.get(key)}")
        drafter = cls(target, config)
        state = load_file(str(weights_path), device=str(target.lm_head.weight.device))
        drafter.load_state_dict(state, strict=True)
        if drafter.draft_to_target is not None:
            check_draft_ids(drafter.draft_to_target, config.draft_vocab,
                            target.config.vocab_size)
        return drafter


def check_draft_ids(ids: torch.Tensor | Sequence[int], count: int, vocab: int, *,
                    ascending: bool = True) -> torch.Tensor:
    """A draft_to_target map checked: `count` distinct int64 ids in [0, vocab); sorted
    ascending, or kept in the given (draft) order when the head's rows follow it."""
    ids = torch.as_tensor(ids).to("cpu")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.shape != (count,):
        raise ValueError(f"draft_to_target: expected ({count},) integer token ids, got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    ids = ids.to(torch.int64)
    if count and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"draft_to_target: ids must be in [0, {vocab}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    if ids.unique().numel() != count:
        raise ValueError("draft_to_target: ids must be distinct")
    return ids.sort().values if ascending else ids
