"""Invariant "a trained policy is written as a folder transformers loads with equal logits":
write_policy_folder's folder loads in AutoModelForCausalLM with our logits (float32), in the
policy's dtype, with the token ids in config.json and generation_config.json, and with a
tokenizer that AutoTokenizer loads with equal ids and chat template; bad ids are refused and a
failed write leaves the previous folder."""

import json

import pytest
import torch

from tests.speculative_fixtures import tiny_target
from tlt_core.embedded.workload import load_embedded
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.tokenizer import CheckpointTokenizer
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.outputs.policy_folder import POLICY_RECORD, SpecialTokenIds, write_policy_folder

transformers = pytest.importorskip("transformers")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def our_logits(policy: Transformer, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand(ids.shape)  # (B, T)
    with torch.no_grad():
        return policy(ids, positions).logits  # (B, T, V)


def their_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # (B, T, V)


def trained(policy: Transformer) -> Transformer:
    """policy with every weight moved off its initialisation, as training would."""
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return policy


@pytest.mark.parametrize("which", ["embedded", "tiny_qwen3"])
def test_policy_folder_loads_in_transformers_with_equal_logits(which, tmp_path):
    if which == "embedded":
        policy = trained(load_embedded(with_drafter=False, progress=False).target)
        token_ids = SpecialTokenIds(bos=1, eos=(2,), pad=0)  # the embedded CharTokenizer's
    else:
        torch.manual_seed(0)
        policy = trained(Transformer(ModelConfig(family="qwen3", vocab_size=50, qk_norm=True,
                                                 tie_word_embeddings=True)).eval())
        token_ids = SpecialTokenIds(eos=(3, 4))
    folder = write_policy_folder(policy, tmp_path / "policy", step=12, token_ids=token_ids)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(their_logits(folder, ids), our_logits(policy, ids),
                               rtol=0, atol=1e-5)
    config = json.loads((folder / "config.json").read_text())
    generation = transformers.GenerationConfig.from_pretrained(folder)
    if which == "embedded":
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
        assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
    else:
        assert config["eos_token_id"] == [3, 4] and "bos_token_id" not in config
        assert generation.eos_token_id == [3, 4]
    record = json.loads((folder / POLICY_RECORD).read_text())
    assert record["step"] == 12 and record["tlt_core_version"]
    assert not list(tmp_path.glob(".*"))  # no temporary folder left


def test_weights_are_saved_in_the_policys_dtype(tmp_path):
    policy = tiny_target().to(torch.bfloat16)
    folder = write_policy_folder(policy, tmp_path / "policy")
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_checkpoint(folder, dtype=torch.bfloat16)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert hf.dtype == torch.bfloat16


def test_policy_folder_with_a_real_tokenizer_loads_in_transformers(smollm2_dir, tmp_path):
    """SmolLM2's tokenizer and chat template with a small random policy of its vocabulary."""
    tokenizer = CheckpointTokenizer(smollm2_dir)
    torch.manual_seed(0)
    policy = trained(Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                                             intermediate_size=64)).eval())
    folder = write_policy_folder(policy, tmp_path / "policy", tokenizer=tokenizer, step=3)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = "Hello  world, <|im_start|>user\n héllo 12345<|im_end|>"
    assert theirs.encode(text) == tokenizer.encode(text)
    assert theirs.chat_template == tokenizer.chat_template.source
    assert theirs.apply_chat_template(CHAT, tokenize=True, return_dict=False,
                                      add_generation_prompt=True) == tokenizer.encode_chat(CHAT)
    config = json.loads((folder / "config.json").read_text())
    eos = tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else list(tokenizer.eos_ids)
    assert (config["bos_token_id"], config["eos_token_id"], config.get("pad_token_id")) == \
        (tokenizer.bos_id, eos, tokenizer.pad_id)
    assert CheckpointTokenizer(folder).eos_ids == tokenizer.eos_ids
    ids = torch.tensor([tokenizer.encode_chat(CHAT)])
    torch.testing.assert_close(their_logits(folder, ids), our_logits(policy, ids),
                               rtol=0, atol=1e-5)


def test_bad_arguments_are_named_and_a_failed_write_keeps_the_folder(tmp_path):
    policy = tiny_target()
    with pytest.raises(ValueError, match="token_ids: eos id 99 is outside"):
        write_policy_folder(policy, tmp_path / "p", token_ids=SpecialTokenIds(eos=(99,)))
    with pytest.raises(TypeError, match="policy"):
        write_policy_folder(torch.nn.Linear(2, 2), tmp_path / "p")
    with pytest.raises(ValueError, match="step"):
        write_policy_folder(policy, tmp_path / "p", step=-1)
    assert not (tmp_path / "p").exists()
    folder = write_policy_folder(policy, tmp_path / "p", step=1)

    class BrokenTokenizer:
        def save(self, folder):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_policy_folder(policy, folder, tokenizer=BrokenTokenizer(), step=2,
                            token_ids=SpecialTokenIds())
    assert json.loads((folder / POLICY_RECORD).read_text())["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
