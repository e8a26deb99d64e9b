"""EAGLE-3 exports (tlt_core.drafting.export, eagle3_layouts) and the EAGLE-3 imports they meet:
a published EAGLE-3 drafter exported in the SGLang/vLLM/SpecForge layout or speculators' and
read back drafts exactly what it drafted (logits, draft trees, engine rollouts), with a reduced
draft vocabulary and with the whole one; every file is mode 0644; the layouts carry the names,
keys and d2t/t2d semantics vLLM and SGLang read; speculators itself loads the config and the
model, whose forward drafts the same tokens; tied-embedding checkpoints import as each engine
reads them; and `tlt train --drafter` takes an EAGLE-3 drafter."""

import json
import stat

import pytest
import torch
from safetensors.torch import load_file

from tlt_core.drafting.eagle3 import Eagle3Config, Eagle3Drafter
from tlt_core.drafting.export import export_drafter, exportable, load_drafter, read_provenance
from tlt_core.drafting.tree import Strategy, draft_tree
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.checkpoint import save_checkpoint

from tests.speculative_fixtures import PROMPTS, VOCAB
from tests.test_published_drafters import (DRAFT_VOCAB, EAGLE3_LAYER, _edit, _eagle3_tensors,
                                           _eagle3_llama_config, _target, _write, specforge_eagle3)

PROVENANCE = {"rl_step": 3, "acceptance_length": None}
H = 32  # the targets' hidden size

# ---- the layouts' schemas, as data ---------------------------------------------------------------

# Names both engines' registries map to their EAGLE-3 Llama drafter: SGLang's EntryClass of
# python/sglang/srt/models/llama_eagle3.py, and vLLM's _SPECULATIVE_DECODING_MODELS
# (vllm/model_executor/models/registry.py), looked up after its EAGLEConfig keeps a name that
# starts or ends with "Eagle3" (and prefixes "Eagle3" to any other).
SGLANG_EAGLE3_CLASSES = {"LlamaForCausalLMEagle3"}
VLLM_EAGLE3_CLASSES = {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3",
                       "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM"}


def vllm_eagle3_architectures(listed):
    return [a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}"
            for a in listed]


def eagle3_tensor_shapes(c, prefix, draft_vocab, vocab, own_head=True):
    """SGLang llama_eagle3.py / vLLM llama_eagle3.py / SpecForge llama3_eagle.py tensors:
    fc (H, 3H), the first layer's q/k/v over 2H inputs with input_layernorm and hidden_norm,
    norm, lm_head (V', H), d2t (V',) and t2d (V,); speculators' Eagle3DraftModel names the
    layer layers.0, has d2t/t2d only when V' != V and saves embed_tokens."""
    L = EAGLE3_LAYER
    shapes = {"fc.weight": (H, 3 * H),
              f"{prefix}self_attn.q_proj.weight": (L["heads"] * L["head_dim"], 2 * H),
              f"{prefix}self_attn.k_proj.weight": (L["kv_heads"] * L["head_dim"], 2 * H),
              f"{prefix}self_attn.v_proj.weight": (L["kv_heads"] * L["head_dim"], 2 * H),
              f"{prefix}self_attn.o_proj.weight": (H, L["heads"] * L["head_dim"]),
              f"{prefix}mlp.gate_proj.weight": (L["intermediate"], H),
              f"{prefix}mlp.up_proj.weight": (L["intermediate"], H),
              f"{prefix}mlp.down_proj.weight": (H, L["intermediate"]),
              f"{prefix}input_layernorm.weight": (H,), f"{prefix}hidden_norm.weight": (H,),
              f"{prefix}post_attention_layernorm.weight": (H,), "norm.weight": (H,)}
    if own_head:
        shapes["lm_head.weight"] = (draft_vocab, H)
    if prefix == "midlayer." or draft_vocab != vocab:
        shapes.update({"d2t": (draft_vocab,), "t2d": (vocab,)})
    if prefix == "layers.0.":  # speculators keeps its frozen copy of the target's embedding
        shapes["embed_tokens.weight"] = (vocab, H)
    return shapes


