"""Exporting the drafter (tlt_core.export): an export read back drafts exactly what the drafter
drafted, its names, shapes and config keys follow the serving formats' schemas, provenance is
recorded, and a drafter without an exact representation is refused with the reason."""

import argparse
import datetime
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlt_core.cli.export import add_arguments
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import (EXPORT_FORMATS, export_drafter, load_drafter, load_export,
                                      read_provenance, target_sha256)
from tlt_core.drafting.tree import Strategy, draft_tree
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.checkpoint import save_checkpoint
from tlt_core.model.transformer import ModelConfig, Transformer

from tests.speculative_fixtures import PROMPTS, tiny_target, train_drafter

PROVENANCE = {"rl_step": 12, "acceptance_length": 2.5}

# ---- the formats' schemas, as data ---------------------------------------------------------------

# SGLang, python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle): load_weights prepends
# "model." to every name; LlamaModel has `fc = nn.Linear(2H, H)` (bias on), layers.{i} are
# sglang's LlamaDecoderLayer (q/k/v/o_proj, mlp gate/up/down_proj, post_attention_layernorm;
# layer 0's input_layernorm is deleted); embed_tokens and lm_head come from the target.
# Shapes as a function of the target config c.
SGLANG_TENSORS = {
    "fc.weight": lambda c: (c.hidden_size, 2 * c.hidden_size),
    "fc.bias": lambda c: (c.hidden_size,),
    "layers.0.self_attn.q_proj.weight": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "layers.0.self_attn.k_proj.weight": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "layers.0.self_attn.v_proj.weight": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "layers.0.self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "layers.0.mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "layers.0.mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "layers.0.mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    "layers.0.post_attention_layernorm.weight": lambda c: (c.hidden_size,),
}
# The LlamaConfig keys SGLang's Llama layers and rotary embedding read (python/sglang/srt/
# models/llama.py), with architectures naming the EAGLE entry class.
SGLANG_CONFIG_KEYS = {"architectures", "model_type", "vocab_size", "hidden_size",
                      "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                      "rope_theta", "rope_scaling", "max_position_embeddings",
                      "attention_bias", "tie_word_embeddings"}

# speculators, src/speculators/models/eagle.py (EagleSpeculator with layernorms=False,
# fusion_bias=False): fusion_fc (no bias), transformer = LlamaDecoderLayer with input_layernorm
# replaced by nn.Identity, no embedding_layernorm / pre_lm_head_layernorm;
# _keys_to_ignore_on_save drops embed_tokens and lm_head.
SPECULATORS_TENSORS = {
    "fusion_fc.weight": SGLANG_TENSORS["fc.weight"],
    **{name.replace("layers.0.", "transformer."): shape for name, shape in SGLANG_TENSORS.items()
       if name.startswith("layers.0.")},
}
# Fields of EagleSpeculatorConfig (src/speculators/models/eagle.py) and its base
# SpeculatorModelConfig (src/speculators/config.py), with their types.
SPECULATORS_CONFIG_FIELDS = {"speculators_model_type": str, "architectures": list,
                             "transformer_layer_architecture": str,
                             "transformer_layer_config": dict, "layernorms": bool,
                             "fusion_bias": bool, "speculators_config": dict,
                             "speculators_version": str}
# SpeculatorsConfig, VerifierConfig (src/speculators/config.py) and GreedyTokenProposalConfig
# (src/speculators/proposals/greedy.py).
SPECULATORS_CONFIG_SUBFIELDS = {"algorithm": str, "proposal_methods": list,
                                "default_proposal_method": str, "verifier": dict}
VERIFIER_FIELDS = {"name_or_path", "architectures"}
GREEDY_PROPOSAL_FIELDS = {"proposal_type": str, "speculative_tokens": int,
                          "verifier_accept_k": int, "accept_tolerance": float}
# PretrainedConfig keys a config.json carries besides the model's own; SpeculatorModelConfig has
# extra="allow", so tlt_provenance is kept too.
PRETRAINED_KEYS = {"torch_dtype", "tlt_provenance"}


