"""The weights a model computes with, by its base model's parameter names: for a PEFT LoRA
model, each adapted layer's base weight plus its active adapters' deltas
(W + B @ A * scaling, by peft's own `get_delta_weight`), and each `modules_to_save` layer's
trained copy. The model is not changed: the merge writes into new tensors, so the trainer keeps
training its unmerged adapters.

This is what a generator that holds a plain copy of the model (tlt_core's engine) loads at each
weight sync; its forward then equals the PEFT model's up to float rounding of the merge.

Refused, with a ValueError naming the module: PEFT methods other than LoRA (prompt/prefix
tuning, IA3, ... change the forward, not the weights), DoRA (its magnitude rescales the merged
weight), and a LoRA adapter on a tied embedding or LM head (PEFT adapts one of the two
uses of the shared matrix; a merged copy would adapt both).
"""

from __future__ import annotations

import torch

__all__ = ["is_peft_model", "merged_weights"]


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether model is a peft.PeftModel (checked without importing peft)."""
    return any(cls.__module__.startswith("peft.") and cls.__name__ == "PeftModel"
               for cls in type(model).__mro__)


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model's effective parameters by its base model's names (`model.layers.0.mlp.up_proj.weight`):
    detached views of model's own tensors where nothing is merged, new tensors where a LoRA delta
    is added. A model that is not a PEFT model gives its named parameters."""
    if not is_peft_model(model):
        return {name: p.detach() for name, p in model.named_parameters()}
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    _check_lora_only(model)
    base = model.get_base_model()
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    tied_names = {name for name, _ in _tied_modules(base)} if tied else set()
    weights: dict[str, torch.Tensor] = {}

    def visit(module: torch.nn.Module, prefix: str) -> None:
        if isinstance(module, LoraLayer):
            _lora_weights(module, prefix, weights, tied_names)
            return
        if isinstance(module, ModulesToSaveWrapper):
            visit(_active_module_to_save(module), prefix)
            return
        for name, parameter in module.named_parameters(recurse=False):
            weights[prefix + name] = parameter.detach()
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.")

    with torch.no_grad():
        visit(base, "")
    return weights


def _check_lora_only(model) -> None:
    from peft import LoraConfig

    for adapter, config in model.peft_config.items():
        if not isinstance(config, LoraConfig):
            raise ValueError(f"peft_config: adapter {adapter!r} is {type(config).__name__}; only "
                             "LoRA adapters can be merged into the engine's weights")
        if getattr(config, "use_dora", False):
            raise ValueError(f"peft_config: adapter {adapter!r} uses DoRA (use_dora=True), whose "
                             "magnitude vector the engine's merged weights do not carry; "
                             "use plain LoRA")


def _tied_modules(base: torch.nn.Module):
    """The input embedding and output head modules of a transformers model, by qualified name."""
    wanted = {id(base.get_input_embeddings()), id(base.get_output_embeddings())}
    return [(name, module) for name, module in base.named_modules() if id(module) in wanted]


def _lora_weights(layer, prefix: str, weights: dict[str, torch.Tensor],
                  tied_names: set[str]) -> None:
    """layer's base parameters under prefix, its weight with the active, unmerged deltas added."""
    base_layer = layer.get_base_layer()
    for name, parameter in base_layer.named_parameters(recurse=False):
        weights[prefix + name] = parameter.detach()
    if layer.disable_adapters:
        return
    adapters = [name for name in layer.active_adapters
                if name in layer.scaling and name not in layer.merged_adapters]
    if not adapters:
        return
    module_name = prefix.rstrip(".")
    if module_name in tied_names:
        raise ValueError(f"peft_config: LoRA on {module_name!r}, whose weight the model ties "
                         "with its other embedding; the engine shares one matrix for both. "
                         "Leave it out of target_modules or untie the embeddings")
    weight = weights[prefix + "weight"]
    merged = weight.clone()
    for adapter in adapters:
        merged += layer.get_delta_weight(adapter).to(merged.dtype)
    weights[prefix + "weight"] = merged


def _active_module_to_save(wrapper) -> torch.nn.Module:
    """The module a ModulesToSaveWrapper forwards through: the active adapter's trained copy,
    or the original where adapters are disabled or the active one has no copy."""
    active = wrapper.active_adapters
    if wrapper.disable_adapters or not active or active[0] not in wrapper.modules_to_save:
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]
