"""Published drafter checkpoints (tlt_core.drafting.published, load_drafter): each layout, written
here as its own sources name and shape its tensors and config keys, loads into a drafter whose
draft logits equal a direct re-implementation of that source's forward (float32, tight), runs
speculatively in the engine with outputs equal to plain decoding, and anything it cannot
represent exactly is refused with the reason."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.eagle3 import Eagle3Drafter
from tlt_core.drafting.export import export_drafter, load_drafter, load_export, read_provenance
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.attention_plan import attention_plan
from tlt_core.model.transformer import ModelConfig, Transformer

from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target

DRAFT_VOCAB = 24  # V' of the EAGLE-3 drafters
TOKENS = 7  # sequence length of the logits comparisons


def _target(seed: int, **config) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_heads=4, num_kv_heads=2, head_dim=8, **config)).eval()
    with torch.no_grad():  # sharper logits than init, and a final norm that is not the identity
        model.lm_head.weight.mul_(8.0)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def llama():
    target = tiny_target()
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)
    return target


@pytest.fixture(scope="module")
def qwen2():
    return _target(1, family="qwen2", attention_bias=True, num_layers=2)


@pytest.fixture(scope="module")
def deep():
    """Eight layers (EAGLE-3 fuses a low, a middle and a high one), RoPE theta 500000 and eps
    1e-5 as Llama 3's, which the EAGLE-3 drafters below do not share."""
    return _target(2, num_layers=8, rope_theta=500000.0, rms_norm_eps=1e-5)


# ---- writing checkpoints as their sources lay them out -------------------------------------------

def _random(shape, seed, scale=None):
    g = torch.Generator().manual_seed(seed)
    scale = scale if scale is not None else shape[-1] ** -0.5
    return torch.randn(shape, generator=g) * scale


def _norm_weight(size, seed):
    return 1.0 + _random((size,), seed, 0.1)


def _layer(prefix, hidden, heads, kv_heads, head_dim, intermediate, seed, *, qkv_width=None,
           qkv_bias=False, norms=("post_attention_layernorm",)):
    """One Llama-style decoder layer's tensors under `prefix` (transformers' names)."""
    width = qkv_width or hidden
    t = {f"{prefix}self_attn.q_proj.weight": _random((heads * head_dim, width), seed),
         f"{prefix}self_attn.k_proj.weight": _random((kv_heads * head_dim, width), seed + 1),
         f"{prefix}self_attn.v_proj.weight": _random((kv_heads * head_dim, width), seed + 2),
         f"{prefix}self_attn.o_proj.weight": _random((hidden, heads * head_dim), seed + 3),
         f"{prefix}mlp.gate_proj.weight": _random((intermediate, hidden), seed + 4),
         f"{prefix}mlp.up_proj.weight": _random((intermediate, hidden), seed + 5),
         f"{prefix}mlp.down_proj.weight": _random((hidden, intermediate), seed + 6)}
    if qkv_bias:
        for i, name in enumerate("qkv"):
            t[f"{prefix}self_attn.{name}_proj.bias"] = _random(
                (t[f"{prefix}self_attn.{name}_proj.weight"].shape[0],), seed + 7 + i, 0.1)
    for i, name in enumerate(norms):
        t[f"{prefix}{name}.weight"] = _norm_weight(hidden, seed + 10 + i)
    return t


