"""The embedded default model: the architecture of the tiny reasoning model the project trains
itself on its synthetic task (tlt_core.embedded.task). Eight layers, so a one-layer drafter is cheap
beside it; a character vocabulary from the task's tokenizer.
"""

from __future__ import annotations

from tlt_core.embedded.task import CharTokenizer
from tlt_core.model.transformer import ModelConfig

EMBEDDED_MODEL_CONFIG = ModelConfig(
    family="llama", vocab_size=CharTokenizer().vocab_size, hidden_size=128,
    intermediate_size=384, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32,
    max_position_embeddings=1024, tie_word_embeddings=True)