# ---- drafters ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deep():
    """Eight layers, RoPE theta 500000, eps 1e-5 (the drafters' own layer differs)."""
    return _target(2, num_layers=8, rope_theta=500000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def reduced(deep, tmp_path_factory):
    """A SpecForge EAGLE-3 drafter over a reduced vocabulary of V' = 24 ids, imported."""
    return load_drafter(specforge_eagle3(tmp_path_factory.mktemp("sf"), deep), deep)


@pytest.fixture(scope="module")
def full(deep, reduced):
    """An EAGLE-3 drafter over the whole vocabulary (V' = V), draft index = token id."""
    torch.manual_seed(5)
    c = reduced.config
    drafter = Eagle3Drafter(deep, Eagle3Config(c.layer, c.feature_layers, VOCAB),
                            torch.arange(VOCAB)).eval()
    with torch.no_grad():  # norms that are not the identity
        for name, tensor in drafter.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    return drafter


def _drafter(which, full, reduced):
    return {"full": full, "reduced": reduced}[which]


def _draft(drafter, strategy):
    """A draft tree and the drafter's logits on fixed inputs."""
    torch.manual_seed(11)
    target = drafter.target
    cache = drafter.new_cache(3, 48)
    tokens = torch.randint(0, target.config.vocab_size, (3, 5))
    hidden = [torch.randn(3, 5, H) for _ in drafter.config.feature_layers]
    with torch.no_grad():
        out = drafter(tokens, drafter.features(hidden), torch.arange(5).expand(3, 5), cache)
        cache.commit(torch.full((3,), 5))
        tree = draft_tree(drafter, cache, tokens[:, -1], out[:, -1], strategy)
        logits = drafter.logits(out)
    return tree, logits


def _assert_same_drafter(drafter, again):
    assert isinstance(again, Eagle3Drafter)
    assert again.config == drafter.config
    assert set(again.state_dict()) == set(drafter.state_dict())
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    for strategy in (Strategy(4, 1, 5), Strategy(3, 3, 8)):
        (tree, logits), (tree_again, logits_again) = _draft(drafter, strategy), \
            _draft(again, strategy)
        assert torch.equal(tree.tokens, tree_again.tokens)
        assert torch.equal(tree.parents, tree_again.parents)
        assert torch.equal(logits, logits_again)


# ---- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("to", ["eagle3", "speculators"])
@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_eagle3_export_read_back_drafts_identically(deep, full, reduced, to, vocabulary,
                                                     tmp_path):
    drafter = _drafter(vocabulary, full, reduced)
    folder = export_drafter(drafter, tmp_path / to, to, PROVENANCE)
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
    again = load_drafter(folder, deep)
    _assert_same_drafter(drafter, again)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in PROMPTS[:3]]
    results = [RolloutEngine(deep, EngineConfig(max_batch=3, max_len=40), d).generate(
        requests, strategy=Strategy(4, 2, 8)) for d in (drafter, again)]
    assert [r.tokens.tolist() for r in results[0].rollouts] == \
        [r.tokens.tolist() for r in results[1].rollouts]
    assert results[0].acceptance_length == results[1].acceptance_length
    record = read_provenance(folder)
    assert (record["format"], record["drafter_form"], record["draft_vocab"]) == \
        (to, "eagle3", drafter.config.draft_vocab)


# ---- the SGLang / vLLM / SpecForge layout --------------------------------------------------------

