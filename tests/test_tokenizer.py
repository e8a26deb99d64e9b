"""Real checkpoints' tokenizers: one loader (tokenizer.json through the tokenizers library, else
transformers' fast backend) whose ids, special tokens, chat ids and saved files equal
transformers'."""

import json

import pytest

from tlt_core.model.tokenizer import CheckpointTokenizer


def write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "!": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))


def test_checkpoint_tokenizer_round_trips_and_finds_eos(tmp_path):
    write_tokenizer(tmp_path)
    tokenizer = CheckpointTokenizer(tmp_path)
    ids = tokenizer.encode("hello world !")
    assert ids == [2, 3, 4]
    assert tokenizer.decode(ids) == "hello world !"
    assert tokenizer.eos_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    assert CheckpointTokenizer(tmp_path).eos_ids == (1, 4)


def test_checkpoint_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        CheckpointTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: cannot be parsed"):
        CheckpointTokenizer(tmp_path)
    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="ids: 99"):
        CheckpointTokenizer(tmp_path).decode([2, 99])


# ---- one loader: ids, special tokens, eos, chat, save ---------------------------------------


def hf_auto_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
TEXT = "Hello  world, <|im_start|>user\n héllo 12345 \t\tend<|im_end|></s> <mask>!"


def test_special_tokens_the_config_names_are_added_as_transformers_adds_them(tmp_path):
    """A config's special token that tokenizer.json lacks as an added token splits text as in
    transformers, flags (lstrip, rstrip) included, and names the bos / pad / eos ids."""
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "hello", "rstrip": True,
                      "lstrip": False, "normalized": False, "single_word": False},
        "pad_token": "world", "eos_token": "</s>", "extra_special_tokens": ["<new>"]}))
    ours, theirs = CheckpointTokenizer(tmp_path), hf_auto_tokenizer(tmp_path)
    for text in ("hello  world</s>!", "worldhello world <new>", "hello"):
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text),
                                                               skip_special_tokens=True)
    assert (ours.bos_id, ours.pad_id, ours.eos_ids) == (2, 3, (1,))
    assert ours.special_tokens == theirs.special_tokens_map
    assert ours.vocab_size == len(theirs)


def test_smollm2_ids_and_special_tokens_equal_transformers(smollm2_dir):
    ours, theirs = CheckpointTokenizer(smollm2_dir), hf_auto_tokenizer(smollm2_dir)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.special_tokens == theirs.special_tokens_map
    assert (ours.bos_id, ours.pad_id, ours.eos_ids) == (theirs.bos_token_id,
                                                       theirs.pad_token_id, (2,))


def test_folders_without_tokenizer_json_load_through_transformers(smollm2_dir, tmp_path):
    """vocab.json + merges.txt + tokenizer_config.json (no tokenizer.json): transformers' fast
    backend, wrapped the same way, gives the ids tokenizer.json gives."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    reference = CheckpointTokenizer(smollm2_dir)
    backend = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.model.save(str(tmp_path))  # vocab.json, merges.txt
    added = {str(i): t.__getstate__() for i, t in backend.get_added_tokens_decoder().items()}
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="GPT2Tokenizer", added_tokens_decoder=added)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(reference.chat_template.source)
    loaded = CheckpointTokenizer(tmp_path)
    assert loaded.encode(TEXT) == reference.encode(TEXT)
    assert loaded.encode_chat(CHAT) == reference.encode_chat(CHAT)
    assert loaded.eos_ids == reference.eos_ids


def test_eos_ids_add_the_templates_end_of_turn_token(tmp_path):
    """A base model's config lists <|endoftext|>; its template ends turns with <|im_end|>."""
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert CheckpointTokenizer(tmp_path).eos_ids == (1,)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    assert CheckpointTokenizer(tmp_path).eos_ids == (1, 3)
    (tmp_path / "config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    assert CheckpointTokenizer(tmp_path).eos_ids == (2, 3)  # the config's eos, then the turn's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        CheckpointTokenizer(tmp_path)


def test_chat_needs_a_template_and_a_user_file_replaces_it(tmp_path):
    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="conversation: .* has no chat template"):
        CheckpointTokenizer(tmp_path).encode_chat("hello")
    (tmp_path / "user.jinja").write_text("{{ messages[0].content }} {{ eos_token }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tokenizer = CheckpointTokenizer(tmp_path, chat_template_file=tmp_path / "user.jinja")
    assert tokenizer.encode_chat("hello world") == [2, 3, 1]


def test_saved_tokenizer_loads_in_transformers_with_equal_ids_and_template(smollm2_dir,
                                                                         tmp_path):
    ours = CheckpointTokenizer(smollm2_dir)
    ours.save(tmp_path / "policy")
    theirs = hf_auto_tokenizer(tmp_path / "policy")
    assert theirs.chat_template == ours.chat_template.source
    assert theirs.special_tokens_map == ours.special_tokens
    assert theirs.encode(TEXT) == ours.encode(TEXT)
    for add_generation_prompt in (True, False):
        assert theirs.apply_chat_template(CHAT, tokenize=True, return_dict=False,
                                          add_generation_prompt=add_generation_prompt) == \
            ours.encode_chat(CHAT, add_generation_prompt=add_generation_prompt)
    reloaded = CheckpointTokenizer(tmp_path / "policy")
    assert reloaded.encode_chat(CHAT) == ours.encode_chat(CHAT)
    assert reloaded.eos_ids == ours.eos_ids


def test_saving_without_a_template_removes_a_stale_one(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "chat_template.jinja").write_text("stale")
    CheckpointTokenizer(tmp_path).save(tmp_path / "out")
    assert not (tmp_path / "out" / "chat_template.jinja").exists()
    assert CheckpointTokenizer(tmp_path / "out").encode("hello world") == [2, 3]
