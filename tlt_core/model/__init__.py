"""The target model: token ids + positions + KV cache in, logits and hidden states out.

It knows nothing about tokenizers, sampling or drafting. `Transformer` is an eager decoder for
the Llama, Qwen2 and Qwen3 families whose `forward` serves training and recomputation and
whose `step` (the packed inference pass, `packed.py`) serves prefill, decoding and tree
verification against a `KVCache`; `attention_plan.py` is the one place that says which cache
slots a new token sees. `checkpoint.py` reads and writes Hugging Face folders without
transformers; `tokenizer.py` reads a checkpoint's `tokenizer.json`.
"""

from tlt_core.model.attention_plan import AttentionPlan, attention_plan
from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.model.kv_cache import CacheBudgetError, CacheShape, KVCache
from tlt_core.model.tokenizer import CheckpointTokenizer
from tlt_core.model.transformer import ModelConfig, ModelOutput, Transformer

__all__ = ["AttentionPlan", "CacheBudgetError", "CacheShape", "CheckpointTokenizer", "KVCache",
           "ModelConfig", "ModelOutput", "Transformer", "attention_plan", "load_checkpoint",
           "save_checkpoint"]
