"""The packed inference pass in every weight layout (tlt_core.model.weight_layout) computes what
`Transformer.forward` computes ("cache truth" per layout), copies only where the layout says,
and the memory-bounding parts of prefill (logits at the used positions, chunked prefill) change
nothing the engine emits.
"""

import copy

import pytest
import torch

import tlt_core.model.weight_layout as weight_layout
from tlt_core.engine.engine import EngineConfig, RolloutEngine
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.model.kv_cache import CacheShape, KVCache
from tlt_core.model.transformer import ModelConfig, Transformer

CASES = [("fold", torch.float32), ("panels", torch.float32), ("views", torch.float32),
         ("views", torch.bfloat16), ("panels", torch.bfloat16)]
CASES += [("onednn", dtype) for dtype in (torch.bfloat16, torch.float32)
          if weight_layout.onednn_supports(dtype)]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.03}  # of the logits' largest magnitude


def model_of(family: str, dtype: torch.dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    extra = {"qwen2": dict(attention_bias=True), "qwen3": dict(qk_norm=True)}.get(family, {})
    model = Transformer(ModelConfig(family=family, vocab_size=97, hidden_size=64,
                                    intermediate_size=96, num_layers=2, num_heads=4,
                                    num_kv_heads=2, head_dim=16, **extra))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.to(dtype).eval()


def step_and_forward(model: Transformer, dtype: torch.dtype):
    """Logits of a ragged prefill and three decode steps through `step`, and the same
    positions recomputed by forward without a cache."""
    c, g = model.config, torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 9])
    rows = torch.randint(0, c.vocab_size, (2, 12), generator=g)
    cache = KVCache(CacheShape(c.num_layers, 2, c.num_kv_heads, 32, c.head_dim), dtype=dtype)
    with torch.no_grad():
        prefill = model.step(rows[:, :9], torch.arange(9).expand(2, -1), cache,
                             logit_index=(lengths - 1)[:, None])
        cache.commit(lengths)
        got = [prefill.logits[:, 0]]
        for step in range(3):
            tokens = rows[torch.arange(2), lengths + step]
            got.append(model.next_token_logits(tokens, cache))
            cache.commit(torch.ones(2, dtype=torch.int64))
        expected = []
        for b in range(2):
            n = int(lengths[b])
            full = model(rows[b:b + 1, :n + 3], torch.arange(n + 3)[None]).logits[0]  # (T, V)
            expected.append(full[n - 1:n + 3])
    return torch.stack(got, dim=1), torch.stack(expected)  # (2, 4, V) each


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layout,dtype", CASES)
def test_step_equals_forward_in_every_layout(family, layout, dtype):
    model = model_of(family, dtype)
    model.inference_layout = layout
    got, expected = step_and_forward(model, dtype)
    assert model._decoder.layers.layout == layout
    assert (got - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()


def test_views_layout_copies_nothing_and_uses_fused_parameters():
    model = model_of("qwen2", torch.float32)
    model.inference_layout = "views"
    unfused, _ = step_and_forward(model, torch.float32)
    assert isinstance(model._decoder.layers.packed[0].qkv, tuple)  # three matmuls, no copy
    model.fuse_projections_()
    fused, expected = step_and_forward(model, torch.float32)
    packed = model._decoder.layers.packed[0]
    attn = model.model.layers[0].self_attn
    assert packed.qkv.data_ptr() == attn.q_proj.weight.data_ptr()  # a view, not a copy
    assert packed.qkv_bias.data_ptr() == attn.q_proj.bias.data_ptr()
    assert model.inference_copy_bytes() == 0
    assert (fused - unfused).abs().max() <= 1e-5
    assert (fused - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_fused_parameters_train_and_save_like_separate_ones(tmp_path):
    from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint

    model = model_of("llama", torch.float32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.fuse_projections_()
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 97, (1, 6))
    model(ids, torch.arange(6)[None]).logits.sum().backward()
    optimizer.step()
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + \
        attn.q_proj.weight.nbytes  # still adjacent after the in-place update
    save_checkpoint(model, tmp_path)  # safetensors refuses shared storage: must not raise
    again = load_checkpoint(tmp_path)
    assert all(torch.equal(model.state_dict()[name], tensor)
               for name, tensor in again.state_dict().items())


def test_copy_over_the_memory_budget_falls_back_to_views(monkeypatch):
    model = model_of("llama", torch.float32)
    monkeypatch.setattr(weight_layout, "physical_memory_bytes", lambda: 1000)
    step_and_forward(model, torch.float32)
    assert model._decoder.layers.layout == "views" and model.inference_copy_bytes() == 0
    monkeypatch.setattr(weight_layout, "physical_memory_bytes", lambda: 1 << 40)
    model = model_of("llama", torch.float32)
    step_and_forward(model, torch.float32)
    assert model._decoder.layers.layout == "fold" and model.inference_copy_bytes() > 0


@pytest.mark.skipif(not weight_layout.onednn_supports(torch.bfloat16),
                    reason="no oneDNN bf16 products on this CPU")
def test_onednn_pack_follows_weight_updates():
    model = model_of("qwen3", torch.bfloat16)
    model.inference_layout = "onednn"
    before, _ = step_and_forward(model, torch.bfloat16)
    assert model._decoder.layers.layout == "onednn"
    assert_steps_follow_an_update(model, torch.bfloat16, before)


def assert_steps_follow_an_update(model: Transformer, dtype: torch.dtype, before: torch.Tensor):
    """Scales a layer's down projection and the LM head in place: the next steps' logits move
    (from `before`) and still equal forward's."""
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
        model.lm_head.weight.mul_(0.5)
    after, expected = step_and_forward(model, dtype)
    assert (after - before).abs().max() > 0.01
    assert (after - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()


def test_a_model_packed_in_bf16_decodes_after_turning_float32():
    """.to(float32) after a bf16 pass: the oneDNN packs (no storage) give way to float32 ones."""
    model = model_of("llama", torch.bfloat16)
    step_and_forward(model, torch.bfloat16)
    model.to(torch.float32)
    got, expected = step_and_forward(model, torch.float32)
    assert (got - expected).abs().max() <= TOLERANCE[torch.float32] * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_deep_copy_decodes_with_its_own_weights(dtype):
    """copy.deepcopy of a model (a reference policy, a trainer's own copy) packs the copy's
    parameters and follows their updates, before and after the original was packed."""
    model = model_of("llama", dtype)
    fresh = copy.deepcopy(model)  # before any pack
    step_and_forward(model, dtype)
    packed = copy.deepcopy(model)  # after the original's pack was built
    for twin in (fresh, packed):
        with torch.no_grad():
            twin.model.layers[1].mlp.down_proj.weight.mul_(3.0)
        got, expected = step_and_forward(twin, dtype)
        assert (got - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()
    original, expected = step_and_forward(model, dtype)  # untouched by the copies' updates
    assert (original - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()
    assert (original - got).abs().max() > 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_matrix_is_f_linear_and_follows_its_source(dtype):
    """PackedMatrix (the drafter's fc and head at inference) gives F.linear's bits (in the
    panels layout, the panel product's), in place updates, new tensors, inference tensors and
    deep copies included."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    x = torch.randn(3, 24, generator=g).to(dtype)
    product = weight_layout.PackedMatrix()
    got = product(x, weight, bias)
    want = weight_layout.choose_layout("auto", dtype, x.device, weight.nbytes)
    assert product.layout == (want if want in ("onednn", "panels") else "views")

    def linear(w, b=None):  # what the product's layout computes
        if product.layout != "panels":
            return torch.nn.functional.linear(x, w, b)
        return weight_layout.matmul(x, weight_layout.pack_matrix(w, "panels"), "panels", b)
    assert torch.equal(got, linear(weight, bias))
    assert (got.float() - torch.nn.functional.linear(x, weight, bias).float()).abs().max() <= (
        2 ** -7 * got.float().abs().max())
    twin = copy.deepcopy(product)  # packed (oneDNN's opaque tensors cannot be copied): empty
    assert torch.equal(twin(x, weight, bias), linear(weight, bias))
    weight.mul_(2.0)  # an optimizer step: the version counter moves
    assert torch.equal(product(x, weight), linear(weight))
    other = weight[:20] * 0.5  # another tensor (a regathered head)
    assert torch.equal(product(x, other), linear(other))
    with torch.inference_mode():
        rows = weight.index_select(0, torch.arange(10))  # keeps no version counter
        assert torch.equal(product(x, rows), linear(rows))
        assert torch.equal(product(x, rows), linear(rows))


def test_layout_errors_name_the_field():
    model = model_of("llama", torch.bfloat16)
    model.inference_layout = "fold"
    with pytest.raises(ValueError, match="inference_layout"):
        step_and_forward(model, torch.bfloat16)
    model.inference_layout = "packed"
    with pytest.raises(ValueError, match="inference_layout"):
        step_and_forward(model, torch.bfloat16)
    with pytest.raises(ValueError, match="logit_index"):
        cache = KVCache(CacheShape(2, 1, 2, 8, 16), dtype=torch.bfloat16)
        model.step(torch.zeros(1, 2, dtype=torch.int64), torch.arange(2)[None], cache,
                   logit_index=torch.zeros(2, dtype=torch.int64))


def test_chunked_prefill_emits_what_one_pass_emits():
    """A prefill budget far below the prompts' lengths (chunks of a few tokens, one sample
    admitted at a time) leaves the greedy tokens and their logprobs as they were."""
    model = model_of("qwen2", torch.float32, seed=1)
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, 97, (n,), generator=g).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=6)) for n in (3, 17, 9, 30)]
    results = {}
    for budget in (8192, 5):
        engine = RolloutEngine(model, EngineConfig(max_batch=4, max_len=64,
                                                   prefill_tokens=budget))
        results[budget] = engine.generate(requests).rollouts
    for one_pass, chunked in zip(results[8192], results[5]):
        assert torch.equal(one_pass.tokens, chunked.tokens)
        assert torch.allclose(one_pass.logprobs, chunked.logprobs,
                              atol=1e-5)
    with pytest.raises(ValueError, match="prefill_tokens"):
        EngineConfig(prefill_tokens=0)


def test_layout_falls_back_where_onednn_cannot_multiply_the_dtype(monkeypatch):
    """A CPU without oneDNN's bf16 instructions (AVX2 only) raises at the reorder: the auto
    layout is then "panels" for bf16 where the CPU has AVX2 + FMA, else "views" (float32 keeps
    oneDNN), and asking for "onednn" names the setting."""
    monkeypatch.setattr(weight_layout, "onednn_supports", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(weight_layout, "pairs_vectorised", lambda: False)
    cpu = torch.device("cpu")
    monkeypatch.setattr(weight_layout, "vectorised", lambda: True)
    assert weight_layout.choose_layout("auto", torch.bfloat16, cpu, 1 << 20) == "panels"
    assert weight_layout.panels_wide_layout(1 << 30, torch.bfloat16) is None
    monkeypatch.setattr(weight_layout, "vectorised", lambda: False)
    assert weight_layout.choose_layout("auto", torch.bfloat16, cpu, 1 << 20) == "views"
    assert weight_layout.choose_layout("auto", torch.float32, cpu, 1 << 30) == "onednn"
    with pytest.raises(ValueError, match="inference_layout"):
        weight_layout.choose_layout("onednn", torch.bfloat16, cpu, 1 << 20)


def test_auto_layout_of_float32_weights(monkeypatch):
    """float32 on the CPU: "fold" for weights that stay in cache (dispatch-bound), "panels" for
    larger ones where the CPU has AVX2 + FMA and both its packs fit the budget (their wide
    products oneDNN's only for a model where oneDNN beats fold), else "onednn"."""
    cpu, GiB = torch.device("cpu"), 1 << 30
    monkeypatch.setattr(weight_layout, "physical_memory_bytes", lambda: 16 * GiB)
    monkeypatch.setattr(weight_layout, "onednn_supports", lambda dtype: True)
    monkeypatch.setattr(weight_layout, "vectorised", lambda: True)
    monkeypatch.setattr(weight_layout, "pairs_vectorised", lambda: False)
    choose = weight_layout.choose_layout
    assert choose("auto", torch.float32, cpu, weight_layout.PANELS_MIN_BYTES - 1) == "fold"
    assert choose("auto", torch.float32, cpu, weight_layout.PANELS_MIN_BYTES) == "panels"
    assert choose("auto", torch.float32, cpu, GiB) == "panels"
    assert choose("auto", torch.float32, cpu, 3 * GiB) == "onednn"  # two packs: over 4 GiB
    assert choose("auto", torch.bfloat16, cpu, GiB) == "onednn"
    assert weight_layout.panels_wide_layout(weight_layout.ONEDNN_MIN_BYTES) == "onednn"
    assert weight_layout.panels_wide_layout(weight_layout.ONEDNN_MIN_BYTES - 1) == "fold"
    monkeypatch.setattr(weight_layout, "vectorised", lambda: False)
    assert choose("auto", torch.float32, cpu, GiB) == "onednn"
    assert weight_layout.panels_wide_layout(GiB, torch.bfloat16) == "onednn"
    for dtype, device in ((torch.float16, cpu), (torch.float32, torch.device("cuda"))):
        with pytest.raises(ValueError, match="inference_layout: 'panels'"):
            choose("panels", dtype, device, GiB)


def test_bf16_weights_pack_in_pairs_where_the_cpu_has_avx512_bf16(monkeypatch):
    """bfloat16 on a CPU with AVX512-BF16: "panels" in pairs (beside oneDNN's pack for prefill)
    while both packs fit the budget, else oneDNN's alone; the packed pass then equals forward."""
    cpu, GiB = torch.device("cpu"), 1 << 30
    monkeypatch.setattr(weight_layout, "physical_memory_bytes", lambda: 16 * GiB)
    monkeypatch.setattr(weight_layout, "onednn_supports", lambda dtype: True)
    monkeypatch.setattr(weight_layout, "pairs_vectorised", lambda: True)
    assert weight_layout.choose_layout("auto", torch.bfloat16, cpu, GiB) == "panels"
    assert weight_layout.choose_layout("auto", torch.bfloat16, cpu, 3 * GiB) == "onednn"
    packed = weight_layout.pack_matrix(torch.randn(40, 24).bfloat16(), "panels")
    assert packed.panels.shape == (3, 12, 16, 2) and packed.wide_layout == "onednn"
    monkeypatch.undo()
    if not weight_layout.pairs_vectorised():
        return  # the pass below would multiply in the portable loop: covered by CASES
    model = model_of("llama", torch.bfloat16)
    got, expected = step_and_forward(model, torch.bfloat16)
    assert model._decoder.layers.layout == "panels"
    assert model._decoder.layers.packed[0].qkv.panels.dim() == 4
    assert (got - expected).abs().max() <= TOLERANCE[torch.bfloat16] * expected.abs().max()
    assert_steps_follow_an_update(model, torch.bfloat16, got)


def test_panels_pack_follows_weight_updates_and_counts_both_packs():
    model = model_of("qwen2", torch.float32)
    model.inference_layout = "panels"
    before, _ = step_and_forward(model, torch.float32)
    packed = model._decoder.layers.packed[0]
    assert isinstance(packed.gate_up, weight_layout.PanelWeight)
    layer_bytes = sum(p.nbytes for p in model.model.layers.parameters() if p.dim() == 2)
    assert model._decoder.layers.copy_bytes() == 2 * layer_bytes  # the panels and the wide pack
    assert_steps_follow_an_update(model, torch.float32, before)


def test_bfloat16_panels_keep_the_models_weights_in_one_pack(monkeypatch):
    """In bf16 the panels hold the weights as they are (no norm folded in: that would round
    them), and with no bf16 oneDNN product they are the only pack, whatever the rows."""
    monkeypatch.setattr(weight_layout, "onednn_supports", lambda dtype: dtype == torch.float32)
    model = model_of("llama", torch.bfloat16)
    model.inference_layout = "panels"
    before, _ = step_and_forward(model, torch.bfloat16)
    packed, layer = model._decoder.layers.packed[0], model.model.layers[0]
    assert packed.gate_up.wide is None and packed.post_attention_norm is not None
    gate_up = torch.cat((layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight))
    assert torch.equal(packed.gate_up.panels.transpose(1, 2).reshape(gate_up.shape), gate_up)
    layer_bytes = sum(p.nbytes for p in model.model.layers.parameters() if p.dim() == 2)
    assert model._decoder.layers.copy_bytes() == layer_bytes
    assert_steps_follow_an_update(model, torch.bfloat16, before)


def test_a_panels_product_names_an_input_of_another_dtype():
    """The kernel reads x as the panels' element type: float32 activations against bf16 panels
    (or the reverse) are named, as F.linear names mixed dtypes, never read at the wrong width."""
    for weight_dtype, x_dtype in ((torch.bfloat16, torch.float32),
                                  (torch.float32, torch.bfloat16)):
        packed = weight_layout.pack_matrix(torch.ones(20, 8, dtype=weight_dtype), "panels")
        with pytest.raises(ValueError, match="^x: expected"):
            weight_layout.matmul(torch.ones(2, 8, dtype=x_dtype), packed, "panels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, weight_layout.PANEL_MAX_ROWS,
                                  weight_layout.PANEL_MAX_ROWS + 1])
def test_panels_products_agree_with_the_matrix_on_both_sides_of_the_row_limit(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x, h = torch.randn(rows, 24, generator=g), torch.randn(rows, 40, generator=g)
    weight, bias, x, h = (t.to(dtype) for t in (weight, bias, x, h))
    packed = weight_layout.pack_matrix(weight, "panels")
    got = weight_layout.matmul(x, packed, "panels", bias, addend=h)
    want = x.float() @ weight.float().T + bias.float() + h.float()
    assert got.dtype == dtype
    if dtype == torch.float32:  # the sums' order
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # the panels round once (half a place, 2^-9); oneDNN's wide products round the
        # product, the bias add and the addend's add each once
        wide = rows > weight_layout.PANEL_MAX_ROWS and packed.wide is not None
        scale = (x.float() @ weight.float().T + bias.float()).abs() + h.float().abs()
        bound = (2 ** -7 if wide else 2 ** -8) * scale
        assert ((got.float() - want).abs() <= bound + 1e-5).all()



def test_a_held_pack_is_checked_once_and_followed_again_after():
    """Transformer.inference_pack_held (a generate call): the pack is brought up to date on
    entry and taken as current inside, nested holds included; after it, steps follow the
    parameters again."""
    model = model_of("llama", torch.float32)
    before, _ = step_and_forward(model, torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)  # before the hold: seen
    with model.inference_pack_held():
        inside, expected = step_and_forward(model, torch.float32)
        assert (inside - expected).abs().max() <= TOLERANCE[torch.float32] * expected.abs().max()
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(2.0)  # inside: not seen
        with model.inference_pack_held():
            nested, _ = step_and_forward(model, torch.float32)
        held, _ = step_and_forward(model, torch.float32)
        assert torch.equal(nested, inside) and torch.equal(held, inside)
    after, expected = step_and_forward(model, torch.float32)
    assert (after - inside).abs().max() > 0.01
    assert (after - expected).abs().max() <= TOLERANCE[torch.float32] * expected.abs().max()