@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_eagle3_layout_follows_vllm_and_sglang(deep, full, reduced, vocabulary, tmp_path):
    drafter = _drafter(vocabulary, full, reduced)
    V_draft = drafter.config.draft_vocab
    folder = export_drafter(drafter, tmp_path / "e3", "eagle3", PROVENANCE)
    config = json.loads((folder / "config.json").read_text())
    assert next(a for a in config["architectures"] if a in SGLANG_EAGLE3_CLASSES)
    assert next(a for a in vllm_eagle3_architectures(config["architectures"])
                if a in VLLM_EAGLE3_CLASSES)
    L = EAGLE3_LAYER
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"],
            config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"], config["rms_norm_eps"]) == \
        ("llama", 1, H, VOCAB, V_draft, H, L["heads"], L["kv_heads"], L["head_dim"],
         L["intermediate"], L["eps"])
    assert config["rope_theta"] == 10000.0  # the drafter's own RoPE, not the target's 500000
    # SGLang reads eagle_config's ids (it captures the output of layer j), vLLM the top-level
    # ones (the input of layer j): the same layers either way
    outputs = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert outputs == list(drafter.config.feature_layers)
    assert config["eagle_aux_hidden_state_layer_ids"] == [j + 1 for j in outputs]
    tensors = load_file(str(folder / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == \
        eagle3_tensor_shapes(deep.config, "midlayer.", V_draft, VOCAB)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # d2t: target id = draft index + d2t[draft index]; t2d: the ids covered
    assert torch.equal(torch.arange(V_draft) + tensors["d2t"], drafter.draft_to_target)
    assert int(tensors["t2d"].sum()) == V_draft
    assert bool(tensors["t2d"][drafter.draft_to_target].all())

    # vLLM's compute_logits: the draft logits scattered into a (V,) row at arange(V') + d2t,
    # the rest -inf; its argmax is the token our drafter drafts
    torch.manual_seed(3)
    hidden = torch.randn(5, H)
    with torch.no_grad():
        draft_logits = (_rms(hidden, tensors["norm.weight"], config["rms_norm_eps"])
                        @ tensors["lm_head.weight"].T)
        vllm = torch.full((5, VOCAB), float("-inf"))
        vllm[:, torch.arange(V_draft) + tensors["d2t"]] = draft_logits
        ours = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))
    assert torch.equal(vllm.argmax(-1), ours)
    # vLLM's own name for the class reads back the same
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "architectures": ["Eagle3LlamaForCausalLM"]}))
    _assert_same_drafter(drafter, load_drafter(folder, deep))


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# ---- speculators ---------------------------------------------------------------------------------

