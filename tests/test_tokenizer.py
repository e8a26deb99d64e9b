"""Real checkpoints' tokenizers load from tokenizer.json through the tokenizers library."""

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