def _write(folder, config, tensors, weights="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if weights.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    return folder


def _llama_config(c: ModelConfig, architectures, **extra):
    return {"architectures": architectures, "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
            "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "torch_dtype": "float32", **extra}


def safeailab_eagle1(folder, target, *, bias=True, weights="pytorch_model.bin"):
    """SafeAILab/EAGLE eagle/model/cnets1.py `Model` (fc = nn.Linear(2H, H, bias), layers.0 a
    LlamaDecoderLayer with no input_layernorm, embed_tokens in the state dict) saved as
    ea_model.py loads it: pytorch_model.bin (or model.safetensors); config.json as in
    eagle/train/vicuna_7B_config.json (architectures LlamaForCausalLM, no rope_theta: 10000)
    or EAGLE-LLaMA3-Instruct-8B.json ("bias": false, rope_theta)."""
    c = target.config
    tensors = {"embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
               "fc.weight": _random((c.hidden_size, 2 * c.hidden_size), 100),
               **_layer("layers.0.", c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.intermediate_size, 110)}
    extra = {}
    if bias:
        tensors["fc.bias"] = _random((c.hidden_size,), 120, 0.1)
    else:
        extra = {"bias": False, "rope_theta": c.rope_theta}
    return _write(folder, _llama_config(c, ["LlamaForCausalLM"], **extra), tensors, weights)


def sglang_eagle1(folder, target):
    """SGLang python/sglang/srt/models/llama_eagle.py `LlamaForCausalLMEagle` / qwen2_eagle.py
    `Qwen2ForCausalLMEagle`: fc = nn.Linear(2H, H) (bias on), layers.0 with input_layernorm
    deleted, names without "model." (load_weights prepends it); a Qwen2 layer has q/k/v
    biases and no o_proj bias; config a LlamaConfig or a Qwen2Config."""
    c = target.config
    qwen2 = c.family == "qwen2"
    tensors = {"fc.weight": _random((c.hidden_size, 2 * c.hidden_size), 200),
               "fc.bias": _random((c.hidden_size,), 201, 0.1),
               **_layer("layers.0.", c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.intermediate_size, 210, qkv_bias=qwen2)}
    if qwen2:
        config = {**_llama_config(c, ["Qwen2ForCausalLMEagle"]), "model_type": "qwen2",
                  "rope_theta": c.rope_theta, "use_sliding_window": False,
                  "sliding_window": 32768, "max_window_layers": 28}
    else:
        config = _llama_config(c, ["LlamaForCausalLMEagle"], rope_theta=c.rope_theta)
    return _write(folder, config, tensors)


# The EAGLE-3 drafters' own layer: the target's H, fewer and wider heads, its own MLP width, eps
# and RoPE (traineagle3/config.json and SpecForge's llama3-8B-eagle3.json give no rope_theta).
EAGLE3_LAYER = {"heads": 2, "kv_heads": 1, "head_dim": 16, "intermediate": 48, "eps": 1e-6}
USED_IDS = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:DRAFT_VOCAB]
                  .tolist())  # V' target ids, ascending, as traineagle3/cnets.py builds d2t


def _eagle3_tensors(c: ModelConfig, layer_prefix, seed):
    """SafeAILab eagle/model/cnets.py `Model`: fc (H, 3H) no bias, midlayer a
    LlamaDecoderLayeremb (q/k/v (., 2H), hidden_norm, input_layernorm,
    post_attention_layernorm), norm, lm_head (V', H), buffers d2t (V',) int64 = draft->target
    offsets and t2d (V,) bool (traineagle3/cnets.py scandata)."""
    H, L = c.hidden_size, EAGLE3_LAYER
    ids = torch.tensor(USED_IDS)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"fc.weight": _random((H, 3 * H), seed),
            **_layer(layer_prefix, H, L["heads"], L["kv_heads"], L["head_dim"],
                     L["intermediate"], seed + 10, qkv_width=2 * H,
                     norms=("input_layernorm", "hidden_norm", "post_attention_layernorm")),
            "norm.weight": _norm_weight(H, seed + 30),
            "lm_head.weight": _random((DRAFT_VOCAB, H), seed + 31),
            "d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def _eagle3_llama_config(c: ModelConfig, architectures, **extra):
    L = EAGLE3_LAYER
    return {**_llama_config(c, architectures), "num_attention_heads": L["heads"],
            "num_key_value_heads": L["kv_heads"], "intermediate_size": L["intermediate"],
            "rms_norm_eps": L["eps"], **extra}


