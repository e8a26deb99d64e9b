"""The EAGLE-3 drafter (tlt_core.drafting.eagle3) in the two layouts the serving engines load:
config dicts and tensors to write. Reading them back is tlt_core.drafting.published's.

- "eagle3": the layout SGLang, vLLM and SpecForge share (SGLang
  python/sglang/srt/models/llama_eagle3.py, vLLM vllm/model_executor/models/llama_eagle3.py,
  SpecForge specforge/modeling/draft/llama3_eagle.py): a one-layer LlamaConfig with
  architectures ["LlamaForCausalLMEagle3"] (a name both engines' model registries map to their
  EAGLE-3 Llama drafter; vLLM also registers it as "Eagle3LlamaForCausalLM"), draft_vocab_size
  and target_hidden_size; tensors fc.weight (H, 3H), midlayer.* (q/k/v over 2H inputs,
  input_layernorm, hidden_norm, post_attention_layernorm, mlp), norm.weight, lm_head.weight
  (V', H), d2t and t2d.
- "speculators": speculators 0.9.0's `Eagle3SpeculatorConfig` (speculators_model_type "eagle3",
  src/speculators/models/eagle3/config.py) and `Eagle3DraftModel`'s state dict
  (core.py: embed_tokens, fc, layers.0.*, norm, lm_head, d2t, t2d), with the
  `speculators_config` every
  SpeculatorModelConfig carries (src/speculators/config.py: algorithm, proposal_methods,
  default_proposal_method, verifier). vLLM reads it through its speculators config adapter
  (vllm/transformers_utils/configs/speculators/algos.py, which reads draft_vocab_size,
  target_hidden_size, norm_before_residual and eagle_aux_hidden_state_layer_ids).

The reduced vocabulary, as vLLM, SGLang, SpecForge and speculators store it:
- d2t (V',) int64, draft index -> offset: target id = i + d2t[i] (vLLM's compute_logits scatters
  draft logit i to column i + d2t[i]; SGLang's hot_token_id is arange(V') + d2t);
- t2d (V,) bool, true at the V' target ids the draft vocabulary covers (speculators checks
  t2d.sum() == V' and selects the verifier's head rows with it, in ascending id order).
Without a reduced vocabulary (V' = V, draft index = target id) d2t is zeros and t2d all true; the
speculators layout then has neither (Eagle3DraftModel registers them only when V' != V).

Which target layers the drafter fuses: the outputs of layers j (our `feature_layers`) are
eagle_config.eagle_aux_hidden_state_layer_ids [j...] in the "eagle3" layout (SGLang captures
the input of layer j + 1) and eagle_aux_hidden_state_layer_ids [j + 1...] in the speculators
layout and at the top level of the "eagle3" one (vLLM captures the input of those layers), so
each engine finds the layers it reads.

Shapes: H hidden size, V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

import torch

from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.model.transformer import ARCHITECTURES, ModelConfig

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"  # what Eagle3DraftModel.save_pretrained records
# The release whose schema the speculators layout follows: its config classes load it
# (tests/test_export_layouts.py).
SPECULATORS_VERSION = "0.9.0"
FUSED_LAYERS = 3  # SGLang and SpecForge size fc for three target layers


def layouts_problem(drafter: Eagle3Drafter, layout: str) -> str | None:
    """None when `drafter` has an exact representation in `layout` ("eagle3" or
    "speculators"); otherwise why not."""
    config = drafter.config
    if layout == "eagle3":
        if len(config.feature_layers) != FUSED_LAYERS:
            return (f"drafter: it fuses {len(config.feature_layers)} target layers; SGLang's and "
                    f"SpecForge's EAGLE-3 drafters fuse {FUSED_LAYERS} (use --to speculators)")
        if config.norm_before_residual:
            return ("drafter: it has norm_before_residual, which SGLang's EAGLE-3 layer does not "
                    "run (use --to speculators)")
    if config.layer.attention_bias:
        return "drafter: its layer has attention biases, which SGLang's EAGLE-3 layer lacks"
    return None


def llama_layer_config(c: ModelConfig, dtype: torch.dtype, *, attention_bias: bool) -> dict:
    """The LlamaConfig dict of a drafter's one layer of shapes `c`: its heads, widths, eps and
    RoPE (the servers build the layer's rotary embedding from these), one hidden layer, untied
    (the servers swap in the target's embedding and head, which SGLang cannot do to a tied
    pair)."""
    return {"model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            # written always: speculators sizes its rotary embedding from hidden_size * 2 /
            # heads when head_dim is absent
            "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": None if c.rope_scaling is None else dict(c.rope_scaling),
            "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": attention_bias, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def layer_config(drafter: Eagle3Drafter) -> dict:
    """The EAGLE-3 drafter's own layer: its shapes, the target's hidden size and vocabulary."""
    return llama_layer_config(drafter.config.layer, drafter.fc.weight.dtype,
                              attention_bias=False)


def vocab_maps(draft_to_target: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    """d2t (V',) int64 offsets and t2d (V,) bool from the drafter's draft_to_target (V',)."""
    ids = draft_to_target.detach().to("cpu", torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.shape[0]), "t2d": t2d}


def eagle3_files(drafter: Eagle3Drafter) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of the "eagle3" layout."""
    c, outputs = drafter.config, list(drafter.config.feature_layers)
    config = {"architectures": [EAGLE3_ARCHITECTURE], **layer_config(drafter),
              "target_hidden_size": c.layer.hidden_size,
              "eagle_config": {"use_aux_hidden_state": True,
                               "eagle_aux_hidden_state_layer_ids": outputs},
              "eagle_aux_hidden_state_layer_ids": [j + 1 for j in outputs],
              "norm_before_residual": False}
    tensors = _tensors(drafter, "midlayer.")
    if c.head_from_target:  # no head: both engines score with the target's
        tensors.pop("lm_head.weight", None)
    else:
        config["draft_vocab_size"] = c.draft_vocab
        tensors.update(vocab_maps(drafter.draft_to_target, c.layer.vocab_size))
    return config, tensors


def speculators_files(drafter: Eagle3Drafter, speculative_tokens: int,
                      verifier_name_or_path: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of the speculators layout. A drafter scoring with the
    target's head gets that head written as its own (Eagle3DraftModel always has one); the
    target's embedding is written as the drafter's, which Eagle3DraftModel keeps frozen."""
    c, vocab = drafter.config, drafter.config.layer.vocab_size
    verifier_architecture = next(name for name, family in ARCHITECTURES.items()
                                 if family == drafter.target.config.family)
    config = {
        "speculators_model_type": "eagle3",
        "architectures": [SPECULATORS_ARCHITECTURE],
        "transformer_layer_config": layer_config(drafter),
        "draft_vocab_size": c.draft_vocab,
        # written always: vLLM's adapter takes an absent one as true, speculators as false
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": c.layer.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [j + 1 for j in c.feature_layers],
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": [verifier_architecture]},
        },
        "speculators_version": SPECULATORS_VERSION,
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
    }
    tensors = _tensors(drafter, "layers.0.")
    # The target's embedding, as Eagle3DraftModel.save_pretrained writes it: from_pretrained
    # loads the verifier's only into an embedding it still holds NaN in, which transformers
    # 5.x's loader does not guarantee for a tensor the checkpoint lacks.
    tensors["embed_tokens.weight"] = (drafter.target.model.embed_tokens.weight.detach()
                                      .to("cpu", drafter.fc.weight.dtype).contiguous())
    if c.head_from_target:
        tensors["lm_head.weight"] = drafter.target.lm_head.weight.detach().to("cpu").contiguous()
    if c.draft_vocab != vocab:
        tensors.update(vocab_maps(drafter.draft_to_target, vocab))
    return config, tensors


def _tensors(drafter: Eagle3Drafter, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The drafter's own tensors under the layout's names (midlayer. -> layer_prefix)."""
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        if name == "draft_to_target":  # written as d2t / t2d
            continue
        if name.startswith("midlayer."):
            name = layer_prefix + name.removeprefix("midlayer.")
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors
