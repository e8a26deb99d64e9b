"""Prompts -> input ids, as a user's model expects them: through its chat template or as plain
text. One choice for every command (`--chat-template auto|none|FILE`, `--system-prompt`).

- auto: the checkpoint's chat template when it has one (an instruct model: a raw question
  without its template often gets an empty answer), else plain text;
- none: plain text, the tokenizer's own special tokens added (a base model);
- FILE: that Jinja template instead of the checkpoint's.

A prompt is a string (one user message) or, with a template, a list of chat messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tlt_core.model.tokenizer import CheckpointTokenizer

CHAT_TEMPLATE_HELP = ("how prompts become ids: auto (the checkpoint's chat template if it has "
                      "one, else plain text), none (plain text), or a Jinja template FILE")


@dataclass(frozen=True)
class PromptFormat:
    tokenizer: CheckpointTokenizer
    chat: bool  # through the chat template
    system_prompt: str | None = None

    def encode(self, prompt: str | list[dict]) -> list[int]:
        if self.chat:
            return self.tokenizer.encode_chat(prompt, system_prompt=self.system_prompt)
        if not isinstance(prompt, str):
            raise ValueError("prompt: chat messages need a chat template (this prompt format "
                             "is plain text: --chat-template none, or a model without one)")
        return self.tokenizer.encode(prompt)

    def describe(self) -> str:
        if not self.chat:
            return "plain-text prompts"
        system = "" if self.system_prompt is None else ", with a system prompt"
        return f"chat template of {self.tokenizer.chat_template.origin}{system}"


def load_prompt_format(folder: str | Path, chat_template: str | Path = "auto",
                       system_prompt: str | None = None) -> PromptFormat:
    """The checkpoint folder's tokenizer and the prompt format `chat_template` asks for."""
    choice = str(chat_template)
    template_file = None if choice in ("auto", "none") else Path(choice)
    if template_file is not None and not template_file.is_file():
        raise FileNotFoundError(f"chat_template: no template file at {template_file} (or use "
                                "auto / none)")
    tokenizer = CheckpointTokenizer(folder, chat_template_file=template_file)
    chat = choice != "none" and tokenizer.chat_template is not None
    if system_prompt is not None and not chat:
        raise ValueError("system_prompt: needs a chat template (the model has none, or "
                         "--chat-template none was given)")
    return PromptFormat(tokenizer, chat, system_prompt)
