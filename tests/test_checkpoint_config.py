"""A checkpoint's config.json is read with strict JSON types, and a config too large for the
machine is refused before anything is built (tlt_core.model.checkpoint, ModelConfig.from_hf_config)."""

import json
import time

import pytest
import torch

from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.model.transformer import ModelConfig, Transformer


@pytest.fixture
def tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    save_checkpoint(Transformer(ModelConfig(tie_word_embeddings=False)), folder)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("key, value, kind", [
    ("tie_word_embeddings", "false", TypeError),  # a string is not a bool
    ("tie_word_embeddings", 0, TypeError),
    ("attention_bias", "true", TypeError),
    ("mlp_bias", "false", TypeError),
    ("num_hidden_layers", True, TypeError),  # a bool is not an int
    ("num_hidden_layers", 2.0, TypeError),
    ("num_hidden_layers", "2", TypeError),
    ("hidden_size", None, TypeError),
    ("vocab_size", [256], TypeError),
    ("num_attention_heads", 0, ValueError),  # zero heads
    ("num_key_value_heads", -2, ValueError),
    ("intermediate_size", {"value": 128}, TypeError),
    ("rms_norm_eps", "1e-6", TypeError),
    ("rms_norm_eps", None, TypeError),
    ("rope_theta", True, TypeError),
    ("max_position_embeddings", 2048.5, TypeError),
    ("rope_scaling", [], TypeError),
    ("rope_scaling", "llama3", TypeError),
    ("hidden_act", None, TypeError),
    ("architectures", "LlamaForCausalLM", TypeError),
])
def test_bad_input_gets_a_clear_error_config_fields_have_strict_json_types(
        tiny_checkpoint, key, value, kind):
    load_checkpoint(tiny_checkpoint)  # the unedited checkpoint loads
    edit_config(tiny_checkpoint, **{key: value})
    with pytest.raises(kind, match=f"{key}: .*config.json"):
        load_checkpoint(tiny_checkpoint)


def test_bad_input_gets_a_clear_error_llama3_rope_values_are_numbers(tiny_checkpoint):
    edit_config(tiny_checkpoint, rope_scaling={
        "rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024})
    with pytest.raises(TypeError, match="rope_scaling.factor: must be a number"):
        load_checkpoint(tiny_checkpoint)


def test_bad_input_gets_a_clear_error_config_is_an_object(tiny_checkpoint):
    for text in ("[]", "null", "3", "[" * 100_000):
        (tiny_checkpoint / "config.json").write_text(text)
        with pytest.raises(ValueError, match="config.json"):
            load_checkpoint(tiny_checkpoint)
    with pytest.raises(TypeError, match="config: must be a JSON object"):
        ModelConfig.from_hf_config(["LlamaForCausalLM"])


def test_nothing_a_user_gave_is_lost_untied_lm_head_stays_untied(tiny_checkpoint):
    edit_config(tiny_checkpoint, tie_word_embeddings=False)
    model = load_checkpoint(tiny_checkpoint)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_null_is_absent_only_where_transformers_derives_the_value():
    hf = {**ModelConfig().to_hf_config(), "head_dim": None, "num_key_value_heads": None,
          "rope_scaling": None, "rope_parameters": None, "rope_theta": None}
    config = ModelConfig.from_hf_config(hf)
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (16, 4, 10000.0)


def test_bad_input_gets_a_clear_error_a_config_too_large_is_refused_before_building(
        tiny_checkpoint):
    edit_config(tiny_checkpoint, num_hidden_layers=10**7)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"config.json: the config describes .* parameters "
                                         r".*GiB.*num_hidden_layers \(10000000\)"):
        load_checkpoint(tiny_checkpoint)
    assert time.monotonic() - start < 5  # refused from the numbers, not after building


def test_parameter_estimate_counts_what_the_model_holds():
    for kwargs in ({}, {"tie_word_embeddings": True}, {"family": "qwen2", "attention_bias": True},
                   {"family": "qwen3", "qk_norm": True, "attention_bias": True}):
        config = ModelConfig(**kwargs)
        with torch.device("meta"):
            model = Transformer(config)
        assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_bad_input_gets_a_clear_error_model_config_integers_are_not_bools_or_floats():
    with pytest.raises(TypeError, match="num_layers"):
        ModelConfig(num_layers=True)
    with pytest.raises(TypeError, match="hidden_size"):
        ModelConfig(hidden_size=64.0)


def test_bad_input_gets_a_clear_error_index_shards_are_file_names(tiny_checkpoint):
    (tiny_checkpoint / "model.safetensors").rename(tiny_checkpoint / "shard.safetensors")
    for shard in (None, 3, ["shard.safetensors"]):
        (tiny_checkpoint / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": shard}}))
        with pytest.raises(ValueError, match=r"weight_map\['model.norm.weight'\]"):
            load_checkpoint(tiny_checkpoint)
