"""Exporting the drafter to the formats serving engines load, and reading those exports back.

Only a form-"eagle" drafter (`DrafterConfig(form="eagle")`, tlt_core.drafting.drafter) is exported: its
math is EAGLE-1's exactly, as the engines run it. A form-"tlt" drafter reads the target's hidden
state before the final norm and normalises before the LM head; no EAGLE-1 server does either,
so it has no exact representation and export refuses it (as it refuses EAGLE-3 style fusion of
several target layers, which the EAGLE-1 layouts cannot express).

The math both layouts run (x_{t+1} the next token, f_t the target's hidden state after its
final norm, i.e. what its LM head sees):

    h0 = fc([embed(x_{t+1}); f_t])            embed and lm_head: the target's own
    h  = h0 + attn(h0)                        no input norm (identity)
    f' = h + mlp(post_attention_norm(h))      no final norm
    logits = lm_head(f')

Formats:
- "eagle": the EAGLE-1 checkpoint layout SGLang serves as `LlamaForCausalLMEagle`
  (python/sglang/srt/models/llama_eagle.py: layer 0's input_layernorm replaced by the identity,
  `fc = nn.Linear(2H, H)` with a bias, output `hidden + residual` with no norm; its load_weights
  prepends `model.`; embedding and head are replaced by the target's) and the original
  SafeAILab/EAGLE cnets.py defines. config.json is a LlamaConfig with one hidden layer;
  model.safetensors; provenance in tlt_provenance.json beside them.
- "speculators": vLLM's speculators library (vllm-project/speculators:
  src/speculators/models/eagle.py `EagleSpeculatorConfig` / `EagleSpeculator`,
  src/speculators/config.py `SpeculatorsConfig` / `VerifierConfig`,
  src/speculators/proposals/greedy.py, and the layout its convert/eagle/eagle_converter.py
  writes): config.json with speculators_model_type "eagle", layernorms false (input_layernorm
  is nn.Identity, no extra norms), fusion_bias false; model.safetensors. Provenance goes in
  config.json under `tlt_provenance`: SpeculatorModelConfig is a pydantic model with
  extra="allow", so the key loads and round-trips.

Field mapping (the target's embedding, final norm and LM head are never written: every engine
takes them from the target):

    ours                                   eagle (SGLang)            speculators
    fc.weight (H, 2H)                      fc.weight                 fusion_fc.weight
    fc.bias (H,) with fc_bias, else none   fc.bias (zeros if none)   fusion_fc.bias, fusion_bias
    layer.self_attn.{q,k,v,o}_proj.*       layers.0.self_attn.*      transformer.self_attn.*
    layer.mlp.{gate,up,down}_proj.weight   layers.0.mlp.*            transformer.mlp.*
    layer.post_attention_layernorm.weight  layers.0.post_attention_  transformer.post_attention_
                                           layernorm.weight          layernorm.weight
    layer.input_layernorm = Identity       (none: identity)          (none: layernorms false)
    target config (H, heads, rope, eps, V) config.json fields        transformer_layer_config

(and the attention projections' biases likewise, for attention_bias targets)

SGLang's fc has a bias (nn.Linear's default), so the eagle layout writes zeros for a drafter
without one: leaving it out would leave SGLang's freshly initialised bias in place. Reading back,
an all-zero fc.bias is no bias.

Provenance (both layouts): target_sha256 (`target_sha256`: the target's state_dict tensors in
name order), rl_step, acceptance_length, tlt_core_version, date (UTC), format, drafter_form,
fc_bias, plus whatever else the caller adds. A folder whose provenance disagrees with its
weights about the fc bias is refused on reading: they are not what export_drafter wrote.

`load_drafter`, what every `--drafter` flag uses, tells apart by their files a folder saved by
Drafter.save, an export in either layout (any checkpoint in SGLang's EAGLE-1 layouts,
LlamaForCausalLMEagle and Qwen2ForCausalLMEagle, or speculators' EAGLE-1 layout), and the
published layouts tlt_core.drafting.published reads (SafeAILab EAGLE-1/2, EAGLE-3 in SafeAILab's,
SpecForge's, SGLang's and speculators' layouts).

Shapes: H hidden size, V vocabulary.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tlt_core._version import __version__
from tlt_core.drafting.drafter import DRAFTER_CONFIG_FILE, Drafter
from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.drafting.published import eagle1_drafter, load_published, read_weights
from tlt_core.model.transformer import ARCHITECTURES, Transformer

EXPORT_FORMATS = ("eagle", "speculators")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "tlt_provenance.json"  # the eagle layout's side file
PROVENANCE_KEY = "tlt_provenance"  # the speculators layout's config.json key
PROVENANCE_REQUIRED = ("rl_step", "acceptance_length")  # the caller's; None when unknown
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle"
# SGLang's EAGLE-1 entry classes (llama_eagle.py, qwen2_eagle.py): the same tensors, a Llama or
# a Qwen2 layer config.
SGLANG_EAGLE1_ARCHITECTURES = (SGLANG_ARCHITECTURE, "Qwen2ForCausalLMEagle")
SPECULATORS_LAYER = "LlamaDecoderLayer"
# speculators_version to write: the release whose schema this layout follows (the library
# itself writes its installed version there; nothing reads it back as a constraint).
SPECULATORS_VERSION = "0.1.0"
# Prefixes of our state_dict names -> each layout's.
_PREFIXES = {"eagle": {"fc.": "fc.", "layer.": "layers.0."},
             "speculators": {"fc.": "fusion_fc.", "layer.": "transformer."}}


def target_sha256(model: nn.Module) -> str:
    """sha256 over the model's state_dict in name order (name, dtype, shape and bytes of each
    tensor): the identity of the weights as loaded, whatever files or shards they came from.
    Casting the same checkpoint to another dtype gives another hash."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def exportable(drafter: Drafter) -> str | None:
    """None when `drafter` has an exact representation in the EAGLE-1 layouts; otherwise why
    not and what to do instead."""
    config, reasons = drafter.config, []
    if config.form != "eagle":
        reasons.append(
            f"it is form {config.form!r}, which reads the target's hidden state before the "
            "final norm and normalises before the LM head, where EAGLE-1 servers feed the "
            "normed hidden state and apply no norm")
    if config.draft_vocab is not None:
        reasons.append(f"its head covers a reduced draft vocabulary of {config.draft_vocab} "
                       "tokens; EAGLE-1 drafters score the target's whole vocabulary")
    if len(config.feature_layers) > 1:
        reasons.append(f"it fuses {len(config.feature_layers)} target layers "
                       f"{config.feature_layers} (EAGLE-3 style); EAGLE-1 reads the last only")
    if reasons:
        return ("drafter: no exact representation in the EAGLE-1 serving formats: "
                + "; ".join(reasons) + ". Train it with DrafterConfig(form='eagle') "
                "(feature_layers=(-1,), no draft_vocab) and export that drafter")
    attn = drafter.layer.self_attn
    if attn.qk_norm:
        return ("drafter: its layer has per-head q/k norms (a Qwen3 target); the Llama decoder "
                "layer both formats use has none")
    if (attn.q_proj.bias is None) != (attn.o_proj.bias is None):
        return ("drafter: its layer has q/k/v biases without an o_proj bias (a Qwen2 target); "
                "Llama's attention_bias gives all four or none")
    return None


