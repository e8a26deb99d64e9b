"""A bf16 model's decoder layers in one kernel call (tlt_core.ops.decoder_layers,
csrc/include/tlt/decoder_layers.h): the same bits as its kernels called one by one (the ops, and
the model's packed pass with the whole-pass kernel off), hidden states included; which passes
take it; bad input named, with nothing written."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import tlt_core.model.packed as packed
import tlt_core.ops as ops
from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.model.kv_cache import CacheShape, KVCache
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.ops.decoder_layers import DecoderLayers, DecoderLayerWeights, DecoderShape
from tests.pass_kernel_flags import assert_engine_decodes_alike

BF16 = torch.bfloat16


def random_layers(shape: DecoderShape, num_layers: int, g: torch.Generator, *, pairs: bool,
                  bias: bool) -> list[DecoderLayerWeights]:
    H, d, I = shape.hidden, shape.head_dim, shape.intermediate
    qkv_width = (shape.q_heads + 2 * shape.kv_heads) * d

    def matrix(out_features: int, in_features: int) -> torch.Tensor:
        weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
        return ops.pack_panels(weight.to(BF16), pairs=pairs)

    def vector(size: int, centre: float = 0.0) -> torch.Tensor:
        return (centre + 0.3 * torch.randn(size, generator=g)).to(BF16)

    return [DecoderLayerWeights(
        input_norm=vector(H, 1.0), input_eps=1e-6, qkv=matrix(qkv_width, H),
        qkv_bias=vector(qkv_width) if bias else None, o=matrix(H, shape.q_heads * d),
        o_bias=vector(H) if bias else None, post_attention_norm=vector(H, 1.0),
        post_attention_eps=1e-5, gate_up=matrix(2 * I, H), down=matrix(H, I))
        for _ in range(num_layers)]


def one_by_one(layers, shape: DecoderShape, h, positions, slots, cache, cos, sin_signed, mask,
               read_len, saved_layers):
    """What DecoderLayers promises to equal: its kernels through the public ops."""
    B, T = positions.shape
    saved = {}
    for index, layer in enumerate(layers):
        x = h
        if layer.input_norm is not None:
            h, x = ops.add_rms_norm(h, None, layer.input_norm, layer.input_eps)
        heads = shape.q_heads + 2 * shape.kv_heads
        qkv = ops.panel_matmul(x, layer.qkv, heads * shape.head_dim, layer.qkv_bias)
        if layer.q_norm is not None:  # each q head, then each k head, RMSNormed
            qkv = qkv.view(B * T, heads, shape.head_dim).clone()
            for first, count, weight in ((0, shape.q_heads, layer.q_norm),
                                         (shape.q_heads, shape.kv_heads, layer.k_norm)):
                part = qkv[:, first:first + count].reshape(-1, shape.head_dim).contiguous()
                qkv[:, first:first + count] = ops.add_rms_norm(
                    part, None, weight, layer.qk_eps)[1].view(B * T, count, shape.head_dim)
            qkv = qkv.view(B * T, -1)
        q = torch.empty(B, shape.q_heads, T, shape.head_dim, dtype=cache.dtype)  # the cache's
        ops.rope_kv_write(qkv.view(B, T, heads, shape.head_dim), cos, sin_signed, positions, slots,
                          cache[index], q)
        attended = ops.decode_attention(q, cache[index], read_len, mask, BF16)
        h = ops.panel_matmul(attended, layer.o, shape.hidden, layer.o_bias, addend=h)
        h, x = ops.add_rms_norm(h, None, layer.post_attention_norm, layer.post_attention_eps)
        act = ops.silu_mul(ops.panel_matmul(x, layer.gate_up, 2 * shape.intermediate))
        h = ops.panel_matmul(act, layer.down, shape.hidden, addend=h)
        if index in saved_layers:
            saved[index] = h.clone()
    return h, saved


def a_pass(seed: int, *, batch: int, tokens: int, masked: bool, q_heads: int = 4,
           kv_heads: int = 2):
    """Random inputs of a pass over a cache holding 9-12 committed slots a row."""
    g = torch.Generator().manual_seed(seed)
    shape = DecoderShape(hidden=40, q_heads=q_heads, kv_heads=kv_heads, head_dim=8,
                         intermediate=56)
    max_len, table_len = 24, 32
    lengths = torch.randint(9, 13, (batch,), generator=g)
    positions = (lengths[:, None] + torch.arange(tokens)).contiguous()
    slots = positions.clone()
    read_len = (int(lengths.max()) if batch else 9) + tokens
    mask = None
    if masked:  # each row its own prefix and its new tokens causally
        seen = torch.arange(read_len)[None, None, :] <= positions[:, :, None]
        mask = seen[:, None]  # (B, 1, T, S)
    angles = torch.arange(table_len)[:, None] * 0.1 * torch.arange(1, shape.head_dim + 1)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    cache = torch.randn(3, 2, batch + 1, kv_heads, max_len, shape.head_dim, generator=g)
    h = torch.randn(batch * tokens, shape.hidden, generator=g).to(BF16)
    return g, shape, dict(h=h, positions=positions, slots=slots, cache=cache[:, :, :batch],
                          cos=cos, sin_signed=sin, mask=mask, read_len=read_len)


def assert_one_call_is_one_by_one(layers, shape: DecoderShape, args: dict) -> dict:
    """DecoderLayers over args = one_by_one over a copy, bit for bit (h and the cache's K and
    V); returns the copy, as one_by_one left it."""
    want_args = {**args, "h": args["h"].clone(), "cache": args["cache"].clone()}
    want_h, _ = one_by_one(layers, shape, **want_args, saved_layers=())
    h, _ = DecoderLayers(shape, layers)(**args)
    assert torch.equal(h.view(torch.int16), want_h.view(torch.int16))
    assert torch.equal(args["cache"], want_args["cache"])
    return {**want_args, "h": want_h}


@pytest.mark.parametrize("batch,tokens,masked,pairs,bias", [
    (1, 1, False, True, False), (1, 1, False, False, True), (2, 3, True, True, True),
    (3, 1, True, False, False), (1, 5, True, True, False), (0, 1, False, True, False)])
def test_one_call_is_its_kernels_one_by_one_bit_for_bit(batch, tokens, masked, pairs, bias):
    g, shape, args = a_pass(batch * 10 + tokens, batch=batch, tokens=tokens, masked=masked)
    layers = random_layers(shape, 3, g, pairs=pairs, bias=bias)
    want_args = {**args, "h": args["h"].clone(), "cache": args["cache"].clone()}
    want_h, want_saved = one_by_one(layers, shape, **want_args, saved_layers=(0, 2))
    h, saved = DecoderLayers(shape, layers)(**args, saved_layers=[0, 2])
    assert h.data_ptr() == args["h"].data_ptr()  # in place
    assert torch.equal(h.view(torch.int16), want_h.view(torch.int16))
    assert saved.keys() == {0, 2}
    for index in saved:
        assert torch.equal(saved[index].view(torch.int16), want_saved[index].view(torch.int16))
    assert torch.equal(args["cache"], want_args["cache"])  # the same K and V written


@pytest.mark.parametrize("batch,tokens,masked", [(1, 1, False), (2, 3, True), (1, 5, True)])
def test_a_bf16_cache_gives_the_bits_of_a_float32_cache(batch, tokens, masked):
    """A bf16 model's K and V are bf16 values, so a bf16 cache holding the committed slots'
    values leaves h, the saved layers and the new K and V bit for bit as a float32 cache does."""
    g, shape, args = a_pass(batch * 7 + tokens, batch=batch, tokens=tokens, masked=masked)
    layers = random_layers(shape, 3, g, pairs=True, bias=True)
    args["cache"] = args["cache"].to(BF16).float()  # committed slots: bf16 values
    narrow_args = {**args, "h": args["h"].clone(), "cache": args["cache"].to(BF16)}
    wide_h, wide_saved = DecoderLayers(shape, layers)(**args, saved_layers=[1])
    narrow_h, narrow_saved = DecoderLayers(shape, layers)(**narrow_args, saved_layers=[1])
    assert torch.equal(narrow_h.view(torch.int16), wide_h.view(torch.int16))
    assert torch.equal(narrow_saved[1].view(torch.int16), wide_saved[1].view(torch.int16))
    assert torch.equal(narrow_args["cache"].float(), args["cache"])  # the same K and V written


def test_a_layer_without_an_input_norm_multiplies_h_itself():
    """EAGLE's drafter layer (its input norm an Identity)."""
    g, shape, args = a_pass(3, batch=2, tokens=3, masked=True)
    layers = [dataclasses.replace(layer, input_norm=None)
              for layer in random_layers(shape, 2, g, pairs=True, bias=True)]
    assert_one_call_is_one_by_one(layers, shape, args)