@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_speculators_loads_the_export(deep, full, reduced, vocabulary, tmp_path):
    """speculators 0.9.0's own classes (pip install --no-deps speculators==0.9.0; see
    scripts/setup.sh) load the config (SpeculatorModelConfig resolves speculators_model_type
    through its registry) and the model with its weights, and Eagle3DraftModel's forward drafts
    the tokens our drafter drafts."""
    pytest.importorskip("speculators")
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    drafter = _drafter(vocabulary, full, reduced)
    save_checkpoint(deep, tmp_path / "target")  # the verifier Eagle3DraftModel loads from
    folder = export_drafter(drafter, tmp_path / "spec", "speculators",
                            {**PROVENANCE, "target_name_or_path": str(tmp_path / "target")},
                            speculative_tokens=3)
    tensors = load_file(str(folder / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == \
        eagle3_tensor_shapes(deep.config, "layers.0.", drafter.config.draft_vocab, VOCAB)

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    assert isinstance(config, Eagle3SpeculatorConfig)
    assert config.draft_vocab_size == drafter.config.draft_vocab
    assert config.eagle_aux_hidden_state_layer_ids == [j + 1 for j in
                                                       drafter.config.feature_layers]
    assert config.norm_before_residual is False
    assert config.transformer_layer_config.model_type == "llama"
    assert config.speculators_config.algorithm == "eagle3"
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 3
    assert config.tlt_provenance["format"] == "speculators"  # extra="allow" keeps it

    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU
    model = Eagle3DraftModel.from_pretrained(str(folder), config=config).eval()
    state = model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["embed_tokens.weight"], deep.model.embed_tokens.weight)

    # its training-time forward, one step: at each position the draft token from
    # (g_t, x_{t+1}); ours over the same pairs
    T, g = 7, torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    hidden = torch.randn(1, T, 3 * H, generator=g)
    with torch.no_grad():
        (theirs,) = model(hidden_states=hidden, input_ids=tokens,
                          document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
        out = drafter(tokens, drafter.features(list(hidden.split(H, -1))), torch.arange(T)[None])
        ours = drafter.logits(out).argmax(-1)
    assert torch.equal(theirs, ours)


# ---- tied embeddings, heads from the target ------------------------------------------------------

def test_tied_specforge_config_with_its_own_head_imports(deep, reduced, tmp_path):
    """SpecForge copies tie_word_embeddings from a tied target (Llama 3.2 1B) into the drafter
    config, where it ties nothing: its lm_head is a draft-vocabulary Linear, which vLLM also
    loads. The checkpoint's head is the drafter's."""
    folder = _edit(specforge_eagle3(tmp_path / "sf", deep), {"tie_word_embeddings": True})
    _assert_same_drafter(reduced, load_drafter(folder, deep))


def test_a_drafter_without_a_head_scores_with_the_targets(deep, tmp_path):
    """No lm_head.weight: SGLang scores with the target's embedding (tie_word_embeddings) or LM
    head (no draft_vocab_size), vLLM with the target's LM head; we read the target's LM head,
    live, where those agree, and refuse where they differ."""
    c = deep.config
    tensors = {k: v for k, v in _eagle3_tensors(c, "midlayer.", 400).items()
               if k not in ("lm_head.weight", "d2t", "t2d")}
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}, "head_dim": 16}
    untied = _write(tmp_path / "untied",
                    _eagle3_llama_config(c, ["LlamaForCausalLMEagle3"], **ids), tensors)
    drafter = load_drafter(untied, deep)
    assert drafter.config.head_from_target and drafter.lm_head is None
    hidden = torch.randn(4, H)
    with torch.no_grad():
        expected = drafter.norm(hidden) @ deep.lm_head.weight.T
        assert torch.allclose(drafter.logits(hidden), expected, atol=1e-5)
    # exported: no head and no draft_vocab_size in the eagle3 layout; speculators (whose
    # Eagle3DraftModel always has a head) gets the target's written as its own
    for to in ("eagle3", "speculators"):
        folder = export_drafter(drafter, tmp_path / to, to, PROVENANCE)
        again = load_drafter(folder, deep)
        with torch.no_grad():
            assert torch.allclose(again.logits(hidden), expected, atol=1e-5), to
    assert "draft_vocab_size" not in json.loads((tmp_path / "eagle3" / "config.json").read_text())

    tied = _write(tmp_path / "tied", _eagle3_llama_config(
        c, ["LlamaForCausalLMEagle3"], draft_vocab_size=VOCAB, tie_word_embeddings=True, **ids),
        tensors)
    with pytest.raises(ValueError, match=r"target: .*SGLang scores with the target's embedding, "
                                         r"vLLM with the target's LM head"):
        load_drafter(tied, deep)  # this target's head is not its embedding
    twin = _target(2, num_layers=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=True)
    twin.tie_weights()
    assert load_drafter(tied, twin).config.head_from_target  # a tied target: they agree
    with pytest.raises(ValueError, match="no lm_head.weight for its draft vocabulary of 24"):
        load_drafter(_edit(tied, {"draft_vocab_size": DRAFT_VOCAB}), deep)


def test_eagle3_refusals_name_the_reason(deep, reduced, tmp_path):
    with pytest.raises(ValueError, match="EAGLE-1 layout cannot hold.*--to eagle3"):
        export_drafter(reduced, tmp_path / "x", "eagle", PROVENANCE)
    c = reduced.config
    two = Eagle3Drafter(deep, Eagle3Config(c.layer, (1, 6), VOCAB), torch.arange(VOCAB))
    assert "fuses 2 target layers" in exportable(two, "eagle3")
    assert exportable(two, "speculators") is None
    residual = Eagle3Drafter(deep, Eagle3Config(c.layer, c.feature_layers, VOCAB, True),
                             torch.arange(VOCAB))
    assert "norm_before_residual" in exportable(residual, "eagle3")
    with pytest.raises(ValueError, match="draft_vocab: .*whole vocabulary"):
        Eagle3Drafter(deep, Eagle3Config(c.layer, c.feature_layers, DRAFT_VOCAB,
                                         head_from_target=True), torch.arange(DRAFT_VOCAB))
    with pytest.raises(ValueError, match="draft_to_target: the target's LM head"):
        Eagle3Drafter(deep, Eagle3Config(c.layer, c.feature_layers, VOCAB,
                                         head_from_target=True), torch.arange(VOCAB).flip(0))