def export_drafter(drafter: Drafter, out: str | Path, to: str, provenance: dict, *,
                   speculative_tokens: int = 5) -> Path:
    """Writes `drafter` (form "eagle") in layout `to` ("eagle" or "speculators") into folder
    `out` (created if needed; our files in it are overwritten) and returns the folder.
    provenance: at least rl_step and acceptance_length (None when unknown) and anything else
    JSON-serialisable; target_sha256 is computed from the drafter's target unless given, and
    tlt_core_version, date, format and drafter_form are added. speculative_tokens: the
    speculators layout's greedy proposal length, which vLLM reads as num_speculative_tokens
    (5 as in the speculators converter)."""
    if to not in EXPORT_FORMATS:
        raise ValueError(f"to: expected one of {EXPORT_FORMATS}, got {to!r}")
    problem = exportable(drafter)
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(provenance, dict):
        raise TypeError(f"provenance: expected a dict, got {type(provenance).__name__}")
    missing = [key for key in PROVENANCE_REQUIRED if key not in provenance]
    if missing:
        raise ValueError(f"provenance: needs {missing} (None when unknown)")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"speculative_tokens: must be an int >= 1, got {speculative_tokens!r}")
    record = {**provenance,
              "target_sha256": provenance.get("target_sha256") or target_sha256(drafter.target),
              "tlt_core_version": __version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "format": to, "drafter_form": drafter.config.form,
              "fc_bias": drafter.config.fc_bias}
    try:
        json.dumps(record)
    except TypeError as error:
        raise ValueError(f"provenance: not JSON-serialisable ({error})") from None

    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"out: {folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _export_tensors(drafter, to)
    layer_config = _llama_layer_config(drafter.target, dtype=drafter.fc.weight.dtype)
    if to == "eagle":
        config = {"architectures": [SGLANG_ARCHITECTURE], **layer_config}
        (folder / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    else:
        config = _speculators_config(drafter.target, layer_config, speculative_tokens,
                                     provenance.get("target_name_or_path"),
                                     drafter.config.fc_bias)
        config[PROVENANCE_KEY] = record
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def load_export(folder: str | Path, target: Transformer) -> Drafter:
    """A form-"eagle" Drafter attached to `target` from a folder in either layout (ours, or any
    EAGLE-1 checkpoint in them: SGLang's LlamaForCausalLMEagle / Qwen2ForCausalLMEagle, or
    speculators' "eagle" with no extra norms), weights in model.safetensors or
    pytorch_model.bin."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"folder: {folder} has no {CONFIG_FILE}; is it an export by "
                                "tlt_core.drafting.export?")
    config = json.loads((folder / CONFIG_FILE).read_text())
    layout = _export_layout(config)
    if layout is None:
        raise ValueError(f"folder: {folder}: config.json is neither a speculators config "
                         f"(speculators_model_type 'eagle') nor an SGLang EAGLE-1 one "
                         f"(architectures {list(SGLANG_EAGLE1_ARCHITECTURES)})")
    tensors = read_weights(folder)
    layer_config = config
    if layout == "speculators":
        wanted = {"layernorms": False, "transformer_layer_architecture": SPECULATORS_LAYER}
        for key, value in wanted.items():
            if config.get(key, value) != value:
                raise ValueError(f"folder: {folder}: {key} is {config.get(key)!r}; only "
                                 f"{value!r} has our drafter's math")
        if bool(config.get("fusion_bias", False)) != ("fusion_fc.bias" in tensors):
            raise ValueError(f"folder: {folder}: fusion_bias is {config.get('fusion_bias')!r} "
                             "but the weights disagree about fusion_fc.bias")
        layer_config = config.get("transformer_layer_config")
        if not isinstance(layer_config, dict):
            raise ValueError(f"folder: {folder}: config.json has no transformer_layer_config")
    prefixes = {theirs: ours for ours, theirs in _PREFIXES[layout].items()}
    drafter = eagle1_drafter(target, layer_config, tensors, prefixes, folder)
    _check_provenance_fc_bias(folder, config, drafter, layout)
    return drafter


def load_drafter(folder: str | Path, target: Transformer) -> Drafter | Eagle3Drafter:
    """A drafter for `target` from a folder, told apart by its files: one saved by Drafter.save
    (drafter_config.json), an export in either layout (config.json: an SGLang EAGLE-1 or
    speculators "eagle" config), or a published EAGLE-1/2 or EAGLE-3 checkpoint
    (tlt_core.drafting.published). `--drafter` takes any of them."""
    folder = Path(folder)
    if (folder / DRAFTER_CONFIG_FILE).is_file():
        return Drafter.load(folder, target)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"drafter: {folder} has neither {DRAFTER_CONFIG_FILE} (a "
                                f"drafter saved by tlt_core) nor {CONFIG_FILE} (an EAGLE, "
                                "EAGLE-3 or speculators drafter)")
    if _export_layout(json.loads((folder / CONFIG_FILE).read_text())) is not None:
        return load_export(folder, target)
    return load_published(folder, target)


def read_provenance(folder: str | Path) -> dict:
    """The provenance record export_drafter wrote into `folder` (either layout)."""
    folder = Path(folder)
    if (folder / PROVENANCE_FILE).is_file():
        return json.loads((folder / PROVENANCE_FILE).read_text())
    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if PROVENANCE_KEY in config:
            return config[PROVENANCE_KEY]
    raise FileNotFoundError(f"folder: {folder} has no {PROVENANCE_FILE} and no "
                            f"{PROVENANCE_KEY!r} in its {CONFIG_FILE}")


# ---- helpers -----------------------------------------------------------------------------------

def _export_name(name: str, layout: str) -> str:
    for ours, theirs in _PREFIXES[layout].items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise AssertionError(f"no {layout} name for drafter tensor {name}")


def _export_tensors(drafter: Drafter, layout: str) -> dict[str, torch.Tensor]:
    tensors = {_export_name(name, layout): tensor.detach().to("cpu").contiguous()
               for name, tensor in drafter.state_dict().items()}
    if layout == "eagle" and drafter.fc.bias is None:  # SGLang's fc always has a bias
        tensors["fc.bias"] = torch.zeros(drafter.fc.out_features, dtype=drafter.fc.weight.dtype)
    return tensors


def _llama_layer_config(target: Transformer, dtype: torch.dtype) -> dict:
    """The LlamaConfig dict of the drafter's one layer: the target's shapes, RoPE and eps (the
    servers build the layer's rotary embedding from these), one hidden layer, untied (the
    servers swap in the target's embedding and head, which SGLang cannot do to a tied pair)."""
    c = target.config
    return {"model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": None if c.rope_scaling is None else dict(c.rope_scaling),
            "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": c.attention_bias, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def _speculators_config(target: Transformer, layer_config: dict, speculative_tokens: int,
                        target_name_or_path: str | None, fusion_bias: bool) -> dict:
    """EagleSpeculatorConfig as its save_pretrained writes it (architectures gain the layer
    class, check_add_architectures)."""
    verifier_architecture = next(name for name, family in ARCHITECTURES.items()
                                 if family == target.config.family)
    return {
        "speculators_model_type": "eagle",
        "architectures": ["EagleSpeculator", SPECULATORS_LAYER],
        "transformer_layer_architecture": SPECULATORS_LAYER,
        "transformer_layer_config": layer_config,
        "layernorms": False,
        "fusion_bias": fusion_bias,
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name_or_path,
                         "architectures": [verifier_architecture]},
        },
        "speculators_version": SPECULATORS_VERSION,
        "torch_dtype": layer_config["torch_dtype"],
    }


def _export_layout(config: dict) -> str | None:
    """"speculators" or "eagle" for a config in a layout export_drafter writes, else None."""
    if config.get("speculators_model_type") == "eagle":
        return "speculators"
    if any(name in SGLANG_EAGLE1_ARCHITECTURES for name in config.get("architectures") or []):
        return "eagle"
    return None


def _check_provenance_fc_bias(folder: Path, config: dict, drafter: Drafter, layout: str) -> None:
    """Our provenance records whether the exported drafter had an fc bias (exports that predate
    the field had none); weights that say otherwise are not what export_drafter wrote."""
    if (folder / PROVENANCE_FILE).is_file():
        record = json.loads((folder / PROVENANCE_FILE).read_text())
    else:
        record = config.get(PROVENANCE_KEY)
    exported_with_bias = isinstance(record, dict) and bool(record.get("fc_bias", False))
    if not isinstance(record, dict) or exported_with_bias == drafter.config.fc_bias:
        return
    name = _export_name("fc.bias", layout)
    found = "is not zero" if drafter.config.fc_bias else "is zero or absent"
    raise ValueError(f"folder: {folder}: {name} {found}, but its provenance records a drafter "
                     f"exported {'with' if exported_with_bias else 'without'} an fc bias: "
                     "these are not the weights export_drafter wrote")