def test_q_and_k_norms_run_per_head():
    """Qwen3's: every q head and every k head RMSNormed after the product, v left as it is."""
    g, shape, args = a_pass(8, batch=2, tokens=3, masked=True)
    layers = [dataclasses.replace(layer, q_norm=(1 + 0.3 * torch.randn(8, generator=g)).to(BF16),
                                  k_norm=(1 + 0.3 * torch.randn(8, generator=g)).to(BF16),
                                  qk_eps=1e-6)
              for layer in random_layers(shape, 2, g, pairs=True, bias=False)]
    before = {**args, "h": args["h"].clone(), "cache": args["cache"].clone()}
    normed = assert_one_call_is_one_by_one(layers, shape, args)["h"]
    unnormed = [dataclasses.replace(layer, q_norm=None, k_norm=None) for layer in layers]
    other, _ = DecoderLayers(shape, unnormed)(**before)
    assert not torch.equal(other, normed)


def test_a_cache_with_more_layers_than_the_stack_uses_its_first():
    g, shape, args = a_pass(5, batch=2, tokens=2, masked=True)
    layers = random_layers(shape, 2, g, pairs=True, bias=False)
    before = args["cache"].clone()
    DecoderLayers(shape, layers)(**args)
    assert torch.equal(args["cache"][2], before[2])
    assert not torch.equal(args["cache"][:2], before[:2])


