"""The GPU side of device and dtype (marked `gpu`: skipped without CUDA; bench/gpu_check.sh runs
it): a SmolLM2-135M-shaped Llama with random weights (no download on the GPU machine) in bf16 on
CUDA, loaded by our loader, uses the views layout over fused projections (no second copy of the
weights), follows forward and transformers within bf16 rounding, and the engine's prefill keeps
logits at the last position only.
"""

import pytest
import torch

from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.placement import peak_memory_bytes, reset_peak_memory, resolve_placement

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=2048, tie_word_embeddings=True,
                     rope_theta=100000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_SHAPE))
    path = tmp_path_factory.mktemp("smollm2-shaped")
    hf.save_pretrained(path)
    return path


def test_auto_placement_is_bf16_on_cuda():
    placement = resolve_placement("auto", "auto")
    assert placement.device.type == "cuda" and placement.dtype == torch.bfloat16


def test_views_layout_without_a_copy_follows_transformers(folder):
    model = load_checkpoint(folder, dtype=torch.bfloat16, device="cuda")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    ids = torch.randint(3, 49152, (2, 40), device="cuda")
    engine = RolloutEngine(model, EngineConfig(max_batch=2, max_len=64))
    result = engine.generate([Request(row.tolist(), SamplingParams(temperature=0.0,
                                                                   max_tokens=8))
                              for row in ids.cpu()])
    assert model._decoder.layers.layout == "views" and model.inference_copy_bytes() == 0
    assert not isinstance(model._decoder.layers.packed[0].qkv, tuple)  # one fused matmul
    with torch.no_grad():
        ours = model(ids, torch.arange(40, device="cuda").expand(2, -1)).logits
        theirs = hf(ids).logits.float()
    assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()
    assert all(len(r.tokens) == 8 for r in result.rollouts)


def test_prefill_memory_is_bounded(folder):
    """64 prompts of 512 tokens: logits at the last positions only, so the peak stays far
    below one (B, T, V) float32 logits tensor (6 GiB here)."""
    model = load_checkpoint(folder, dtype=torch.bfloat16, device="cuda")
    engine = RolloutEngine(model, EngineConfig(max_batch=64, max_len=520))
    requests = [Request(torch.randint(3, 49152, (512,)).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=2)) for _ in range(64)]
    device = torch.device("cuda")
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device)
    engine.generate(requests)
    assert peak_memory_bytes(device) - before < 2 << 30