@pytest.fixture(scope="module")
def target():
    target = tiny_target()
    with torch.no_grad():  # a final norm that is not the identity
        target.model.norm.weight.uniform_(0.5, 1.5)
    return target


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(3)
    return train_drafter(target, steps=40, form="eagle")


def _draft(drafter, strategy):
    """A draft tree and the drafter's logits on fixed inputs, through speculative.py."""
    torch.manual_seed(11)
    cache = drafter.new_cache(3, 48)
    tokens = torch.randint(0, drafter.target.config.vocab_size, (3, 5))
    hidden = torch.randn(3, 5, drafter.target.config.hidden_size)
    with torch.no_grad():
        out = drafter(tokens, drafter.features([hidden]), torch.arange(5).expand(3, 5), cache)
        cache.commit(torch.full((3,), 5))
        tree = draft_tree(drafter, cache, tokens[:, -1], out[:, -1], strategy)
        logits = drafter.logits(out)
    return tree, logits


@pytest.mark.parametrize("to", EXPORT_FORMATS)
def test_export_read_back_drafts_identically(target, drafter, to, tmp_path):
    folder = export_drafter(drafter, tmp_path / to, to, PROVENANCE)
    again = load_export(folder, target)
    assert again.config == DrafterConfig(form="eagle")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    for strategy in (Strategy(4, 1, 5), Strategy(4, 3, 10)):
        tree, logits = _draft(drafter, strategy)
        tree_again, logits_again = _draft(again, strategy)
        assert torch.equal(tree.tokens, tree_again.tokens)
        assert torch.equal(tree.parents, tree_again.parents)
        assert torch.equal(logits, logits_again)
    # and the engine rolls out the same tokens with the same acceptance
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=16)) for p in PROMPTS[:4]]
    results = [RolloutEngine(target, EngineConfig(max_batch=4, max_len=40), d).generate(
        requests, strategy=Strategy(5, 4, 16)) for d in (drafter, again)]
    assert [r.tokens.tolist() for r in results[0].rollouts] == \
        [r.tokens.tolist() for r in results[1].rollouts]
    assert results[0].acceptance_length == results[1].acceptance_length


def test_drafter_flag_takes_saved_folders_and_both_exports(target, drafter, tmp_path):
    """load_drafter (what --drafter uses) tells the folders apart by their files."""
    drafter.save(tmp_path / "saved")
    folders = [tmp_path / "saved"] + [export_drafter(drafter, tmp_path / to, to, PROVENANCE)
                                      for to in EXPORT_FORMATS]
    for folder in folders:
        loaded = load_drafter(folder, target)
        assert loaded.config.form == "eagle"
        assert all(torch.equal(loaded.state_dict()[k], v)
                   for k, v in drafter.state_dict().items()), folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="drafter: .*neither drafter_config.json"):
        load_drafter(tmp_path / "empty", target)