def safeailab_eagle3(folder, target):
    """SafeAILab eagle/model/cnets.py, trained by eagle/traineagle3 (config.json there, with
    draft_vocab_size; main.py's save_16bit_model(exclude_frozen_parameters=True): no
    embed_tokens, pytorch_model.bin). It fuses the inputs of target layers 2, L//2, L-3
    (modeling_llama_kv.py)."""
    c = target.config
    return _write(folder, _eagle3_llama_config(c, ["LlamaForCausalLM"],
                                               draft_vocab_size=DRAFT_VOCAB),
                  _eagle3_tensors(c, "midlayer.", 300), "pytorch_model.bin")


def specforge_eagle3(folder, target):
    """SpecForge specforge/modeling/draft/llama3_eagle.py `LlamaForCausalLMEagle3` as
    specforge/export/to_sglang.py writes it (identity names; fc, norm, lm_head, t2d, d2t
    required; embeddings dropped); config as configs/gpt-oss-20B-eagle3.json (head_dim,
    eagle_config.eagle_aux_hidden_state_layer_ids: SGLang captures the output of those
    layers)."""
    c = target.config
    config = _eagle3_llama_config(c, ["LlamaForCausalLMEagle3"], head_dim=16,
                                  draft_vocab_size=DRAFT_VOCAB,
                                  eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]})
    return _write(folder, config, _eagle3_tensors(c, "midlayer.", 400))


def speculators_eagle3(folder, target, *, norm_before_residual=False):
    """vllm-project/speculators src/speculators/models/eagle3/config.py
    `Eagle3SpeculatorConfig` and core.py / model_definitions.py `Eagle3DraftModel`: layers.0 the
    first layer (q/k/v (., 2H), hidden_norm), a transformer_layer_config, top-level
    eagle_aux_hidden_state_layer_ids (vLLM captures the input of those layers), embed_tokens
    kept by the converter (convert/eagle/eagle3_converter.py has_drafter_embedding)."""
    c, L = target.config, EAGLE3_LAYER
    layer = {**_eagle3_llama_config(c, ["LlamaForCausalLM"]), "head_dim": L["head_dim"],
             "rope_theta": 500000.0, "attention_bias": False}
    layer.pop("architectures")
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer, "draft_vocab_size": DRAFT_VOCAB,
              "norm_before_residual": norm_before_residual, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [2, 5, 7], "norm_before_fc": False,
              "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": 3}],
                  "default_proposal_method": "greedy",
                  "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
              "speculators_version": "0.3.0"}
    tensors = {"embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
               **_eagle3_tensors(c, "layers.0.", 500)}
    return _write(folder, config, tensors)


# ---- the sources' forward, re-implemented in plain torch -----------------------------------------

def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """transformers' rotate-half RoPE on x (T, heads, d)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos[:, None] + rotated * sin[:, None]


def _attention(x, w, p, heads, kv_heads, head_dim, theta, positions):
    """Causal GQA self-attention over one sequence x (T, width): LlamaAttention's math."""
    T = x.shape[0]

    def proj(name):
        bias = w.get(f"{p}self_attn.{name}_proj.bias")
        out = x @ w[f"{p}self_attn.{name}_proj.weight"].T
        return out if bias is None else out + bias
    q = _rope(proj("q").view(T, heads, head_dim), positions, theta)
    k = _rope(proj("k").view(T, kv_heads, head_dim), positions, theta)
    v = proj("v").view(T, kv_heads, head_dim)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # repeat_kv
    scores = torch.einsum("thd,shd->hts", q, k) / head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, heads * head_dim)
    return out @ w[f"{p}self_attn.o_proj.weight"].T


def _mlp(x, w, p):
    gate, up = x @ w[f"{p}mlp.gate_proj.weight"].T, x @ w[f"{p}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{p}mlp.down_proj.weight"].T


def _target_stream(target, ids):
    """The target's residual stream over ids (T,): stream[i] enters layer i, stream[L] leaves
    the last layer (before the final norm)."""
    T = ids.shape[0]
    positions = torch.arange(T)[None]
    cos, sin = target.model.rotary_emb(positions, torch.float32)
    plan = attention_plan((1, T), None, None, ids.device)
    h = target.model.embed_tokens.weight[ids][None]
    stream = [h[0]]
    for layer in target.model.layers:
        h = layer.forward(h, cos, sin, plan, None)
        stream.append(h[0])
    return stream


