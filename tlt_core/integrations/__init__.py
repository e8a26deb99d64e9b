"""Adapters that plug tlt_core into other frameworks. `trl.py`: TRL's GRPOTrainer generating
with tlt_core's engine (`TLTRollout`, a `rollout_func`); `trl_trainer.py`: the same chosen from
TRL's config (`TLTGRPOConfig(use_tlt=True)`; it subclasses TRL's classes, so it imports TRL and
is not imported here); `peft_weights.py`: a PEFT LoRA model's merged weights. `vllm_ops.py` and
`sglang_ops.py`: the verify kernels in vLLM's and SGLang's layouts, as torch.library ops
(imported on demand: importing them registers the ops). An adapter imports its framework only
inside the calls that touch the framework's objects: none is a dependency of tlt_core."""

from tlt_core.integrations.trl import RolloutCall, TLTRollout, transformer_from_hf

__all__ = ["RolloutCall", "TLTRollout", "transformer_from_hf"]
