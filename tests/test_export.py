"""Exporting the drafter to the EAGLE-1 layout (tlt_core.drafting.export): an export read back
drafts exactly what the drafter drafted, with the whole vocabulary or a reduced one; its names,
shapes, config keys and architecture names follow what SGLang and vLLM load; every file is mode
0644; provenance is recorded; and a drafter without an exact representation is refused with
the reason. (EAGLE-3 exports: tests/test_export_eagle3.py.)"""

import argparse
import datetime
import json
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlt_core.cli.export import add_arguments
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.export import (export_drafter, load_drafter, load_export, read_provenance,
                                      target_sha256)
from tlt_core.drafting.tree import Strategy, draft_tree
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.checkpoint import save_checkpoint
from tlt_core.model.transformer import ModelConfig, Transformer

from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target, train_drafter

PROVENANCE = {"rl_step": 12, "acceptance_length": 2.5}
DRAFT_IDS = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:24]
                   .tolist())  # a reduced draft vocabulary of V' = 24 target ids

# ---- the layout's schema, as data ----------------------------------------------------------------

# SGLang, python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle), and vLLM,
# vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM): load_weights prepends
# "model." to every name; LlamaModel has `fc = nn.Linear(2H, H)` (SGLang: bias on; vLLM: off,
# and skips an fc.bias), layers.{i} a LlamaDecoderLayer (q/k/v/o_proj, mlp gate/up/down_proj,
# post_attention_layernorm; layer 0's input_layernorm is the identity); embed_tokens and
# lm_head come from the target. Shapes as a function of the target config c.
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
# models/llama.py), with architectures naming the EAGLE entry classes.
SGLANG_CONFIG_KEYS = {"architectures", "model_type", "vocab_size", "hidden_size",
                      "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                      "rope_theta", "rope_scaling", "max_position_embeddings",
                      "attention_bias", "tie_word_embeddings"}
# The EAGLE-1 entry classes of each engine's model registry: SGLang's EntryClass of
# llama_eagle.py, and vLLM's _SPECULATIVE_DECODING_MODELS (vllm/model_executor/models/
# registry.py), which it looks up after its EAGLEConfig prefixes "Eagle" to every listed name
# that lacks it (vllm/transformers_utils/configs/eagle.py).
SGLANG_EAGLE1_CLASSES = {"LlamaForCausalLMEagle", "Qwen2ForCausalLMEagle"}
VLLM_EAGLE1_CLASSES = {"EagleLlamaForCausalLM", "EagleLlama4ForCausalLM",
                       "EagleMiniCPMForCausalLM"}


def vllm_eagle1_architectures(listed):
    """vLLM's EAGLEConfig for method "eagle": Eagle{arch} unless arch starts with "Eagle"."""
    return [a if a.startswith("Eagle") else f"Eagle{a}" for a in listed]


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


@pytest.fixture(scope="module")
def reduced(target):
    """A drafter over a reduced draft vocabulary, as `tlt drafter train` trains by default."""
    torch.manual_seed(4)
    return train_drafter(target, steps=40, form="eagle", draft_vocab=len(DRAFT_IDS),
                         draft_to_target=DRAFT_IDS)


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


def assert_files_are_public(folder):
    """Every file of an export folder is rw-r--r--: the server's user reads it."""
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name


@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_export_read_back_drafts_identically(target, drafter, reduced, vocabulary, tmp_path):
    drafter = drafter if vocabulary == "full" else reduced
    folder = export_drafter(drafter, tmp_path / "eagle", "eagle", PROVENANCE)
    assert_files_are_public(folder)
    again = load_export(folder, target)
    assert again.config == drafter.config
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