def eagle1_reference(w, config, target, ids, bias):
    """cnets1.py Model.forward + LlamaDecoderLayer(index 0), topK_genrate's head(out): the logits
    of the pairs (f_t, x_{t+1}), f_t the target's normed last hidden state (ea_model.py
    outputs[0])."""
    c, L = target.config, target.config.num_layers
    features = _rms(_target_stream(target, ids)[L], target.model.norm.weight, c.rms_norm_eps)
    embedded = target.model.embed_tokens.weight[ids[1:]]
    h = torch.cat((embedded, features[:-1]), -1) @ w["fc.weight"].T
    if bias:
        h = h + w["fc.bias"]
    positions, heads = torch.arange(ids.shape[0] - 1), config["num_attention_heads"]
    h = h + _attention(h, w, "layers.0.", heads, config["num_key_value_heads"],
                       c.hidden_size // heads,  # cnets1.py: head_dim = H / heads
                       config.get("rope_theta", 10000.0), positions)
    h = h + _mlp(_rms(h, w["layers.0.post_attention_layernorm.weight"],
                      config["rms_norm_eps"]), w, "layers.0.")
    return h @ target.lm_head.weight.T


def eagle3_reference(w, p, layer, embedded, hidden, norm_before_residual=False):
    """cnets.py LlamaDecoderLayeremb + Model.forward + topK_genrate's lm_head(norm(.)) (and
    speculators' norm_before_residual): (g', logits) for pairs whose (T, H) hidden is the fused
    target state or the drafter's own output."""
    eps = layer["rms_norm_eps"]
    normed = _rms(hidden, w[f"{p}hidden_norm.weight"], eps)
    residual = normed if norm_before_residual else hidden
    both = torch.cat((_rms(embedded, w[f"{p}input_layernorm.weight"], eps), normed), -1)
    positions = torch.arange(hidden.shape[0])
    h = residual + _attention(both, w, p, layer["num_attention_heads"],
                              layer["num_key_value_heads"],
                              layer.get("head_dim", layer["hidden_size"]
                                        // layer["num_attention_heads"]),
                              layer.get("rope_theta", 10000.0), positions)
    h = h + _mlp(_rms(h, w[f"{p}post_attention_layernorm.weight"], eps), w, p)
    return h, _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T


def _weights(folder):
    path = folder / "model.safetensors"
    if path.is_file():
        return load_file(str(path))
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


def _ids(seed):
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(seed))


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ---- each layout equals its source ---------------------------------------------------------------

EAGLE1_LAYOUTS = {
    "safeailab-bin": (lambda d, t: safeailab_eagle1(d, t), "llama", True),
    "safeailab-no-bias": (lambda d, t: safeailab_eagle1(d, t, bias=False,
                                                        weights="model.safetensors"),
                          "llama", False),
    "sglang-llama": (sglang_eagle1, "llama", True),
    "sglang-qwen2": (sglang_eagle1, "qwen2", True),
}


@pytest.mark.parametrize("layout", EAGLE1_LAYOUTS)
def test_eagle1_layouts_draft_their_sources_logits(layout, llama, qwen2, tmp_path):
    write, family, bias = EAGLE1_LAYOUTS[layout]
    target = {"llama": llama, "qwen2": qwen2}[family]
    folder = write(tmp_path / layout, target)
    drafter = load_drafter(folder, target)
    assert isinstance(drafter, Drafter)
    assert drafter.config == DrafterConfig(form="eagle", fc_bias=bias)
    config, ids = json.loads((folder / "config.json").read_text()), _ids(1)
    expected = eagle1_reference(_weights(folder), config, target, ids, bias)  # (T - 1, V)
    positions = torch.arange(TOKENS - 1)[None]
    with torch.no_grad():
        out = target(ids[None], torch.arange(TOKENS)[None], hidden_layers=(-1,))
        features = drafter.features([out.hidden_states[0][:, :-1]])
        _close(drafter.logits(drafter(ids[None, 1:], features, positions))[0], expected)
        cache = drafter.new_cache(1, 16)  # the engine's path: the packed layer over a cache
        _close(drafter.logits(drafter(ids[None, 1:], features, positions, cache))[0], expected)