def test_grouped_and_multi_head_attention():
    for q_heads, kv_heads in ((3, 1), (2, 2)):
        g, shape, args = a_pass(7, batch=2, tokens=2, masked=True, q_heads=q_heads,
                                kv_heads=kv_heads)
        assert_one_call_is_one_by_one(random_layers(shape, 1, g, pairs=False, bias=True),
                                      shape, args)


def bad_call(name: str, args: dict) -> dict:
    args = dict(args)
    if name == "h":
        args["h"] = args["h"].float()
    elif name == "positions":
        args["positions"] = args["positions"].int()
    elif name == "slots":
        args["slots"] = args["slots"] + 100  # past max_len: the kernel's own check
    elif name == "cos":
        args["cos"] = args["cos"][:, :4].contiguous()
    elif name == "sin_signed":
        args["sin_signed"] = args["sin_signed"][:5].contiguous()
    elif name == "cache":
        args["cache"] = args["cache"].to(torch.float16)
    elif name == "read_len":
        args["read_len"] = 1000
    elif name == "mask":
        args["mask"] = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    elif name == "saved_layers":
        args["saved_layers"] = [3]
    return args


@pytest.mark.parametrize("name", ["h", "positions", "slots", "cos", "sin_signed", "cache",
                                  "read_len", "mask", "saved_layers"])
def test_bad_input_is_named_and_nothing_is_written(name):
    g, shape, args = a_pass(11, batch=2, tokens=2, masked=True)
    layers = DecoderLayers(shape, random_layers(shape, 2, g, pairs=True, bias=False))
    args = bad_call(name, args)
    h, cache = args["h"].clone(), args["cache"].clone()
    with pytest.raises(ValueError, match=f"^{name}"):
        layers(**args)
    assert torch.equal(args["h"], h) and torch.equal(args["cache"], cache)


def test_bad_weights_are_named():
    g = torch.Generator().manual_seed(1)
    shape = DecoderShape(hidden=16, q_heads=2, kv_heads=1, head_dim=8, intermediate=24)
    layer = random_layers(shape, 1, g, pairs=True, bias=False)[0]
    for field, value in (("qkv", layer.o), ("down", layer.down.float()),
                         ("input_norm", layer.input_norm[:8]),
                         ("o_bias", torch.ones(3, dtype=BF16)),
                         ("post_attention_eps", -1.0), ("q_norm", torch.ones(8, dtype=BF16)),
                         ("qk_eps", float("nan"))):
        with pytest.raises(ValueError, match=r"^layers\[0\]\." + field):
            DecoderLayers(shape, [dataclasses.replace(layer, **{field: value})])
    with pytest.raises(ValueError, match="^shape"):
        DecoderLayers(DecoderShape(16, 3, 2, 8, 24), [layer])


# ---- through the model ------------------------------------------------------------------------

def bf16_model(**config) -> Transformer:
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
                 num_kv_heads=2, head_dim=8)
    model = Transformer(ModelConfig(**{**shape, **config})).eval().to(BF16)
    model.inference_layout = "panels"
    return model