def test_drafter_flag_takes_saved_folders_and_exports(target, drafter, reduced, tmp_path):
    """load_drafter (what --drafter uses) tells the folders apart by their files."""
    for name, source in (("full", drafter), ("reduced", reduced)):
        source.save(tmp_path / f"saved-{name}")
        exported = export_drafter(source, tmp_path / f"eagle-{name}", "eagle", PROVENANCE)
        for folder in (tmp_path / f"saved-{name}", exported):
            loaded = load_drafter(folder, target)
            assert loaded.config == source.config
            assert all(torch.equal(loaded.state_dict()[k], v)
                       for k, v in source.state_dict().items()), folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="drafter: .*neither drafter_config.json"):
        load_drafter(tmp_path / "empty", target)


def test_eagle_layout_follows_sglang_and_vllm(target, drafter, reduced, tmp_path):
    folder = export_drafter(drafter, tmp_path / "eagle", "eagle", PROVENANCE)
    c = target.config
    tensors = load_file(str(folder / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == \
        {name: shape(c) for name, shape in SGLANG_TENSORS.items()}
    assert not tensors["fc.bias"].any()  # SGLang's fc has a bias; ours is zero
    config = json.loads((folder / "config.json").read_text())
    assert set(config) - {"torch_dtype", "mlp_bias"} == SGLANG_CONFIG_KEYS
    # each engine's registry resolves the first listed name it knows
    assert next(a for a in config["architectures"] if a in SGLANG_EAGLE1_CLASSES) == \
        "LlamaForCausalLMEagle"
    assert next(a for a in vllm_eagle1_architectures(config["architectures"])
                if a in VLLM_EAGLE1_CLASSES) == "EagleLlamaForCausalLM"
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # SGLang swaps in the target's embed and head
    assert (config["hidden_size"], config["vocab_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["rms_norm_eps"], config["rope_theta"]) == \
        (c.hidden_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim,
         c.intermediate_size, c.rms_norm_eps, c.rope_theta)
    assert not (folder / "speculative_token_map.pt").exists()

    # a reduced vocabulary: the same tensors, and SGLang's --speculative-token-map, which its
    # load_token_map reads with torch.load(weights_only=True) as the draft index -> target id list
    folder = export_drafter(reduced, tmp_path / "reduced", "eagle", PROVENANCE)
    tensors = load_file(str(folder / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == \
        {name: shape(c) for name, shape in SGLANG_TENSORS.items()}
    hot = torch.load(folder / "speculative_token_map.pt", weights_only=True)
    assert torch.as_tensor(hot, dtype=torch.int64).tolist() == DRAFT_IDS
    assert read_provenance(folder)["draft_vocab"] == len(DRAFT_IDS)


def test_sglang_token_map_drafts_what_the_drafter_drafts(target, reduced, tmp_path):
    """SGLang's EAGLE worker with a token map: head = target_head[hot_token_id], the draft's
    top-k indices mapped back through hot_token_id. The same tokens as our drafter's."""
    folder = export_drafter(reduced, tmp_path / "eagle", "eagle", PROVENANCE)
    hot = torch.as_tensor(torch.load(folder / "speculative_token_map.pt", weights_only=True))
    torch.manual_seed(2)
    hidden = torch.randn(6, target.config.hidden_size)
    with torch.no_grad():
        sglang_logits = hidden @ target.lm_head.weight[hot].T
        ours = reduced.logits(hidden)
    assert torch.equal(hot[sglang_logits.topk(3).indices],
                       reduced.to_target_ids(ours.topk(3).indices))


def test_speculators_eagle1_exports_are_still_read(target, drafter, tmp_path):
    """Folders in the speculators EAGLE-1 layout (releases before 0.9.0: speculators_model_type
    "eagle", fusion_fc, transformer.*, layernorms false) load as the drafter they hold."""
    folder = export_drafter(drafter, tmp_path / "eagle", "eagle", PROVENANCE)
    layer = json.loads((folder / "config.json").read_text())
    layer.pop("architectures")
    tensors = {name.replace("fc.", "fusion_fc.", 1).replace("layers.0.", "transformer.", 1): t
               for name, t in load_file(str(folder / "model.safetensors")).items()
               if name != "fc.bias"}
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle", "architectures": ["EagleSpeculator"],
        "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": layer,
        "layernorms": False, "fusion_bias": False}))
    save_file(tensors, str(old / "model.safetensors"))
    loaded = load_drafter(old, target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_provenance_is_recorded(target, drafter, tmp_path):
    folder = export_drafter(drafter, tmp_path / "eagle", "eagle", {**PROVENANCE, "note": "x"})
    record = read_provenance(folder)
    assert record["target_sha256"] == target_sha256(target)
    assert (record["rl_step"], record["acceptance_length"], record["note"]) == (12, 2.5, "x")
    assert record["format"] == "eagle" and record["drafter_form"] == "eagle"
    assert record["draft_vocab"] is None
    assert record["tlt_core_version"]
    datetime.datetime.fromisoformat(record["date"])
    assert (folder / "tlt_provenance.json").is_file()


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
    for to in ("eagle3", "speculators"):
        with pytest.raises(ValueError, match=f"EAGLE-1's math, which the {to} layout"):
            export_drafter(drafter, tmp_path / "x", to, PROVENANCE)
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


def test_a_drafter_for_another_vocabulary_is_refused_naming_it(target, drafter, reduced,
                                                               tmp_path):
    """Bad input at the import seam: a drafter trained for a target with another vocabulary,
    in every folder kind --drafter takes, is refused with both vocabulary sizes named."""
    other = tiny_target(vocab=VOCAB + 8)
    drafter.save(tmp_path / "saved")
    folders = [tmp_path / "saved", export_drafter(drafter, tmp_path / "e", "eagle", PROVENANCE)]
    for folder in folders:
        with pytest.raises(ValueError, match=rf"target: .*vocab_size.*{VOCAB}.*{VOCAB + 8}"):
            load_drafter(folder, other)
    # a token map naming ids the target does not have
    folder = export_drafter(reduced, tmp_path / "r", "eagle", PROVENANCE)
    torch.save(torch.tensor(DRAFT_IDS[:-1] + [VOCAB + 3]), folder / "speculative_token_map.pt")
    with pytest.raises(ValueError, match=rf"speculative_token_map.pt: .*vocabulary is {VOCAB}"):
        load_drafter(folder, target)


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.runner(args)


def test_cli_exports_a_saved_drafter_for_a_checkpoint(target, drafter, tmp_path):
    save_checkpoint(target, tmp_path / "target")
    drafter.save(tmp_path / "drafter")
    out = tmp_path / "out"
    assert _cli(["drafter", "--to", "eagle", str(out), "--drafter",
                 str(tmp_path / "drafter"), "--target", str(tmp_path / "target"),
                 "--step", "7", "--acceptance", "3.25"]) == 0
    assert_files_are_public(out)
    record = read_provenance(out)
    assert (record["rl_step"], record["acceptance_length"]) == (7, 3.25)
    assert record["target_name_or_path"] == str(tmp_path / "target")
    reloaded = load_export(out, target)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in drafter.state_dict().items())

    Drafter(target, DrafterConfig(form="tlt")).save(tmp_path / "tlt")  # form "tlt": refused, naming the flag and the fix
    with pytest.raises(SystemExit, match=r"--drafter: .*form='eagle'"):
        _cli(["drafter", "--to", "eagle", str(out), "--drafter", str(tmp_path / "tlt"),
              "--target", str(tmp_path / "target")])
    with pytest.raises(SystemExit, match="--drafter: .*neither drafter_config.json"):
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


def test_export_for_vllm_example_exports_the_embedded_drafter():
    """examples/export_for_vllm.py: the embedded drafter, whole and reduced vocabulary, exported
    and read back with the same rollouts (the example asserts it; restated here)."""
    from tests.test_examples import load_example

    results = load_example("export_for_vllm").main(["--max-tokens", "24"])
    assert set(results) == {"eagle", "eagle-reduced-vocab"}
    assert "speculative_token_map.pt" in results["eagle-reduced-vocab"]["files"]
    for result in results.values():
        assert "EagleLlamaForCausalLM" in result["architectures"]
        assert result["acceptance_length"] > 1.0
        assert any(command.startswith("vllm serve") for command in result["serve"])