EAGLE3_LAYOUTS = {
    # writer, the target-stream indices its source fuses (inputs of layers), norm_before_residual
    "safeailab": (safeailab_eagle3, lambda L: [2, L // 2, L - 3], False),
    "specforge": (specforge_eagle3, lambda L: [0 + 1, 3 + 1, 6 + 1], False),  # outputs of 0, 3, 6
    "speculators": (speculators_eagle3, lambda L: [2, 5, 7], False),
    "speculators-norm-before-residual": (
        lambda d, t: speculators_eagle3(d, t, norm_before_residual=True),
        lambda L: [2, 5, 7], True),
}


@pytest.mark.parametrize("layout", EAGLE3_LAYOUTS)
def test_eagle3_layouts_draft_their_sources_logits(layout, deep, tmp_path):
    """The prefix's pairs (teacher-forced with the target's fused states) and one more level fed
    the drafter's own output (as the tree does), through the engine's cache."""
    write, stream_indices, norm_before_residual = EAGLE3_LAYOUTS[layout]
    folder = write(tmp_path / layout, deep)
    drafter = load_drafter(folder, deep)
    assert isinstance(drafter, Eagle3Drafter)
    assert drafter.vocab_size == DRAFT_VOCAB
    assert drafter.to_target_ids(torch.arange(DRAFT_VOCAB)).tolist() == USED_IDS
    config, w, ids = json.loads((folder / "config.json").read_text()), _weights(folder), _ids(2)
    layer = config.get("transformer_layer_config", config)
    p = "layers.0." if "speculators_model_type" in config else "midlayer."
    stream = _target_stream(deep, ids)
    fused = torch.cat([stream[i] for i in stream_indices(deep.config.num_layers)], -1)
    hidden = fused[:-1] @ w["fc.weight"].T  # (T - 1, H)
    embedded = deep.model.embed_tokens.weight[ids[1:]]
    out_ref, logits_ref = eagle3_reference(w, p, layer, embedded, hidden, norm_before_residual)
    # the next level: the draft's best token, fed with the drafter's own last output
    best = torch.tensor(USED_IDS)[logits_ref[-1].argmax()]
    _, level_ref = eagle3_reference(
        w, p, layer, torch.cat((embedded, deep.model.embed_tokens.weight[best][None])),
        torch.cat((hidden, out_ref[-1:])), norm_before_residual)

    positions = torch.arange(TOKENS - 1)[None]
    with torch.no_grad():
        out = deep(ids[None], torch.arange(TOKENS)[None],
                   hidden_layers=drafter.config.feature_layers)
        features = drafter.features([h[:, :-1] for h in out.hidden_states])
        _close(drafter.logits(drafter(ids[None, 1:], features, positions))[0], logits_ref)
        cache = drafter.new_cache(1, 16)
        prefix = drafter(ids[None, 1:], features, positions, cache)
        _close(drafter.logits(prefix)[0], logits_ref)
        cache.commit(torch.tensor([TOKENS - 1]))
        token = drafter.to_target_ids(drafter.logits(prefix[:, -1]).argmax(-1))
        assert int(token) == int(best)
        level = drafter(token[:, None], prefix[:, -1:], torch.tensor([[TOKENS - 1]]), cache)
        _close(drafter.logits(level)[0, 0], level_ref[-1])


# ---- lossless in the engine ----------------------------------------------------------------------

ENGINE_CASES = {
    "safeailab-eagle1": (lambda d, t: safeailab_eagle1(d, t), "llama"),
    "sglang-qwen2-eagle1": (sglang_eagle1, "qwen2"),
    "specforge-eagle3": (specforge_eagle3, "deep"),
    "speculators-eagle3": (lambda d, t: speculators_eagle3(d, t, norm_before_residual=True),
                           "deep"),
}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_imported_drafters_roll_out_the_targets_greedy_tokens(case, llama, qwen2, deep, tmp_path):
    write, which = ENGINE_CASES[case]
    target = {"llama": llama, "qwen2": qwen2, "deep": deep}[which]
    drafter = load_drafter(write(tmp_path / case, target), target)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in PROMPTS[:4]]
    plain = RolloutEngine(target, EngineConfig(max_batch=4, max_len=40)).generate(requests)
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=40), drafter)
    for strategy in (Strategy(4, 3, 8), Strategy(3, 1, 4)):
        speculative = engine.generate(requests, strategy=strategy)
        assert speculative.spec_steps
        assert [r.tokens.tolist() for r in speculative.rollouts] == \
            [r.tokens.tolist() for r in plain.rollouts], strategy


