"""A tiny local checkpoint for the CLI tests: the speculative fixtures' tiny target saved as a
Hugging Face folder with a word-level tokenizer.json (token `tI` is id I), and its drafter saved
by Drafter.save."""

from pathlib import Path

from tests.speculative_fixtures import VOCAB, tiny_target, train_drafter
from tlt_core.model.checkpoint import save_checkpoint


def word(i: int) -> str:
    return f"t{i}"


def save_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tokenizer = Tokenizer(WordLevel({word(i): i for i in range(vocab)}, unk_token=word(0)))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))


def tiny_checkpoint(root: Path, with_drafter: bool = True) -> tuple[Path, Path | None]:
    """(checkpoint folder, drafter folder or None) under root."""
    target = tiny_target()
    model_folder = root / "model"
    save_checkpoint(target, model_folder)
    save_tokenizer(model_folder)
    if not with_drafter:
        return model_folder, None
    drafter_folder = root / "drafter"
    train_drafter(target).save(drafter_folder)
    return model_folder, drafter_folder