def test_eagle_layout_follows_sglang(target, drafter, tmp_path):
    folder = export_drafter(drafter, tmp_path / "eagle", "eagle", PROVENANCE)
    c = target.config
    tensors = load_file(str(folder / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == \
        {name: shape(c) for name, shape in SGLANG_TENSORS.items()}
    assert not tensors["fc.bias"].any()  # SGLang's fc has a bias; ours is zero
    config = json.loads((folder / "config.json").read_text())
    assert set(config) - {"torch_dtype", "mlp_bias"} == SGLANG_CONFIG_KEYS
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # SGLang swaps in the target's embed and head
    assert (config["hidden_size"], config["vocab_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["rms_norm_eps"], config["rope_theta"]) == \
        (c.hidden_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim,
         c.intermediate_size, c.rms_norm_eps, c.rope_theta)


def test_speculators_layout_follows_the_speculators_schema(target, drafter, tmp_path):
    folder = export_drafter(drafter, tmp_path / "spec", "speculators",
                            {**PROVENANCE, "target_name_or_path": "/models/target"},
                            speculative_tokens=3)
    c = target.config
    tensors = load_file(str(folder / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == \
        {name: shape(c) for name, shape in SPECULATORS_TENSORS.items()}
    config = json.loads((folder / "config.json").read_text())
    assert set(config) == set(SPECULATORS_CONFIG_FIELDS) | PRETRAINED_KEYS
    for key, kind in SPECULATORS_CONFIG_FIELDS.items():
        assert isinstance(config[key], kind), key
    assert config["speculators_model_type"] == "eagle"
    assert config["transformer_layer_architecture"] == "LlamaDecoderLayer"
    assert config["architectures"] == ["EagleSpeculator", "LlamaDecoderLayer"]
    assert config["layernorms"] is False and config["fusion_bias"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama"  # EagleSpeculatorConfig builds it by AutoConfig.for_model
    assert layer["num_hidden_layers"] == 1
    assert (layer["hidden_size"], layer["vocab_size"]) == (c.hidden_size, c.vocab_size)
    spec = config["speculators_config"]
    assert set(spec) == set(SPECULATORS_CONFIG_SUBFIELDS)
    for key, kind in SPECULATORS_CONFIG_SUBFIELDS.items():
        assert isinstance(spec[key], kind), key
    assert spec["algorithm"] == "eagle"
    (proposal,) = spec["proposal_methods"]
    assert set(proposal) == set(GREEDY_PROPOSAL_FIELDS)
    for key, kind in GREEDY_PROPOSAL_FIELDS.items():
        assert isinstance(proposal[key], kind), key
    assert proposal["proposal_type"] == spec["default_proposal_method"] == "greedy"
    assert proposal["speculative_tokens"] == 3  # vLLM's num_speculative_tokens
    assert set(spec["verifier"]) == VERIFIER_FIELDS
    assert spec["verifier"] == {"name_or_path": "/models/target",
                                "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("to", EXPORT_FORMATS)
def test_provenance_is_recorded(target, drafter, to, tmp_path):
    folder = export_drafter(drafter, tmp_path / to, to, {**PROVENANCE, "note": "x"})
    record = read_provenance(folder)
    assert record["target_sha256"] == target_sha256(target)
    assert (record["rl_step"], record["acceptance_length"], record["note"]) == (12, 2.5, "x")
    assert record["format"] == to and record["drafter_form"] == "eagle"
    assert record["tlt_core_version"]
    datetime.datetime.fromisoformat(record["date"])
    if to == "eagle":
        assert (folder / "tlt_provenance.json").is_file()
    else:
        assert json.loads((folder / "config.json").read_text())["tlt_provenance"] == record


def test_target_hash_follows_the_weights(target):
    twin = tiny_target()
    twin.load_state_dict(target.state_dict())
    assert target_sha256(twin) == target_sha256(target)
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert target_sha256(twin) != target_sha256(target)


def test_bad_exports_raise_clear_errors(target, drafter, tmp_path):
    for config in (DrafterConfig(form="tlt"), DrafterConfig((0, -1))):
        with pytest.raises(ValueError, match=r"no exact representation.*form='eagle'"):
            export_drafter(Drafter(target, config), tmp_path / "x", "eagle", PROVENANCE)
    with pytest.raises(ValueError, match="fuses 2 target layers"):
        export_drafter(Drafter(target, DrafterConfig((0, -1))), tmp_path / "x", "eagle",
                       PROVENANCE)
    with pytest.raises(ValueError, match="to:"):
        export_drafter(drafter, tmp_path / "x", "medusa", PROVENANCE)
    with pytest.raises(ValueError, match="provenance.*rl_step"):
        export_drafter(drafter, tmp_path / "x", "eagle", {"acceptance_length": None})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="out:"):
        export_drafter(drafter, tmp_path / "file", "eagle", PROVENANCE)

    with pytest.raises(FileNotFoundError, match="folder"):
        load_export(tmp_path / "nothing", target)
    folder = export_drafter(drafter, tmp_path / "eagle", "eagle", PROVENANCE)
    with pytest.raises(ValueError, match="target.*hidden_size"):
        load_export(folder, Transformer(ModelConfig(vocab_size=40, hidden_size=16, num_heads=2,
                                                    num_kv_heads=1, head_dim=8)))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.bias"] += 1.0
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.bias is not zero"):
        load_export(folder, target)


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.runner(args)


def test_cli_exports_a_saved_drafter_for_a_checkpoint(target, drafter, tmp_path):
    save_checkpoint(target, tmp_path / "target")
    drafter.save(tmp_path / "drafter")
    out = tmp_path / "out"
    assert _cli(["drafter", "--to", "speculators", str(out), "--drafter",
                 str(tmp_path / "drafter"), "--target", str(tmp_path / "target"),
                 "--step", "7", "--acceptance", "3.25"]) == 0
    record = read_provenance(out)
    assert (record["rl_step"], record["acceptance_length"]) == (7, 3.25)
    assert record["target_name_or_path"] == str(tmp_path / "target")
    reloaded = load_export(out, target)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in drafter.state_dict().items())

    Drafter(target, DrafterConfig(form="tlt")).save(tmp_path / "tlt")  # form "tlt": refused, naming the flag and the fix
    with pytest.raises(SystemExit, match=r"--drafter: .*form='eagle'"):
        _cli(["drafter", "--to", "eagle", str(out), "--drafter", str(tmp_path / "tlt"),
              "--target", str(tmp_path / "target")])
    with pytest.raises(SystemExit, match="--drafter: .*no drafter_config.json"):
        _cli(["drafter", "--to", "eagle", str(out), "--drafter", str(tmp_path / "nowhere"),
              "--target", str(tmp_path / "target")])
    with pytest.raises(SystemExit, match="--target"):
        _cli(["drafter", "--to", "eagle", str(out), "--drafter", str(tmp_path / "drafter"),
              "--target", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--acceptance"):
        _cli(["drafter", "--to", "eagle", str(out), "--acceptance", "0.5"])
    with pytest.raises(SystemExit, match="--step"):
        _cli(["drafter", "--to", "eagle", str(out), "--step", "-1"])


def test_cli_exports_the_drafter_of_a_train_run(tmp_path):
    """`--run`: the drafter a `tlt train` run trained, for the policy of its checkpoint's step:
    the export's provenance hashes that policy and records the step, and it reloads into the
    run's own drafter exactly."""
    from tests.test_train import detokenize, small, toy_prompts, toy_reward
    from tlt_core.rl.driver import RLDriver

    base = tiny_target()
    save_checkpoint(base, tmp_path / "base")
    policy = tiny_target()
    trainer = RLDriver(policy, toy_prompts(), toy_reward, detokenize, (),
                        small(tlt=True, steps=1, lr=1e-2), drafter=train_drafter(policy))
    trainer.step()
    trainer.save(tmp_path / "run" / "checkpoints")
    assert _cli(["drafter", "--to", "eagle", str(tmp_path / "out"), "--run",
                 str(tmp_path / "run"), "--target", str(tmp_path / "base")]) == 0
    record = read_provenance(tmp_path / "out")
    assert record["rl_step"] == 1 and record["target_sha256"] == target_sha256(policy)
    assert target_sha256(policy) != target_sha256(base)  # the step moved the policy
    reloaded = load_export(tmp_path / "out", policy)
    for name, tensor in trainer.drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor)
    with pytest.raises(SystemExit, match="--run: no checkpoint in"):
        _cli(["drafter", "--to", "eagle", str(tmp_path / "o2"), "--run", str(tmp_path)])
    with pytest.raises(SystemExit, match="not both"):
        _cli(["drafter", "--to", "eagle", str(tmp_path / "o2"), "--run", str(tmp_path / "run"),
              "--drafter", str(tmp_path)])


def _same_policy_folders(a, b):
    """Equal weights, configs, tokenizer files; provenance equal but for nothing."""
    ours, theirs = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "tlt_policy.json"):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


def test_train_writes_policy_folders_that_export_copies_or_rebuilds(tmp_path, capsys,
                                                                      caplog):
    """`tlt train --model` writes checkpoints/step-N (the newest K), policy/step-N (every
    --save-every steps and the last) and tokenizer/; `tlt export policy` copies a policy folder
    or rebuilds the same folder from a checkpoint; --resume continues from the newest
    checkpoint; an older version's checkpoint.pt is refused by both commands."""
    import shutil

    from tests.cli_fixtures import tiny_checkpoint, word
    from tlt_core.cli import main
    from tlt_core.persistence.checkpoint_io import read_state

    model, _ = tiny_checkpoint(tmp_path, with_drafter=False)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{word(i)} {word(i + 1)}", "answer": "7"})
                            + "\n" for i in range(1, 9)))
    run = tmp_path / "run"

    def train(out, *flags):
        return main(["train", "--model", str(model), "--data", str(data), "--out", str(out),
                     "--no-tlt", "--prompts-per-step", "2", "--samples-per-prompt", "2",
                     "--max-new-tokens", "6", "--minibatch-size", "4", "--max-batch", "4",
                     "--no-progress", "--tensorboard", "off", *flags])

    assert train(run, "--steps", "3", "--keep-checkpoints", "2") == 0
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-000002",
                                                                         "step-000003"]
    assert [p.name for p in sorted((run / "policy").iterdir())] == ["step-000003"]  # the last
    assert f"policy after step 3: {run / 'policy' / 'step-000003'}" in capsys.readouterr().out
    assert (run / "tokenizer" / "tokenizer.json").is_file()

    assert _cli(["policy", str(tmp_path / "copied"), "--run", str(run)]) == 0  # the newest
    _same_policy_folders(tmp_path / "copied", run / "policy" / "step-000003")
    written = tmp_path / "written"
    shutil.move(run / "policy" / "step-000003", written)
    assert _cli(["policy", str(tmp_path / "rebuilt"), "--run", str(run), "--step", "3"]) == 0
    _same_policy_folders(tmp_path / "rebuilt", written)
    assert _cli(["policy", str(tmp_path / "rebuilt"), "--run", str(run), "--step", "2"]) == 0
    step2 = load_file(str(tmp_path / "rebuilt" / "model.safetensors"))
    policy2 = read_state(run / "checkpoints" / "step-000002")["policy"]
    assert all(torch.equal(t, policy2[k]) for k, t in step2.items())
    assert json.loads((tmp_path / "rebuilt" / "tlt_policy.json").read_text())["step"] == 2
    with pytest.raises(SystemExit, match=r"--step: .*no step 1: policy folders of steps none, "
                                         r"checkpoints of steps \[2, 3\]"):
        _cli(["policy", str(tmp_path / "o"), "--run", str(run), "--step", "1"])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(SystemExit, match="OUT: .*neither empty nor an exported policy"):
        _cli(["policy", str(tmp_path / "mine"), "--run", str(run)])
    with pytest.raises(SystemExit, match="--run: .*no policy folders"):
        _cli(["policy", str(tmp_path / "o"), "--run", str(tmp_path / "mine")])

    assert train(run, "--steps", "4", "--resume", "--save-every", "1") == 0
    assert "resumed at step 3" in caplog.text
    assert [p.name for p in sorted((run / "policy").iterdir())] == ["step-000004"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4

    old = tmp_path / "old"
    old.mkdir()
    torch.save({"step": 1}, old / "checkpoint.pt")
    with pytest.raises(SystemExit, match="--resume: .*older tlt_core.*start a new run"):
        train(old, "--resume")
    with pytest.raises(SystemExit, match="--run: .*older tlt_core.*start a new run"):
        _cli(["policy", str(tmp_path / "o"), "--run", str(old)])