# ---- tlt train --drafter -------------------------------------------------------------------------

def test_train_takes_an_eagle3_drafter(deep, tmp_path):
    """`tlt train --drafter DIR` (checkpoint_inputs, then the RL driver) takes a published
    EAGLE-3 drafter: it drafts in the rollouts and is checkpointed, not spot-trained."""
    from tests.cli_fixtures import save_tokenizer
    from tests.test_train import small, toy_reward
    from tlt_core.adaptive.policy import AdaptivePolicy
    from tlt_core.rl.driver import RLDriver
    from tlt_core.tasks.inputs import checkpoint_inputs

    save_checkpoint(deep, tmp_path / "model")
    save_tokenizer(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in p), "answer": "t1"})
                            + "\n" for p in PROMPTS[:6]))
    folder = export_drafter(load_drafter(specforge_eagle3(tmp_path / "sf", deep), deep),
                            tmp_path / "e3", "eagle3", PROVENANCE)
    inputs = checkpoint_inputs(tmp_path / "model", data, drafter_path=folder,
                               chat_template="none")
    assert isinstance(inputs.drafter, Eagle3Drafter)
    before = {k: v.clone() for k, v in inputs.drafter.state_dict().items()}
    driver = RLDriver(inputs.policy, inputs.prompts, toy_reward, inputs.detokenize,
                      inputs.stop_ids, small(tlt=True, steps=1, prompts_per_step=2,
                                             samples_per_prompt=2, minibatch_size=4),
                      drafter=inputs.drafter)
    assert driver.spot is None
    # SD on at every step, whatever the machine's timing (as tests/test_train.py does)
    driver.adaptive = AdaptivePolicy((Strategy(4, 1, 5),), predict=lambda batch, context,
                                     plan: 1.0 if plan is not None else 1e-9)
    metrics = driver.step()
    # it drafted
    assert metrics["spec/sd_step_share"] > 0 and metrics["spec/acceptance_length"] >= 1.0
    assert all(torch.equal(inputs.drafter.state_dict()[k], v) for k, v in before.items())
    driver.save(tmp_path / "run" / "checkpoints")


def test_cli_and_example_export_a_published_eagle3_drafter(deep, tmp_path, capsys):
    """`tlt export drafter --to eagle3 / speculators --drafter DIR` takes a published EAGLE-3
    drafter; examples/export_for_vllm.py exports it to both and checks the rollouts."""
    import argparse

    from tests.test_examples import load_example
    from tlt_core.cli.export import add_arguments

    save_checkpoint(deep, tmp_path / "target")
    source = specforge_eagle3(tmp_path / "sf", deep)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for to in ("eagle3", "speculators"):
        args = parser.parse_args(["drafter", "--to", to, str(tmp_path / to), "--drafter",
                                  str(source), "--target", str(tmp_path / "target"),
                                  "--acceptance", "2.0"])
        assert args.runner(args) == 0
        _assert_same_drafter(load_drafter(source, deep), load_drafter(tmp_path / to, deep))
    args = parser.parse_args(["drafter", "--to", "eagle", str(tmp_path / "e1"), "--drafter",
                              str(source), "--target", str(tmp_path / "target")])
    with pytest.raises(SystemExit, match="--drafter: .*EAGLE-1 layout cannot hold"):
        args.runner(args)

    results = load_example("export_for_vllm").main(
        ["--drafter", str(source), "--target", str(tmp_path / "target"), "--max-tokens", "12"])
    assert set(results) == {"eagle3", "speculators"}
    assert results["eagle3"]["architectures"] == ["LlamaForCausalLMEagle3"]