# ---- fc bias: saved, loaded and exported as it is ------------------------------------------------

def test_fc_bias_round_trips_through_save_and_export(llama, tmp_path):
    torch.manual_seed(4)
    drafter = Drafter(llama, DrafterConfig(form="eagle", fc_bias=True)).eval()
    assert drafter.fc.bias is not None and bool(drafter.fc.bias.any())
    drafter.save(tmp_path / "saved")
    folders = [tmp_path / "saved", export_drafter(drafter, tmp_path / "eagle", "eagle",
                                                  {"rl_step": 1, "acceptance_length": None})]
    for folder in folders:
        again = load_drafter(folder, llama)
        assert again.config.fc_bias
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(again.state_dict()[name], tensor), (folder, name)
    assert read_provenance(tmp_path / "eagle")["fc_bias"]
    # provenance that disagrees with the weights: not what export_drafter wrote
    record = read_provenance(tmp_path / "eagle")
    (tmp_path / "eagle" / "tlt_provenance.json").write_text(json.dumps({**record,
                                                                        "fc_bias": False}))
    with pytest.raises(ValueError, match="fc.bias is not zero, but its provenance"):
        load_export(tmp_path / "eagle", llama)


# ---- refusals ------------------------------------------------------------------------------------

def _edit(folder, config=None, tensors=None):
    """Rewrites a fixture folder: config.update(config); tensors(dict) edits the weights."""
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        weights = _weights(folder)
        tensors(weights)
        name = "model.safetensors" if (folder / "model.safetensors").is_file() else None
        if name:
            save_file(weights, str(folder / name))
        else:
            torch.save(weights, folder / "pytorch_model.bin")
    return folder


def _two_layers(w):
    w.update({k.replace("layers.0.", "layers.1."): v for k, v in list(w.items())
              if k.startswith("layers.0.")})


def _speculators_layer(**changes):
    def edit(folder, target):
        folder = speculators_eagle3(folder, target)
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["transformer_layer_config"].update(changes)
        path.write_text(json.dumps(config))
        return folder
    return edit