def passes(model: Transformer, kernel: bool, monkeypatch, tree_mask=None):
    """Logits and hidden states of a prefill, then of passes of 1 and 3 new tokens over rows of
    unequal lengths, with the whole-pass kernel on or off."""
    monkeypatch.setattr(packed, "DECODER_LAYERS_KERNEL", kernel)
    g = torch.Generator().manual_seed(2)
    config = model.config
    cache = KVCache(CacheShape(config.num_layers, 2, config.num_kv_heads, 40, config.head_dim),
                    dtype=torch.float32)
    outputs = []
    with torch.no_grad():
        prompt = torch.randint(0, config.vocab_size, (2, 11), generator=g)
        outputs.append(model.step(prompt, torch.arange(11).expand(2, 11), cache,
                                  hidden_layers=[1]))
        cache.set_lengths(torch.tensor([11, 7]))  # unequal rows: a mask
        for tokens in (1, 3):
            new = torch.randint(0, config.vocab_size, (2, tokens), generator=g)
            positions = cache.lengths[:, None] + torch.arange(tokens)
            mask = None if tokens == 1 else tree_mask
            outputs.append(model.step(new, positions, cache, tree_mask=mask,
                                      hidden_layers=[0, 2]))
            cache.set_lengths(cache.lengths + tokens)
    return outputs


@pytest.mark.parametrize("config", [{}, {"family": "llama", "attention_bias": True},
                                    {"family": "qwen2", "attention_bias": True},
                                    {"family": "qwen3", "qk_norm": True},
                                    {"family": "qwen3", "qk_norm": True, "num_kv_heads": 1}],
                         ids=str)
def test_the_packed_pass_is_the_same_bits_with_and_without_it(config, monkeypatch):
    model = bf16_model(**config)
    assert model._decoder.layers.decoder_kernel() is not None
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two branches
    for tree_mask in (None, tree.expand(2, 3, 3)):
        fused, one_by_one_ = (passes(model, kernel, monkeypatch, tree_mask)
                              for kernel in (True, False))
        for a, b in zip(fused, one_by_one_):
            assert torch.equal(a.logits, b.logits)
            assert len(a.hidden_states) == len(b.hidden_states)
            for x, y in zip(a.hidden_states, b.hidden_states):
                assert torch.equal(x, y)


def test_passes_it_cannot_run_go_one_by_one():
    float32 = bf16_model().float()
    float32.inference_layout = "panels"
    assert float32._decoder.layers.decoder_kernel() is None  # folded norms


def test_a_pack_rebuilt_after_a_weight_change_gets_a_new_kernel():
    model = bf16_model()
    first = model._decoder.layers.decoder_kernel()
    assert model._decoder.layers.decoder_kernel() is first
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    assert model._decoder.layers.decoder_kernel() is not first


@pytest.mark.parametrize("plan", [None, Strategy(4, 1, 5)], ids=str)
def test_an_engine_decodes_bf16_bit_for_bit_through_it(target, drafter, plan, monkeypatch):
    """Prefill, plain steps, the drafter's levels and verification, at T = 0 and T = 1; the
    drafter's layer (EAGLE's: no input norm) through the kernel too."""
    target = copy.deepcopy(target)
    target.inference_layout = "panels"
    bf16_drafter = Drafter(copy.deepcopy(target).to(BF16), drafter.config)
    bf16_drafter.load_state_dict(drafter.state_dict())
    assert isinstance(bf16_drafter.layer.input_layernorm, torch.nn.Identity)
    bf16_drafter._packed.requested_layout = lambda: "panels"  # "auto" may pick oneDNN's
    assert bf16_drafter._packed.decoder_kernel() is not None
    assert_engine_decodes_alike(target, drafter, plan, "DECODER_LAYERS_KERNEL", monkeypatch,
                                dtype=BF16, atol=0)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_qwen3_pass_through_it_follows_forward(kv_heads):
    """The q/k norms per head, in one call, give what the unpacked forward gives, to bf16
    rounding (one k head: its rows are strided in the q|k|v product)."""
    model = bf16_model(family="qwen3", qk_norm=True, num_kv_heads=kv_heads)
    assert model._decoder.layers.decoder_kernel() is not None
    config = model.config
    prompt = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(9).expand(2, 9)
    caches = [KVCache(CacheShape(config.num_layers, 2, config.num_kv_heads, 16, config.head_dim),
                      dtype=torch.float32) for _ in range(2)]
    with torch.no_grad():
        fast = model.step(prompt, positions, caches[0]).logits
        slow = model(prompt, positions, caches[1]).logits
    assert (fast - slow).abs().max() <= 0.03 * slow.abs().max()
