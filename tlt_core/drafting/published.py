"""Reading drafter checkpoints other projects publish, into a drafter that runs exactly their math.

`load_published(folder, target)` takes a folder of config.json plus weights (model.safetensors,
preferred, or pytorch_model.bin, read with `torch.load(weights_only=True)`, which runs no code)
and tells the layout apart by its config keys and tensor names:

- EAGLE-1/2 in SafeAILab/EAGLE's layout (eagle/model/cnets1.py `Model`, ea_model.py): told by
  `fc.weight` (H, 2H) and `layers.0.*`, the config a LlamaConfig (architectures
  LlamaForCausalLM) with `bias` (fc's; true unless given) and `qkv_bias`. -> `Drafter`, form
  "eagle", `fc_bias` as the weights say.
- EAGLE-3 in SafeAILab/EAGLE's layout (eagle/model/cnets.py `Model`), SpecForge's
  (specforge/modeling/draft/llama3_eagle.py `LlamaForCausalLMEagle3`), SGLang's
  (python/sglang/srt/models/llama_eagle3.py) and vLLM's (llama_eagle3.py; tlt export --to
  eagle3 writes it): told by architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM or
  `midlayer.*` tensors. -> `Eagle3Drafter`. Its head: `_eagle3_head` says how each engine
  reads lm_head.weight, its absence and tie_word_embeddings.
- EAGLE-3 in the speculators library's layout (vllm-project/speculators
  src/speculators/models/eagle3/: config.py `Eagle3SpeculatorConfig`, core.py,
  model_definitions.py; tlt export --to speculators writes it): told by speculators_model_type
  "eagle3". -> `Eagle3Drafter`.

(The EAGLE-1 layout of SGLang and vLLM, LlamaForCausalLMEagle / Qwen2ForCausalLMEagle /
EagleLlamaForCausalLM, and the speculators EAGLE-1 layout of releases before 0.9.0 are read by
tlt_core.drafting.export.load_export, through `eagle1_drafter` here.)

Which target hidden states an EAGLE-3 drafter fuses, in our Transformer's `hidden_layers`
indexing (the output of layer i):
- SafeAILab, and SGLang or SpecForge without layer ids: the residual stream entering layers 2,
  L//2 and L-3 (SafeAILab's modeling_llama_kv.py, SGLang's `set_eagle3_layers_to_capture`),
  i.e. the outputs of layers 1, L//2 - 1, L - 4 (SpecForge's default [1, L//2 - 1, L - 4]);
- SGLang / SpecForge `eagle_config.eagle_aux_hidden_state_layer_ids` [j...]: the output of
  layer j (SGLang captures the input of layer j + 1);
- speculators `eagle_aux_hidden_state_layer_ids` [j...], as vLLM serves it (its Llama model
  captures the input of layer j): the output of layer j - 1; j = 0 (the embedding) is refused.
Both engines append the captures in layer order, so fc's input is in ascending layer order.

The embedding, for every layout, is the target's, as SGLang serves EAGLE-1 and EAGLE-3 drafters
(set_embed_and_head / set_embed) and as every trainer trains them, with the target's embedding
frozen (SafeAILab's Model loads it from the target, `load_emb`; traineagle3 saves without it,
`exclude_frozen_parameters`; SpecForge's exporter drops it; speculators loads it from the
verifier and trains it only with `embed_requires_grad`). A checkpoint's `embed_tokens.weight`,
that frozen copy, must have the target's shape and is not used (SafeAILab's EaModel would let
that copy replace the target's, and vLLM keeps one that differs: for a frozen copy both are the
target's). A trained embedding (speculators `embed_requires_grad`) is refused.

Anything else these drafters cannot represent exactly is refused with a ValueError that names
the folder or the target and says why: several drafter layers, a hidden size or vocabulary
other than the target's, unknown or missing tensors (a bias pattern our layer lacks among
them), config switches whose math we do not run, and for EAGLE-1 (whose layer runs on the
target's config and rotary embedding) any shape, eps or RoPE setting other than the target's.

Shapes: H hidden size, V vocabulary, V' draft vocabulary, L target layers.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.eagle3 import Eagle3Config, Eagle3Drafter
from tlt_core.model.transformer import ModelConfig, Transformer

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in order of preference
SGLANG_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# The names SGLang's and vLLM's registries give the same EAGLE-3 Llama drafter.
EAGLE3_ARCHITECTURES = (SGLANG_EAGLE3_ARCHITECTURE, "Eagle3LlamaForCausalLM")
SPECULATORS_EAGLE3 = "eagle3"
# Tensors EAGLE-1 checkpoints may carry that the drafter takes from the target instead.
EAGLE1_SHARED = ("embed_tokens.weight", "lm_head.weight")
# The target-config fields an EAGLE-1 layer must share (its layer runs on the target's config and
# rotary embedding): config.json key -> ModelConfig field.
EAGLE1_LAYER_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
                       "intermediate_size": "intermediate_size",
                       "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
                       "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps",
                       "rope_theta": "rope_theta", "rope_scaling": "rope_scaling"}
# SafeAILab cnets1.py: its tensors' prefixes -> our Drafter's.
SAFEAILAB_EAGLE1_PREFIXES = {"fc.": "fc.", "layers.0.": "layer."}
# EAGLE-3 tensor prefixes -> Eagle3Drafter's (SafeAILab, SpecForge and SGLang share names;
# speculators calls the layer layers.0).
SGLANG_EAGLE3_PREFIXES = {"fc.": "fc.", "midlayer.": "midlayer.", "norm.": "norm.",
                          "lm_head.": "lm_head."}
SPECULATORS_EAGLE3_PREFIXES = {"fc.": "fc.", "layers.0.": "midlayer.", "norm.": "norm.",
                               "lm_head.": "lm_head."}
# Config switches whose math we do not run, with the value that means "off": SpecForge's fc_norm
# (per-layer norms before fc) and norm_output (false: no norm before the head); attention_bias,
# which SGLang and vLLM read differently for this layout (SGLang's q/k/v have no bias whatever it
# says, vLLM's follow it); norm_before_residual, vLLM's switch SGLang ignores. (An fc bias,
# SGLang's `bias`, shows as an fc.bias tensor, which the drafter has no place for.)
# tie_word_embeddings is read by `_eagle3_head`.
SGLANG_EAGLE3_OFF = {"fc_norm": False, "norm_output": True, "attention_bias": False,
                     "norm_before_residual": False}
# speculators' Eagle3SpeculatorConfig switches we do not run (norm_before_residual we do).
SPECULATORS_EAGLE3_OFF = {"norm_before_fc": False, "fc_norm": False, "norm_output": False,
                          "embed_requires_grad": False}
SPECULATORS_DRAFT_VOCAB = 32000  # Eagle3SpeculatorConfig's default draft_vocab_size


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors by name, on the CPU: model.safetensors, else pytorch_model.bin
    through torch.load(weights_only=True), which unpickles tensors and containers only."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            return load_file(str(path))
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
            raise ValueError(f"folder: {path} is not a plain tensor checkpoint "
                             f"(torch.load with weights_only=True refused it: {error})") from None
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise ValueError(f"folder: {path} holds {type(state).__name__}, not a dict of named "
                             "tensors")
        return state
    sharded = [p.name for p in folder.glob("*.index.json")]
    if sharded:
        raise ValueError(f"folder: {folder} is sharded ({sharded[0]}); drafter checkpoints are "
                         f"one file: merge the shards into {WEIGHT_FILES[0]}")
    raise FileNotFoundError(f"folder: {folder} has neither {WEIGHT_FILES[0]} nor "
                            f"{WEIGHT_FILES[1]}")


def layer_model_config(layer: dict, folder: Path) -> ModelConfig:
    """A published drafter's one-layer LlamaConfig dict as our ModelConfig (transformers'
    defaults for absent keys: rope_theta 10000, rms_norm_eps 1e-6, head_dim H / heads)."""
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"folder: {folder} has {layers} drafter layers; ours has one (use a "
                         "one-layer drafter)")
    if layer.get("model_type", "llama") not in ("llama", "qwen2"):
        raise ValueError(f"folder: {folder}: its layer is model_type {layer['model_type']!r}; "
                         "we read Llama (and Qwen2-configured EAGLE-1) drafter layers")
    try:  # tie_word_embeddings, copied from the target's config, is about no tensor we build
        return ModelConfig.from_hf_config({**layer, "architectures": ["LlamaForCausalLM"],
                                           "tie_word_embeddings": False})
    except ValueError as error:
        raise ValueError(f"folder: {folder}: its layer config: {error}") from None


def eagle1_drafter(target: Transformer, layer_config: dict, tensors: dict[str, torch.Tensor],
                   prefixes: dict[str, str], folder: Path, *,
                   draft_to_target: torch.Tensor | None = None) -> Drafter:
    """A form-"eagle" Drafter for `target` from an EAGLE-1 checkpoint: its layer config (checked
    against the target's: our layer runs on the target's config and rotary embedding) and its
    tensors, named by `prefixes` (theirs -> ours). An all-zero fc.bias is no bias.
    draft_to_target: the target ids of a reduced draft vocabulary (SGLang's token map), or
    None for the whole vocabulary."""
    theirs = layer_model_config(layer_config, folder)
    mine = target.config
    for key, field in EAGLE1_LAYER_FIELDS.items():
        if getattr(theirs, field) != getattr(mine, field):
            raise ValueError(f"target: the drafter in {folder} has {key} = "
                             f"{getattr(theirs, field)!r}, the target has "
                             f"{getattr(mine, field)!r}; an EAGLE-1 drafter runs on the target's "
                             "shapes, norm eps and RoPE")
    state, unexpected = {}, []
    for name, tensor in tensors.items():
        if name in EAGLE1_SHARED:
            _check_shared_shape(name, tensor, target, folder)
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            unexpected.append(name)
            continue
        state[prefixes[prefix] + name[len(prefix):]] = tensor
    fc_bias = "fc.bias" in state and bool(state["fc.bias"].any())
    if not fc_bias:
        state.pop("fc.bias", None)
    draft_vocab = None if draft_to_target is None else int(draft_to_target.numel())
    drafter = Drafter(target, DrafterConfig(form="eagle", fc_bias=fc_bias,
                                            draft_vocab=draft_vocab), draft_to_target)
    if draft_to_target is not None:
        state["draft_to_target"] = drafter.draft_to_target
    _load_exactly(drafter, state, unexpected, _renamer(prefixes), folder,
                  f"our drafter's layer is the target's {mine.family} layer (attention_bias "
                  f"{mine.attention_bias}), with no input norm")
    return drafter.eval()


def load_published(folder: str | Path, target: Transformer) -> Drafter | Eagle3Drafter:
    """A drafter for `target` from a published EAGLE-1/2 or EAGLE-3 checkpoint folder (the
    module docstring's table), in eval mode."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"folder: {folder} has no {CONFIG_FILE}")
    config = json.loads((folder / CONFIG_FILE).read_text())
    tensors = read_weights(folder)
    architectures = config.get("architectures") or []
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != SPECULATORS_EAGLE3:
            raise ValueError(f"folder: {folder}: speculators_model_type is "
                             f"{config['speculators_model_type']!r}; we read 'eagle' and "
                             f"{SPECULATORS_EAGLE3!r}")
        return _speculators_eagle3(folder, config, tensors, target)
    other = [a for a in architectures if a.endswith(("Eagle", "Eagle3"))
             and a not in EAGLE3_ARCHITECTURES]
    if other:
        raise ValueError(f"folder: {folder}: architecture {other[0]} is not one this reads "
                         f"(EAGLE-3: {' / '.join(EAGLE3_ARCHITECTURES)}; the EAGLE-1 "
                         "LlamaForCausalLMEagle, Qwen2ForCausalLMEagle and "
                         "EagleLlamaForCausalLM go through "
                         "tlt_core.drafting.export.load_drafter)")
    if any(a in EAGLE3_ARCHITECTURES for a in architectures) or any(
            name.startswith("midlayer.") for name in tensors):
        return _sglang_eagle3(folder, config, tensors, target)
    if "fc.weight" in tensors and any(name.startswith("layers.") for name in tensors):
        return _safeailab_eagle1(folder, config, tensors, target)
    raise ValueError(f"folder: {folder} is no drafter layout we read (ours, a tlt export, "
                     "SafeAILab EAGLE-1/2/3, SGLang EAGLE/EAGLE-3, SpecForge, speculators): "
                     f"architectures {architectures}, tensors {sorted(tensors)[:6]}")


# ---- EAGLE-1 ----------------------------------------------------------------------------------

def _safeailab_eagle1(folder: Path, config: dict, tensors: dict[str, torch.Tensor],
                      target: Transformer) -> Drafter:
    """cnets1.py: fc = Linear(2H, H, bias=config "bias", true unless given, ea_model.py);
    layers.0 a LlamaDecoderLayer without input_layernorm, q/k/v biased by config `qkv_bias`."""
    fc_bias = bool(config.get("bias", True))
    if fc_bias != ("fc.bias" in tensors):
        raise ValueError(f"folder: {folder}: its config says bias = {fc_bias} (fc's bias; "
                         f"SafeAILab's default is true), but the weights "
                         f"{'lack' if fc_bias else 'have'} fc.bias")
    return eagle1_drafter(target, config, tensors, SAFEAILAB_EAGLE1_PREFIXES, folder)


# ---- EAGLE-3 ----------------------------------------------------------------------------------

def _sglang_eagle3(folder: Path, config: dict, tensors: dict[str, torch.Tensor],
                   target: Transformer) -> Eagle3Drafter:
    """SafeAILab cnets.py / SpecForge llama3_eagle.py / SGLang llama_eagle3.py: one LlamaConfig
    with draft_vocab_size, eagle_config, the target's vocab_size."""
    _refuse_switches(config, SGLANG_EAGLE3_OFF, folder)
    draft_vocab, head_from_target = _eagle3_head(config, tensors, target, folder)
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ValueError(f"folder: {folder}: eagle_config is {eagle_config!r}, not a dict")
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise ValueError(f"folder: {folder}: eagle_config.use_aux_hidden_state is false (no "
                         "fused target layers); we read EAGLE-3 drafters that fuse them")
    L = target.config.num_layers
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and (not isinstance(ids, list) or not isinstance(top, list)
                            or [j - 1 for j in top if isinstance(j, int)] != ids):
        raise ValueError(f"folder: {folder}: eagle_aux_hidden_state_layer_ids {top} at the top "
                         "level of this layout is read by vLLM (the input of layer j) and ignored "
                         "by SGLang, which reads eagle_config's (the output of layer j): "
                         f"eagle_config has {ids}, so which layers it was trained on is "
                         "ambiguous; give eagle_config's alone, or both with top-level = "
                         "eagle_config's + 1")
    if ids is None:
        outputs, what = [1, L // 2 - 1, L - 4], "the inputs of layers 2, L//2, L-3"
    else:
        outputs, what = ids, "eagle_config.eagle_aux_hidden_state_layer_ids"
    feature_layers = _capture_order(outputs, L, folder, what)
    return _eagle3_drafter(target, config, feature_layers, draft_vocab, False, head_from_target,
                           tensors, SGLANG_EAGLE3_PREFIXES, folder)


def _eagle3_head(config: dict, tensors: dict[str, torch.Tensor], target: Transformer,
                 folder: Path) -> tuple[int, bool]:
    """(draft vocabulary, head_from_target) of an SGLang-layout EAGLE-3 checkpoint.

    With lm_head.weight the head is that tensor, whatever tie_word_embeddings says: SpecForge
    trains it as a Linear of its own (its configs copy tie_word_embeddings from a tied target
    such as Llama 3.2 1B, where it ties nothing) and vLLM loads it. Without one, the engines
    score the whole vocabulary with a tensor of the target's: SGLang with the embedding when
    tie_word_embeddings (the drafter's lm_head is its embed_tokens, which it replaces by the
    target's) or its LM head when draft_vocab_size is absent (load_lm_head_from_target); vLLM
    with the target's LM head. The two agree only when the target's head is its embedding."""
    vocab, tied = target.config.vocab_size, bool(config.get("tie_word_embeddings", False))
    draft_vocab = config.get("draft_vocab_size")
    if "lm_head.weight" in tensors:
        if draft_vocab is None:
            raise ValueError(f"folder: {folder}: lm_head.weight without draft_vocab_size: SGLang "
                             "would score with the target's LM head (load_lm_head_from_target), "
                             "vLLM with this one; give draft_vocab_size")
        return draft_vocab, False
    if draft_vocab not in (None, vocab):
        raise ValueError(f"folder: {folder}: no lm_head.weight for its draft vocabulary of "
                         f"{draft_vocab} tokens (a head from the target covers all {vocab})")
    if draft_vocab is not None and not tied:
        raise ValueError(f"folder: {folder}: no lm_head.weight, draft_vocab_size given and "
                         "tie_word_embeddings false: SGLang would leave its head uninitialised")
    if tied and not target.config.tie_word_embeddings:
        raise ValueError(f"target: the drafter in {folder} has no lm_head.weight and "
                         "tie_word_embeddings true: SGLang scores with the target's embedding, "
                         "vLLM with the target's LM head, which differ for this target (its "
                         "tie_word_embeddings is false)")
    return vocab, True


def _speculators_eagle3(folder: Path, config: dict, tensors: dict[str, torch.Tensor],
                        target: Transformer) -> Eagle3Drafter:
    """Eagle3SpeculatorConfig: transformer_layer_config (its LlamaConfig), draft_vocab_size,
    norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids and switches."""
    _refuse_switches(config, SPECULATORS_EAGLE3_OFF, folder)
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"folder: {folder}: config.json has no transformer_layer_config")
    if layer.get("model_type", "qwen3") != "llama":  # Eagle3SpeculatorConfig's default: Qwen3
        raise ValueError(f"folder: {folder}: transformer_layer_config is model_type "
                         f"{layer.get('model_type', 'qwen3')!r} (per-head q/k norms for qwen3); "
                         "we read Llama-layer EAGLE-3 drafters")
    # tie_word_embeddings in transformer_layer_config (copied from a tied verifier) ties
    # nothing: Eagle3DraftModel's lm_head is a draft-vocabulary Linear of its own.
    L = target.config.num_layers
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    inputs = [2, L // 2, L - 3] if ids is None else ids  # resolve_target_layer_ids' default
    if not isinstance(inputs, list) or any(not isinstance(j, int) or j < 1 for j in inputs):
        raise ValueError(f"folder: {folder}: eagle_aux_hidden_state_layer_ids {inputs}: vLLM "
                         "takes the input of layer j, so j >= 1 (j = 0 is the embedding, which "
                         "the target does not return)")
    feature_layers = _capture_order([j - 1 for j in inputs], L, folder,
                                    f"the inputs of layers {inputs}")
    layer = {**layer, "target_hidden_size": config.get("target_hidden_size")}
    draft_vocab = config.get("draft_vocab_size", SPECULATORS_DRAFT_VOCAB)
    norm_before_residual = bool(config.get("norm_before_residual", False))
    return _eagle3_drafter(target, layer, feature_layers, draft_vocab, norm_before_residual,
                           False, tensors, SPECULATORS_EAGLE3_PREFIXES, folder)


def _eagle3_drafter(target: Transformer, layer_config: dict, feature_layers: tuple[int, ...],
                    draft_vocab: int, norm_before_residual: bool, head_from_target: bool,
                    tensors: dict[str, torch.Tensor], prefixes: dict[str, str],
                    folder: Path) -> Eagle3Drafter:
    c = target.config
    if not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise ValueError(f"folder: {folder}: draft_vocab_size is {draft_vocab!r}; expected an "
                         "int >= 1")
    layer = layer_model_config(layer_config, folder)
    target_hidden = layer_config.get("target_hidden_size")
    for key, theirs, mine in (("hidden_size", layer.hidden_size, c.hidden_size),
                              ("target_hidden_size", target_hidden or c.hidden_size,
                               c.hidden_size),
                              ("vocab_size", layer.vocab_size, c.vocab_size)):
        if theirs != mine:
            raise ValueError(f"target: the drafter in {folder} has {key} = {theirs}, the target "
                             f"has {mine}; an EAGLE-3 drafter embeds with the target's embedding "
                             "and fuses its hidden states")
    state, unexpected, draft_ids = {}, [], torch.arange(draft_vocab)
    for name, tensor in tensors.items():
        if name == "d2t":  # target id = draft id + d2t[draft id]
            if tensor.shape != (draft_vocab,):
                raise ValueError(f"folder: {folder}: d2t has shape {tuple(tensor.shape)}, "
                                 f"draft_vocab_size is {draft_vocab}")
            draft_ids = draft_ids + tensor.to(torch.int64)
        elif name == "t2d":  # the inverse map, a (V,) mask; unused, as in SGLang and vLLM
            if tensor.shape != (c.vocab_size,):
                raise ValueError(f"target: t2d in {folder} covers {tuple(tensor.shape)} ids, "
                                 f"the target's vocabulary is ({c.vocab_size},)")
        elif name == "embed_tokens.weight":
            _check_shared_shape(name, tensor, target, folder)
        else:
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is None:
                unexpected.append(name)
            else:
                state[prefixes[prefix] + name[len(prefix):]] = tensor
    try:
        drafter = Eagle3Drafter(target, Eagle3Config(layer, feature_layers, draft_vocab,
                                                     norm_before_residual, head_from_target),
                                draft_ids)
    except ValueError as error:  # d2t's ids
        raise ValueError(f"folder: {folder}: {error}") from None
    state["draft_to_target"] = drafter.draft_to_target
    _load_exactly(drafter, state, unexpected, _renamer(prefixes), folder,
                  "our EAGLE-3 layer is a Llama layer without biases unless attention_bias")
    return drafter.eval()


def _capture_order(outputs: list, num_layers: int, folder: Path, what: str) -> tuple[int, ...]:
    """The target layers (outputs) the drafter fuses, in the order fc reads them: ascending, as
    SGLang and vLLM append each capture when their layer loop reaches it."""
    if (not isinstance(outputs, list) or not outputs
            or any(not isinstance(i, int) or not 0 <= i < num_layers for i in outputs)
            or len(set(outputs)) != len(outputs)):
        raise ValueError(f"target: the drafter in {folder} fuses the outputs of target layers "
                         f"{outputs} ({what}), which a {num_layers}-layer target cannot give as "
                         "distinct layers")
    return tuple(sorted(outputs))


# ---- shared checks ----------------------------------------------------------------------------

def _refuse_switches(config: dict, off: dict, folder: Path) -> None:
    for key, value in off.items():
        if key in config and config[key] is not None and bool(config[key]) != value:
            raise ValueError(f"folder: {folder}: {key} is {config[key]!r}; the drafter we "
                             f"build runs the math of {key} = {value} only")


def _check_shared_shape(name: str, tensor: torch.Tensor, target: Transformer,
                        folder: Path) -> None:
    """A copy of a target tensor the checkpoint carries: the target's own is used, so it must
    at least be the target's shape (another shape means another target)."""
    c = target.config
    if tuple(tensor.shape) != (c.vocab_size, c.hidden_size):
        raise ValueError(f"target: {name} in {folder} has shape {tuple(tensor.shape)}, the "
                         f"target's is ({c.vocab_size}, {c.hidden_size}): a drafter for another "
                         "target or vocabulary")


def _renamer(prefixes: dict[str, str]) -> Callable[[str], str]:
    """Our state_dict name -> the checkpoint's, for messages."""
    back = {ours: theirs for theirs, ours in prefixes.items()}

    def theirs(name: str) -> str:
        prefix = next((p for p in back if name.startswith(p)), None)
        return name if prefix is None else back[prefix] + name[len(prefix):]
    return theirs


def _load_exactly(module: torch.nn.Module, state: dict[str, torch.Tensor], unexpected: list,
                  theirs: Callable[[str], str], folder: Path, layer_note: str) -> None:
    """Loads `state` into `module` when it fills every tensor with one of the same shape and
    nothing is left over; otherwise says which tensors do not fit."""
    expected = module.state_dict()
    unexpected = sorted(unexpected + [theirs(n) for n in state if n not in expected])
    missing = sorted(theirs(n) for n in expected if n not in state)
    if unexpected or missing:
        raise ValueError(f"folder: {folder}: tensors the drafter has no place for: {unexpected}; "
                         f"tensors missing: {missing} ({layer_note})")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"target: {theirs(name)} in {folder} has shape "
                             f"{tuple(tensor.shape)}, the drafter for this target needs "
                             f"{tuple(expected[name].shape)}")
    module.load_state_dict(state, strict=True)