REFUSALS = {
    "several EAGLE-1 layers": (
        "llama", lambda d, t: _edit(safeailab_eagle1(d, t), {"num_hidden_layers": 2},
                                    _two_layers), r"folder: .* has 2 drafter layers"),
    "EAGLE-1 RoPE other than the target's": (
        "llama", lambda d, t: _edit(safeailab_eagle1(d, t), {"rope_theta": 500000.0}),
        r"target: .* rope_theta = 500000.0, the target has 10000.0"),
    "EAGLE-1 q/k/v biases on a Llama target": (
        "llama", lambda d, t: _edit(safeailab_eagle1(d, t), {"qkv_bias": True}, lambda w: w.update(
            {f"layers.0.self_attn.{n}_proj.bias": torch.zeros(32 if n == "q" else 16)
             for n in "qkv"})),
        r"no place for: \['layers.0.self_attn.k_proj.bias'.*llama layer"),
    "EAGLE-1 Qwen2 drafter without its q/k/v biases": (
        "qwen2", lambda d, t: _edit(sglang_eagle1(d, t), tensors=lambda w: [
            w.pop(f"layers.0.self_attn.{n}_proj.bias") for n in "qkv"]),
        r"tensors missing: \['layers.0.self_attn.k_proj.bias'"),
    "an unknown tensor": (
        "llama", lambda d, t: _edit(sglang_eagle1(d, t), tensors=lambda w: w.update(
            {"layers.0.input_layernorm.weight": torch.ones(32)})),
        r"no place for: \['layers.0.input_layernorm.weight'\]"),
    "an fc bias the config disowns": (
        "llama", lambda d, t: _edit(safeailab_eagle1(d, t), {"bias": False}),
        r"folder: .*bias = False.*have fc.bias"),
    "an EAGLE-1 vocabulary other than the target's": (
        "llama", lambda d, t: _edit(safeailab_eagle1(d, t), {"vocab_size": 50}),
        r"target: .* vocab_size = 50, the target has 40"),
    "an EAGLE-3 vocabulary other than the target's": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t), {"vocab_size": 50}),
        r"target: .* vocab_size = 50, the target has 40"),
    "an EAGLE-3 drafter for a wider target": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t), {"target_hidden_size": 64}),
        r"target: .* target_hidden_size = 64"),
    "SafeAILab's default layers on a 2-layer target": (
        "llama", safeailab_eagle3, r"target: .* fuses the outputs of target layers \[1, 0, -2\]"),
    "several EAGLE-3 layers": (
        "deep", _speculators_layer(num_hidden_layers=2), r"has 2 drafter layers"),
    "an EAGLE-3 RoPE we do not compute": (
        "deep", _speculators_layer(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        r"rope_scaling: rope_type 'linear' is not supported"),
    "a Qwen3 layer": (
        "deep", _speculators_layer(model_type="qwen3"), r"model_type 'qwen3'"),
    "an EAGLE-3 fc bias (SGLang's bias)": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t), {"bias": True}, lambda w: w.update(
            {"fc.bias": torch.zeros(32)})), r"no place for: \['fc.bias'\]"),
    "an embedding copy of another shape": (
        "deep", lambda d, t: _edit(speculators_eagle3(d, t), tensors=lambda w: w.update(
            {"embed_tokens.weight": torch.zeros(50, 32)})),
        r"target: embed_tokens.weight in .* has shape \(50, 32\)"),
    "per-layer norms before fc": (
        "deep", lambda d, t: _edit(speculators_eagle3(d, t), {"fc_norm": True}),
        r"fc_norm is True"),
    "SpecForge's head without a norm": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t), {"norm_output": False}),
        r"norm_output is False"),
    "the embedding as an aux layer": (
        "deep", lambda d, t: _edit(speculators_eagle3(d, t),
                                   {"eagle_aux_hidden_state_layer_ids": [0, 4, 7]}),
        r"j >= 1"),
    "vLLM's layer ids in SGLang's layout": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t),
                                   {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}),
        r"ambiguous"),
    "a head over another draft vocabulary": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t), {"draft_vocab_size": 20}),
        r"d2t has shape \(24,\), draft_vocab_size is 20"),
    "d2t leading outside the vocabulary": (
        "deep", lambda d, t: _edit(specforge_eagle3(d, t), tensors=lambda w: w["d2t"].add_(30)),
        r"draft_to_target: ids must be in \[0, 40\)"),
    "no drafter at all": (
        "llama", lambda d, t: _write(d, {"architectures": ["LlamaForCausalLM"]},
                                     {"model.norm.weight": torch.ones(32)}),
        r"folder: .* is no drafter layout we read"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_cannot_be_represented_exactly_is_refused(case, llama, qwen2, deep, tmp_path):
    which, write, match = REFUSALS[case]
    target = {"llama": llama, "qwen2": qwen2, "deep": deep}[which]
    with pytest.raises(ValueError, match=match):
        load_drafter(write(tmp_path / "d", target), target)


def test_pickled_weights_cannot_run_code(llama, tmp_path):
    """pytorch_model.bin is read with torch.load(weights_only=True): a pickle that would call a
    function (here: open a file for writing) is refused and the call never happens."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")

    folder = safeailab_eagle1(tmp_path / "d", llama)
    torch.save({"fc.weight": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"folder: .*pytorch_model.bin is not a plain tensor "
                                         r"checkpoint \(torch.load with weights_only=True"):
        load_drafter(folder, llama)
    assert not marker.exists()
