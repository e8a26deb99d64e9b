"""The target model and its checkpoints: invariants "the model is the checkpoint's model"
(logits = transformers', both ways through our loader and saver), "cache truth" (cached
decoding and tree verification = full recomputation; compaction after a real tree pass = the
cache of the accepted prefix), "rows are independent" (ragged rows = each row alone), hidden
states for the drafter, and "bad input gets a clear error".

Checkpoints are tiny random Llama (Llama-3 rope scaling), Qwen2 (q/k/v bias, untied) and Qwen3
(qk-norm, tied) models made by transformers in tmp folders: nothing is downloaded.
"""

import json

import pytest
import torch

import tlt_core.ops as ops
from tests.trees import random_tree_case
from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.model.kv_cache import CacheShape, KVCache
from tlt_core.model.transformer import ModelConfig, Transformer, rope_inv_freq

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB, LAYERS = 101, 3
TOL = 1e-4


def hf_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
    if family == "llama":  # low rope_theta and a short original context: the scaling bites
        llama3 = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=64)
        return transformers.LlamaConfig(**common, rope_parameters=llama3)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False,
                                        rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (folder, transformers model); every weight (biases and norms too) random."""
    made = {}
    for seed, family in enumerate(FAMILIES):
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
        with torch.no_grad():
            for parameter in hf.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.1)
        folder = tmp_path_factory.mktemp(family)
        hf.save_pretrained(folder)
        made[family] = folder, hf
    return made


def sequential_positions(batch: int, length: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length)  # (B, T)


def hf_logits(hf, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=positions).logits.float()  # (B, T, V)


def full_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, sequential_positions(*ids.shape)).logits  # (B, T, V)


def new_cache(model: Transformer, batch: int, max_len: int = 64) -> KVCache:
    c = model.config
    return KVCache(CacheShape(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim))


# (a) Our loader reads what transformers saved, our saver writes what transformers loads.

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    folder, hf = checkpoints[family]
    model = load_checkpoint(folder)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = sequential_positions(2, 12, start=40)  # past 0, so RoPE and its scaling matter
    logits = model(ids, positions).logits
    assert logits.dtype == torch.float32 and logits.shape == (2, 12, VOCAB)
    assert (logits - hf_logits(hf, ids, positions)).abs().max() <= TOL
    if family == "llama":  # the test would see a wrong Llama-3 scaling
        plain = ModelConfig.from_hf_config({**hf.config.to_dict(), "rope_parameters": None})
        assert not torch.equal(rope_inv_freq(plain), rope_inv_freq(model.config))
    if family == "qwen3":  # tied: one Parameter, stored once
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_transformers_and_back(checkpoints, family, tmp_path):
    folder, hf = checkpoints[family]
    model = load_checkpoint(folder)
    assert ModelConfig.from_hf_config(model.config.to_hf_config()) == model.config
    save_checkpoint(model, tmp_path, extra_config={"eos_token_id": 7})
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 7
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    positions = sequential_positions(2, 10)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = hf_logits(hf, ids, positions)
    assert (hf_logits(theirs, ids, positions) - expected).abs().max() <= TOL
    assert (full_logits(load_checkpoint(tmp_path), ids) - expected).abs().max() <= TOL


def test_config_reads_transformers_4_and_5_keys():
    """config.json as transformers 4.x wrote it (rope_theta + rope_scaling, Llama 3.1) and as
    5.x writes it (rope_parameters) give the same config; to_hf_config writes both."""
    legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "max_position_embeddings": 131072, "tie_word_embeddings": False}
    config = ModelConfig.from_hf_config(legacy)
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (128, 8, 500000.0)
    assert config.rope_scaling["original_max_position_embeddings"] == 8192
    current = {**legacy, "rope_scaling": None, "rope_theta": None,
               "rope_parameters": {**legacy["rope_scaling"], "rope_theta": 500000.0}}
    del current["rope_theta"]
    assert ModelConfig.from_hf_config(current) == config
    written = config.to_hf_config()
    assert written["rope_scaling"]["rope_type"] == written["rope_parameters"]["rope_type"] == "llama3"
    assert ModelConfig.from_hf_config(written) == config
    qwen2 = {**legacy, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None,
             "use_sliding_window": False, "sliding_window": 131072}
    assert ModelConfig.from_hf_config(qwen2).rope_scaling is None
    assert ModelConfig.from_hf_config(qwen2).attention_bias  # Qwen2 always has q/k/v biases


def test_sharded_checkpoint_and_dtype(checkpoints, tmp_path):
    folder, hf = checkpoints["qwen2"]
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(hf, ids, sequential_positions(1, 8))
    assert (full_logits(load_checkpoint(tmp_path), ids) - expected).abs().max() <= TOL
    half = load_checkpoint(folder, dtype=torch.bfloat16)  # weights bf16, RoPE angles fp32
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    assert (full_logits(half, ids) - expected).abs().max() < 0.1


# (b) Cache truth for decoding; rows are independent.

@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_equals_recomputation(checkpoints, family):
    model = load_checkpoint(checkpoints[family][0])
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(4))
    expected = full_logits(model, ids)  # (B, T, V)
    cache, prompt = new_cache(model, 2), 6
    with torch.no_grad():
        got = [model(ids[:, :prompt], sequential_positions(2, prompt), cache).logits]
        cache.commit(torch.full((2,), prompt))
        for t in range(prompt, ids.shape[1]):
            got.append(model(ids[:, t:t + 1], sequential_positions(2, 1, t), cache).logits)
            cache.commit(torch.ones(2, dtype=torch.int64))
    assert (torch.cat(got, dim=1) - expected).abs().max() <= TOL
    assert torch.equal(cache.lengths, torch.tensor([14, 14]))


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_equals_forward(checkpoints, family):
    """The engine's one-token fast path (Transformer.next_token_logits) is held to forward(): same logits,
    same cache contents, on rows of different lengths."""
    model = load_checkpoint(checkpoints[family][0])
    g = torch.Generator().manual_seed(6)
    lengths = [7, 2, 12]
    cache = new_cache(model, 3)
    for b, n in enumerate(lengths):
        view = cache.rows(b, 1)
        with torch.no_grad():
            model(torch.randint(0, VOCAB, (1, n), generator=g), sequential_positions(1, n), view)
        view.commit(torch.tensor([n]))
    twin = new_cache(model, 3)
    twin.data.copy_(cache.data)
    twin.set_lengths(cache.host_lengths)
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (3,), generator=g)
        with torch.no_grad():
            fast = model.next_token_logits(tokens, cache)
            slow = model(tokens[:, None], twin.lengths[:, None].clone(), twin).logits[:, 0]
        assert (fast - slow).abs().max() <= 1e-5
        cache.commit(torch.ones(3, dtype=torch.int64))
        twin.commit(torch.ones(3, dtype=torch.int64))
        # the fused q|k|v matmul rounds differently: K/V agree to float32 noise, as logits do
        assert torch.allclose(cache.data, twin.data, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="tokens"):
        model.next_token_logits(tokens[:, None], cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_rows_are_independent(checkpoints, family):
    """Right-padded prompts of different lengths, decoded together: each row's logits equal
    the row decoded alone, whatever its padding (random tokens, left in stale cache slots)."""
    model = load_checkpoint(checkpoints[family][0])
    g = torch.Generator().manual_seed(5)
    prompt_lengths, steps = [5, 9, 2], 4
    rows = [torch.randint(0, VOCAB, (n + steps,), generator=g) for n in prompt_lengths]

    def decode(batch_rows, lengths):
        B, width = len(batch_rows), max(lengths)
        prompts = torch.randint(0, VOCAB, (B, width), generator=g)  # padding: random tokens
        for b, (row, n) in enumerate(zip(batch_rows, lengths)):
            prompts[b, :n] = row[:n]
        cache, lengths_t = new_cache(model, B), torch.tensor(lengths)
        logits = [[] for _ in range(B)]
        with torch.no_grad():
            out = model(prompts, sequential_positions(B, width), cache).logits
            cache.commit(lengths_t)
            for b, n in enumerate(lengths):
                logits[b].append(out[b, n - 1])
            for step in range(steps):
                ids = torch.stack([row[n + step] for row, n in zip(batch_rows, lengths)])[:, None]
                out = model(ids, (lengths_t + step)[:, None], cache).logits  # (B, 1, V)
                cache.commit(torch.ones(B, dtype=torch.int64))
                for b in range(B):
                    logits[b].append(out[b, 0])
        return [torch.stack(row_logits) for row_logits in logits]  # each (1 + steps, V)

    together = decode(rows, prompt_lengths)
    for b, n in enumerate(prompt_lengths):
        alone = decode([rows[b]], [n])[0]
        assert (together[b] - alone).abs().max() <= TOL
        truth = full_logits(model, rows[b][None])[0, n - 1:]  # no cache at all
        assert (together[b] - truth).abs().max() <= TOL


# (c) A tree verification pass = each node's root path recomputed; then compaction = the cache
# of the accepted prefix.

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("inference_pass", ["forward", "step"])
def test_tree_pass_equals_path_recomputation(checkpoints, family, inference_pass):
    """A tree verification pass (forward, or step: the engine's packed inference pass) gives
    every node the logits of its root path recomputed in full, and hidden states equal to
    forward's; compaction then leaves the cache a prefill of the accepted path builds."""
    model = load_checkpoint(checkpoints[family][0])
    run = getattr(model, inference_pass)
    B, N = 3, 10
    tree = random_tree_case(6, B, N, VOCAB)  # ragged num_nodes: rows have padding nodes
    prefix_lengths = torch.tensor([7, 3, 11])
    g = torch.Generator().manual_seed(6)
    prefixes = torch.randint(0, VOCAB, (B, int(prefix_lengths.max())), generator=g)
    cache = new_cache(model, B)
    meta = ops.tree_metadata(tree.parents, tree.num_nodes, prefix_lengths)
    tree_mask = ops.unpack_tree_mask(meta.mask, N)
    with torch.no_grad():
        run(prefixes, sequential_positions(B, prefixes.shape[1]), cache)
        cache.commit(prefix_lengths)
        twin = new_cache(model, B)
        twin.data.copy_(cache.data)
        twin.set_lengths(cache.host_lengths)
        result = run(tree.tokens, meta.positions, cache, tree_mask=tree_mask, hidden_layers=[2, -1])
        reference = model(tree.tokens, meta.positions, twin, tree_mask=tree_mask,
                          hidden_layers=[2, -1])
    out = result.logits  # (B, N, V)
    assert torch.isfinite(out).all()
    for mine, theirs in zip(result.hidden_states, reference.hidden_states, strict=True):
        assert (mine - theirs).abs().max() <= TOL
    assert torch.equal(cache.lengths, prefix_lengths)  # the model never commits
    for b in range(B):
        prefix = prefixes[b, :int(prefix_lengths[b])]
        for i in range(int(tree.num_nodes[b])):
            path, node = [], i
            while node >= 0:
                path.insert(0, int(tree.tokens[b, node]))
                node = int(tree.parents[b, node])
            sequence = torch.cat([prefix, torch.tensor(path)])[None]
            assert (out[b, i] - full_logits(model, sequence)[0, -1]).abs().max() <= TOL

    # The engine's next steps, on real K/V: accept greedily, compact, compare with the cache
    # that prefilling prefix + accepted path builds.
    verdict = ops.verify_tree_greedy(out, tree.tokens, tree.parents, tree.num_nodes)
    cache.compact(verdict.accept_index, verdict.num_accepted)
    for b in range(B):
        accepted = verdict.accept_index[b, :int(verdict.num_accepted[b]) + 1].long()
        sequence = torch.cat([prefixes[b, :int(prefix_lengths[b])], tree.tokens[b, accepted]])
        truth = new_cache(model, 1)
        with torch.no_grad():
            model(sequence[None], sequential_positions(1, len(sequence)), truth)
        n = len(sequence)
        assert int(cache.lengths[b]) == n
        assert (cache.data[:, :, b, :, :n] - truth.data[:, :, 0, :, :n]).abs().max() <= TOL


def test_fully_masked_padding_tokens_stay_finite():
    """A tree_mask row with no True (a padding node masked off entirely), on an empty cache or
    none: the token attends to itself instead of producing NaN, and no other token changes."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig())
    ids = torch.randint(0, 256, (2, 6))
    positions = sequential_positions(2, 6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6).clone()  # (B, T, T)
    mask[1, 4:] = False  # row 1: its last two tokens are padding
    mask[1, :, 4:] = False
    expected = full_logits(model, ids)
    with torch.no_grad():
        for cache in (None, new_cache(model, 2)):
            logits = model(ids, positions, cache, tree_mask=mask).logits
            assert torch.isfinite(logits).all()
            assert (logits[0] - expected[0]).abs().max() <= TOL
            assert (logits[1, :4] - expected[1, :4]).abs().max() <= TOL


# (d) Hidden states for the drafter.

@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_layers_match_transformers(checkpoints, family):
    """hidden_layers=(i,) returns decoder layer i's output: transformers' hidden_states[i + 1]
    for i < L - 1. For the last layer we return the output before the final norm, while
    transformers' hidden_states[L] is after it (norm(ours) = theirs)."""
    folder, hf = checkpoints[family]
    model = load_checkpoint(folder)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    positions = sequential_positions(2, 9)
    with torch.no_grad():
        theirs = hf(input_ids=ids, position_ids=positions, output_hidden_states=True).hidden_states
        ours = model(ids, positions, hidden_layers=(0, 1, 2, -1))
        last = model.model.norm(ours.hidden_states[2])
    assert len(theirs) == LAYERS + 1 and len(ours.hidden_states) == 4
    for i in range(LAYERS - 1):
        assert (ours.hidden_states[i] - theirs[i + 1]).abs().max() <= TOL
    assert (last - theirs[LAYERS]).abs().max() <= TOL
    assert torch.equal(ours.hidden_states[3], ours.hidden_states[2])  # -1 = last layer
    assert model(ids, positions).hidden_states == ()
    with pytest.raises(ValueError, match="hidden_layers: layer 3"):
        model(ids, positions, hidden_layers=(3,))

    # Decoding with a cache harvests the same hidden states as recomputation.
    cache = new_cache(model, 2)
    with torch.no_grad():
        first = model(ids[:, :5], positions[:, :5], cache, hidden_layers=(1,)).hidden_states[0]
        cache.commit(torch.full((2,), 5))
        rest = model(ids[:, 5:], positions[:, 5:], cache, hidden_layers=(1,)).hidden_states[0]
    assert (torch.cat([first, rest], dim=1) - ours.hidden_states[1]).abs().max() <= TOL


# (e) Bad input gets a clear error.

@pytest.fixture
def tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    save_checkpoint(Transformer(ModelConfig()), folder)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_checkpoint_errors_name_the_problem(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint
    load_checkpoint(folder)  # the unedited checkpoint loads

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)  # a folder, but no checkpoint in it

    edit_config(folder, architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match="MistralForCausalLM.*supported: LlamaForCausalLM, "
                                         "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_checkpoint(folder)
    edit_config(folder, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "yarn"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        load_checkpoint(folder)
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    load_checkpoint(folder)

    edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(folder)
    edit_weights(folder, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight has shape \(3, 64\), "
                                         r"the config needs \(128, 64\)"):
        load_checkpoint(folder)
    edit_weights(folder, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64),
                                             "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(ValueError, match="no place for: model.layers.9.mlp.up_proj.weight"):
        load_checkpoint(folder)

    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])  # truncated download
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_checkpoint(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        load_checkpoint(folder)


def test_model_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"num_kv_heads: num_heads \(4\) must be a multiple"):
        ModelConfig(num_kv_heads=3)
    with pytest.raises(ValueError, match="family"):
        ModelConfig(family="gpt2")
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig(family="qwen3")
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})

    model = Transformer(ModelConfig())
    ids = torch.zeros(2, 5, dtype=torch.int64)
    positions = sequential_positions(2, 5)
    with pytest.raises(ValueError, match="positions"):
        model(ids, positions[:, :4])
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.int(), positions)
    with pytest.raises(ValueError, match="tree_mask"):
        model(ids, positions, tree_mask=torch.ones(2, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cache"):
        model(ids, positions, new_cache(model, 3))
    cache = new_cache(model, 2, max_len=8)
    cache.commit(torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="max_len: row 1 would need 9 cache slots"):
        model(ids, positions, cache)


def test_decode_sees_weight_updates(checkpoints):
    """Transformer.next_token_logits runs on packed copies of the weights; an in-place update (what an
    optimizer step does) and a load_state_dict must both reach the next decode."""
    model = load_checkpoint(checkpoints["qwen2"][0])
    tokens = torch.tensor([3, 5])

    def fast_and_slow():
        cache, twin = new_cache(model, 2), new_cache(model, 2)
        with torch.no_grad():
            slow = model(tokens[:, None], twin.lengths[:, None], twin).logits[:, 0]
            return model.next_token_logits(tokens, cache), slow

    before, _ = fast_and_slow()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        model.model.layers[1].self_attn.q_proj.bias.add_(1.0)
    fast, slow = fast_and_slow()
    assert (fast - slow).abs().max() <= 1e-5 and (fast - before).abs().max() > 1e-3
    model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()}, assign=True)
    fast, slow = fast_and_slow()
    assert (fast - slow).abs().max() <= 1e-5


def test_decode_in_bfloat16_follows_forward(checkpoints):
    """Outside float32 the norms are not folded into the packed weights (they normalise in
    float32, as transformers does); decode still follows forward to bfloat16 rounding."""
    model = load_checkpoint(checkpoints["qwen3"][0]).to(torch.bfloat16)
    c = model.config
    tokens = torch.tensor([3, 5, 7])
    cache = KVCache(CacheShape(c.num_layers, 3, c.num_kv_heads, 16, c.head_dim), dtype=torch.bfloat16)
    twin = KVCache(CacheShape(c.num_layers, 3, c.num_kv_heads, 16, c.head_dim), dtype=torch.bfloat16)
    with torch.no_grad():
        fast = model.next_token_logits(tokens, cache)
        slow = model(tokens[:, None], twin.lengths[:, None], twin).logits[:, 0]
    assert fast.dtype == torch.float32
    assert (fast - slow).abs().max() <= 0.02 * slow.abs().max()
