"""Exporting drafters to the layouts serving engines load, and reading those exports back.

Layouts (`export_drafter(drafter, out, to=...)`):

- "eagle": EAGLE-1, for a form-"eagle" `Drafter` (tlt_core.drafting.drafter), whose math is
  EAGLE-1's exactly as the engines run it (below). SGLang serves it as `LlamaForCausalLMEagle`
  (python/sglang/srt/models/llama_eagle.py), vLLM as `EagleLlamaForCausalLM`
  (vllm/model_executor/models/llama_eagle.py); config.json lists both names, and each engine's
  registry takes the first it knows (vLLM prefixes "Eagle" to a name that lacks it, so a
  LlamaForCausalLMEagle alone is unknown to it). config.json is a LlamaConfig with one hidden
  layer; model.safetensors; provenance in tlt_provenance.json beside them. A reduced draft
  vocabulary (`DrafterConfig.draft_vocab`, the default of `tlt drafter train`) adds
  speculative_token_map.pt, the V' target ids in draft order, for SGLang's
  `--speculative-token-map` (FR-Spec: its EAGLE worker scores the target head's rows at those
  ids, as our drafter does); vLLM has no such option and drafts over the whole vocabulary.
- "eagle3" and "speculators": an `Eagle3Drafter` (a published EAGLE-3 drafter, imported) in
  the SGLang/vLLM/SpecForge layout or speculators 0.9.0's, with d2t/t2d for its reduced
  vocabulary (tlt_core.drafting.eagle3_layouts says which fields and tensors). speculators
  0.9.0 has no EAGLE-1 model (its registry holds eagle3, dflash, dspark, mtp, peagle and
  others), so a `Drafter` exports to "eagle" only.

A form-"tlt" drafter reads the target's hidden state before the final norm and normalises before
the LM head; no EAGLE-1 server does either, so it has no exact representation and export refuses
it, as it refuses our EAGLE-3 style fusion of several target layers (a `fuse` linear, then
EAGLE-1's layer), which is not EAGLE-3's layer either.

The math of the EAGLE-1 layout (x_{t+1} the next token, f_t the target's hidden state after its
final norm, i.e. what its LM head sees):

    h0 = fc([embed(x_{t+1}); f_t])            embed and lm_head: the target's own
    h  = h0 + attn(h0)                        no input norm (identity)
    f' = h + mlp(post_attention_norm(h))      no final norm
    logits = lm_head(f')                      (rows draft_to_target with a reduced vocabulary)

Field mapping of the EAGLE-1 layout (the target's embedding, final norm and LM head are never
written: every engine takes them from the target):

    ours                                   eagle
    fc.weight (H, 2H)                      fc.weight
    fc.bias (H,) with fc_bias, else none   fc.bias (zeros if none: SGLang's fc has a bias)
    layer.self_attn.{q,k,v,o}_proj.*       layers.0.self_attn.*
    layer.mlp.{gate,up,down}_proj.weight   layers.0.mlp.*
    layer.post_attention_layernorm.weight  layers.0.post_attention_layernorm.weight
    layer.input_layernorm = Identity       (none: identity in layer 0)
    draft_to_target (V',)                  speculative_token_map.pt
    target config (H, heads, rope, eps, V) config.json fields

vLLM's EAGLE-1 fc has no bias: a drafter trained with `fc_bias` runs there without it (ours
train without one). Reading back, an all-zero fc.bias is no bias.

Every file of an export folder is written mode 0644 (readable by the server's user):
safetensors writes a private temporary file and renames it, which leaves 0600.

Provenance (every layout): target_sha256 (`target_sha256`: the target's state_dict tensors in
name order), rl_step, acceptance_length, tlt_core_version, date (UTC), format, drafter_form,
fc_bias, draft_vocab, plus whatever else the caller adds; in tlt_provenance.json for the
"eagle" and "eagle3" layouts, under config.json's `tlt_provenance` for speculators
(SpeculatorModelConfig is a pydantic model with extra="allow": the key loads and round-trips).
A folder whose provenance disagrees with its weights about the fc bias is refused on reading.

`load_drafter`, what every `--drafter` flag uses, tells apart by their files a folder saved by
Drafter.save, an EAGLE-1 export (SGLang's LlamaForCausalLMEagle / Qwen2ForCausalLMEagle or
vLLM's EagleLlamaForCausalLM, and the speculators "eagle" layout of speculators releases before
0.9.0), and the published layouts tlt_core.drafting.published reads (SafeAILab EAGLE-1/2,
EAGLE-3 in SafeAILab's, SpecForge's, SGLang's/vLLM's and speculators' layouts, which is where
the "eagle3" and "speculators" exports are read back).

Shapes: H hidden size, V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from tlt_core._version import __version__
from tlt_core.drafting import eagle3_layouts
from tlt_core.drafting.drafter import DRAFTER_CONFIG_FILE, Drafter, check_draft_ids
from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.drafting.published import eagle1_drafter, load_published, read_weights
from tlt_core.model.transformer import Transformer
from tlt_core.persistence.checkpoint_io import FILE_MODE, write_safetensors

EXPORT_FORMATS = ("eagle", "eagle3", "speculators")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKEN_MAP_FILE = "speculative_token_map.pt"  # SGLang's --speculative-token-map
PROVENANCE_FILE = "tlt_provenance.json"  # the eagle and eagle3 layouts' side file
PROVENANCE_KEY = "tlt_provenance"  # the speculators layout's config.json key
PROVENANCE_REQUIRED = ("rl_step", "acceptance_length")  # the caller's; None when unknown
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle"
VLLM_ARCHITECTURE = "EagleLlamaForCausalLM"
# EAGLE-1 entry classes: SGLang's (llama_eagle.py, qwen2_eagle.py: the same tensors, a Llama or
# a Qwen2 layer config) and vLLM's.
EAGLE1_ARCHITECTURES = (SGLANG_ARCHITECTURE, "Qwen2ForCausalLMEagle", VLLM_ARCHITECTURE)
SPECULATORS_LAYER = "LlamaDecoderLayer"  # speculators' EAGLE-1 layout (releases before 0.9.0)
# Prefixes of our state_dict names -> each EAGLE-1 layout's.
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


def exportable(drafter: Drafter | Eagle3Drafter, to: str = "eagle") -> str | None:
    """None when `drafter` has an exact representation in layout `to`; otherwise why not and
    what to do instead."""
    if to not in EXPORT_FORMATS:
        raise ValueError(f"to: expected one of {EXPORT_FORMATS}, got {to!r}")
    if isinstance(drafter, Eagle3Drafter):
        if to == "eagle":
            return ("drafter: an EAGLE-3 drafter has its own layer, norm and head, which the "
                    "EAGLE-1 layout cannot hold; export it --to eagle3 or --to speculators")
        return eagle3_layouts.layouts_problem(drafter, to)
    if to != "eagle":
        return (f"drafter: a tlt_core Drafter runs EAGLE-1's math, which the {to} layout (an "
                "EAGLE-3 drafter's) cannot hold: speculators 0.9.0 has no EAGLE-1 model. "
                "Export it --to eagle (SGLang and vLLM serve that)")
    config, reasons = drafter.config, []
    if config.form != "eagle":
        reasons.append(
            f"it is form {config.form!r}, which reads the target's hidden state before the "
            "final norm and normalises before the LM head, where EAGLE-1 servers feed the "
            "normed hidden state and apply no norm")
    if len(config.feature_layers) > 1:
        reasons.append(f"it fuses {len(config.feature_layers)} target layers "
                       f"{config.feature_layers} through EAGLE-1's layer, which neither EAGLE-1 "
                       "(the last layer only) nor EAGLE-3 (another layer) runs")
    if reasons:
        return ("drafter: no exact representation in the EAGLE-1 serving layout: "
                + "; ".join(reasons) + ". Train it with DrafterConfig(form='eagle') "
                "(feature_layers=(-1,)) and export that drafter")
    attn = drafter.layer.self_attn
    if attn.qk_norm:
        return ("drafter: its layer has per-head q/k norms (a Qwen3 target); the Llama decoder "
                "layer of the EAGLE-1 layout has none")
    if (attn.q_proj.bias is None) != (attn.o_proj.bias is None):
        return ("drafter: its layer has q/k/v biases without an o_proj bias (a Qwen2 target); "
                "Llama's attention_bias gives all four or none")
    return None


def export_drafter(drafter: Drafter | Eagle3Drafter, out: str | Path, to: str, provenance: dict,
                   *, speculative_tokens: int = 5) -> Path:
    """Writes `drafter` in layout `to` ("eagle" for a form-"eagle" Drafter, "eagle3" or
    "speculators" for an Eagle3Drafter) into folder `out` (created if needed; our files in it
    are overwritten, each mode 0644) and returns the folder.
    provenance: at least rl_step and acceptance_length (None when unknown) and anything else
    JSON-serialisable (target_name_or_path becomes the speculators verifier's name_or_path);
    target_sha256 is computed from the drafter's target unless given, and tlt_core_version,
    date, format, drafter_form, fc_bias and draft_vocab are added. speculative_tokens: the
    speculators layout's greedy proposal length (vLLM's num_speculative_tokens)."""
    problem = exportable(drafter, to)
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(provenance, dict):
        raise TypeError(f"provenance: expected a dict, got {type(provenance).__name__}")
    missing = [key for key in PROVENANCE_REQUIRED if key not in provenance]
    if missing:
        raise ValueError(f"provenance: needs {missing} (None when unknown)")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"speculative_tokens: must be an int >= 1, got {speculative_tokens!r}")
    eagle3 = isinstance(drafter, Eagle3Drafter)
    record = {**provenance,
              "target_sha256": provenance.get("target_sha256") or target_sha256(drafter.target),
              "tlt_core_version": __version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "format": to, "drafter_form": "eagle3" if eagle3 else drafter.config.form,
              "fc_bias": False if eagle3 else drafter.config.fc_bias,
              "draft_vocab": drafter.config.draft_vocab}
    try:
        json.dumps(record)
    except TypeError as error:
        raise ValueError(f"provenance: not JSON-serialisable ({error})") from None

    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"out: {folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if to == "eagle":
        config = {"architectures": [SGLANG_ARCHITECTURE, VLLM_ARCHITECTURE],
                  **eagle3_layouts.llama_layer_config(
                      drafter.target.config, drafter.fc.weight.dtype,
                      attention_bias=drafter.target.config.attention_bias)}
        tensors = _export_tensors(drafter)
        if drafter.draft_to_target is not None:
            torch.save(drafter.draft_to_target.detach().to("cpu", torch.int64),
                       folder / TOKEN_MAP_FILE)
            written.append(TOKEN_MAP_FILE)
    elif to == "eagle3":
        config, tensors = eagle3_layouts.eagle3_files(drafter)
    else:
        config, tensors = eagle3_layouts.speculators_files(
            drafter, speculative_tokens, provenance.get("target_name_or_path"))
        config[PROVENANCE_KEY] = record
    if to != "speculators":
        (folder / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        written.append(PROVENANCE_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(tensors, folder / WEIGHTS_FILE, {"format": "pt"})
    for name in written + [CONFIG_FILE, WEIGHTS_FILE]:
        os.chmod(folder / name, FILE_MODE)
    return folder


def load_export(folder: str | Path, target: Transformer) -> Drafter:
    """A form-"eagle" Drafter attached to `target` from an EAGLE-1 export (ours, or any EAGLE-1
    checkpoint in that layout: SGLang's LlamaForCausalLMEagle / Qwen2ForCausalLMEagle, vLLM's
    EagleLlamaForCausalLM, or the speculators "eagle" layout of releases before 0.9.0 with no
    extra norms), weights in model.safetensors or pytorch_model.bin, a reduced draft vocabulary
    from speculative_token_map.pt. ("eagle3" and "speculators" exports are read by
    load_drafter, through tlt_core.drafting.published.)"""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"folder: {folder} has no {CONFIG_FILE}; is it an export by "
                                "tlt_core.drafting.export?")
    config = json.loads((folder / CONFIG_FILE).read_text())
    layout = _export_layout(config)
    if layout is None:
        raise ValueError(f"folder: {folder}: config.json is neither a speculators EAGLE-1 "
                         f"config (speculators_model_type 'eagle') nor an EAGLE-1 one "
                         f"(architectures {list(EAGLE1_ARCHITECTURES)})")
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
    drafter = eagle1_drafter(target, layer_config, tensors, prefixes, folder,
                             draft_to_target=_token_map(folder, target))
    _check_provenance_fc_bias(folder, config, drafter, layout)
    return drafter


def load_drafter(folder: str | Path, target: Transformer) -> Drafter | Eagle3Drafter:
    """A drafter for `target` from a folder, told apart by its files: one saved by Drafter.save
    (drafter_config.json), an EAGLE-1 export (config.json: an SGLang/vLLM EAGLE-1 or speculators
    "eagle" config), or a published EAGLE-1/2 or EAGLE-3 checkpoint, our "eagle3" and
    "speculators" exports among them (tlt_core.drafting.published). `--drafter` takes any of
    them. A drafter for another vocabulary or hidden size is refused with a ValueError naming
    both."""
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
    """The provenance record export_drafter wrote into `folder` (any layout)."""
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


def _export_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The EAGLE-1 layout's tensors (draft_to_target goes to the token map)."""
    tensors = {_export_name(name, "eagle"): tensor.detach().to("cpu").contiguous()
               for name, tensor in drafter.state_dict().items() if name != "draft_to_target"}
    if drafter.fc.bias is None:  # SGLang's fc always has a bias
        tensors["fc.bias"] = torch.zeros(drafter.fc.out_features, dtype=drafter.fc.weight.dtype)
    return tensors


def _token_map(folder: Path, target: Transformer) -> torch.Tensor | None:
    """The draft vocabulary of an EAGLE-1 export: speculative_token_map.pt's target ids (read
    with weights_only=True, which unpickles tensors and containers only), or None."""
    path = folder / TOKEN_MAP_FILE
    if not path.is_file():
        return None
    try:
        ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as error:  # noqa: BLE001 - whatever the unpickler refuses, say which file
        raise ValueError(f"folder: {path} is not a tensor of token ids ({error})") from None
    try:
        return check_draft_ids(ids, int(ids.numel()), target.config.vocab_size, ascending=False)
    except ValueError as error:
        raise ValueError(f"folder: {path}: {error} (the target's vocabulary is "
                         f"{target.config.vocab_size})") from None




def _export_layout(config: dict) -> str | None:
    """"speculators" (the EAGLE-1 one) or "eagle" for an EAGLE-1 config, else None."""
    if config.get("speculators_model_type") == "eagle":
        return "speculators"
    if any(name in EAGLE1_ARCHITECTURES for name in config.get("architectures") or []):
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
