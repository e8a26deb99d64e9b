"""Chat templates render exactly as transformers' `apply_chat_template` renders them — text and
token ids, on SmolLM2's real tokenizer and on Qwen2.5- and Llama-3-style templates
(tests/data/chat_templates) — and a template cannot run code or fail silently."""

import json
from pathlib import Path

import jinja2
import pytest

from tlt_core.model.chat_template import ChatTemplate, ChatTemplateError
from tlt_core.model.tokenizer import CheckpointTokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is 7 * 6?"}
ASSISTANT = {"role": "assistant", "content": "42."}
FOLLOW_UP = {"role": "user", "content": "And 6 * 9? Answer in <b>bold</b>, café-style."}
CONVERSATIONS = {
    "one user turn": [USER],
    "with a system message": [SYSTEM, USER],
    "multi-turn": [USER, ASSISTANT, FOLLOW_UP],
    "multi-turn with a system message": [SYSTEM, USER, ASSISTANT, FOLLOW_UP],
}
TOOL_CALL = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function",
                             "function": {"name": "multiply", "arguments": {"a": 7, "b": 6}}}]}
TOOL_TURNS = [SYSTEM, USER, TOOL_CALL, {"role": "tool", "content": "42"},
              {"role": "tool", "content": '{"unit": "none"}'}, ASSISTANT, FOLLOW_UP]
QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def hf_tokenizer(tmp_path, template: str, special_tokens: dict):
    """transformers' fast tokenizer over a tiny vocabulary, with `template` and the tokens."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                chat_template=template, **special_tokens)


def hf_render(tokenizer, messages, add_generation_prompt, **template_vars) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_vars)


# ---- equal to transformers ----------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smollm2_chat_text_and_ids_equal_transformers(smollm2_dir, conversation,
                                                      add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    ours = CheckpointTokenizer(smollm2_dir)
    messages = CONVERSATIONS[conversation]
    assert ours.chat_template.render(messages, add_generation_prompt=add_generation_prompt) == \
        hf_render(theirs, messages, add_generation_prompt)
    expected_ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=add_generation_prompt)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_smollm2_system_prompt_and_plain_text_prompts(smollm2_dir):
    """system_prompt is a system message put first; a str is one user turn."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    ours = CheckpointTokenizer(smollm2_dir)
    expected = theirs.apply_chat_template([SYSTEM, USER], tokenize=True, return_dict=False,
                                          add_generation_prompt=True)
    assert ours.encode_chat([USER], system_prompt=SYSTEM["content"]) == expected
    assert ours.encode_chat(USER["content"], system_prompt=SYSTEM["content"]) == expected
    # A conversation that has its own system message keeps it.
    assert ours.encode_chat([SYSTEM, USER], system_prompt="ignored") == expected
    assert ours.encode_chat(USER["content"]) == theirs.apply_chat_template(
        [USER], tokenize=True, return_dict=False, add_generation_prompt=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", [*CONVERSATIONS, "tool calls"])
@pytest.mark.parametrize("name, special_tokens", [("qwen2.5", QWEN_TOKENS),
                                                  ("llama3", LLAMA_TOKENS)])
def test_model_style_templates_render_as_transformers(tmp_path, name, special_tokens,
                                                      conversation, add_generation_prompt):
    template = ChatTemplate.from_file(TEMPLATES / f"{name}.jinja", special_tokens)
    theirs = hf_tokenizer(tmp_path, template.source, special_tokens)
    messages = TOOL_TURNS if conversation == "tool calls" else CONVERSATIONS[conversation]
    # strftime_now: both read the clock within the same second, so the dates agree.
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == \
        hf_render(theirs, messages, add_generation_prompt)


def test_model_style_templates_write_their_formats():
    """The test data are the formats they claim: Qwen's default system prompt, Llama's bos,
    headers and date line (date_string given, as transformers' kwargs give it)."""
    qwen = ChatTemplate.from_file(TEMPLATES / "qwen2.5.jinja", QWEN_TOKENS)
    assert qwen.render([USER]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nWhat is 7 * 6?<|im_end|>\n"
        "<|im_start|>assistant\n")
    llama = ChatTemplate.from_file(TEMPLATES / "llama3.jinja", LLAMA_TOKENS)
    assert llama.render([SYSTEM, USER], template_vars={"date_string": "26 Jul 2024"}) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is 7 * 6?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert qwen.end_of_turn_tokens == ("<|im_end|>",)
    assert llama.end_of_turn_tokens == ("<|eot_id|>",)


FEATURES = """{# every environment feature transformers sets up #}
{% set ns = namespace(turns=0) %}
{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'skip' %}{% continue %}{% endif %}
    {% if ns.turns == 3 %}{% break %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% generation %}[{{ message.role }}|{{ message.content }}]{% endgeneration %}
    {% if message.thinking is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
    {{ message | tojson(sort_keys=True) }}
    {% if message.meta %}{{ message.meta | tojson(indent=2) }}{% endif %}
{% endfor %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}
{{ image_token }}/{{ eos_token }}/{{ enable_thinking }}/{{ strftime_now('%Y-%m-%d') }}
{{ tools is none }}/{{ documents is none }}/{{ add_generation_prompt }}
"""


def test_environment_features_render_as_transformers(tmp_path):
    special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<image>"}
    template = ChatTemplate(FEATURES, special_tokens)
    theirs = hf_tokenizer(tmp_path, FEATURES, {**special_tokens, "extra_special_tokens":
                                               {"image_token": "<image>"}})
    messages = [{"role": "user", "content": "héllo <b>&</b>", "meta": {"é": [1, 2.5, None]}},
                {"role": "skip", "content": "dropped by continue"},
                {"role": "assistant", "content": "ok", "reasoning": "because", "name": None},
                {"role": "user", "content": "two"}, {"role": "user", "content": "past break"}]
    for add_generation_prompt in (True, False):
        ours = template.render(messages, add_generation_prompt=add_generation_prompt,
                               template_vars={"enable_thinking": False})
        assert ours == hf_render(theirs, messages, add_generation_prompt, enable_thinking=False)
    assert "past break" not in ours and "dropped" not in ours and "<think>because" in ours


# ---- where templates come from --------------------------------------------------------------


def write_config(folder, **fields):
    (folder / "tokenizer_config.json").write_text(json.dumps(fields))


def test_folder_template_order_and_special_tokens(tmp_path):
    assert ChatTemplate.from_folder(tmp_path) is None
    write_config(tmp_path, chat_template="config {{ eos_token }}",
                 eos_token={"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False},
                 bos_token=None, add_bos_token=True, image_token="<image>")
    template = ChatTemplate.from_folder(tmp_path)
    assert template.render([USER]) == "config <|im_end|>"
    assert template.special_tokens == {"eos_token": "<|im_end|>", "image_token": "<image>"}
    (tmp_path / "chat_template.jinja").write_text("file {{ messages[0].content }}")
    assert ChatTemplate.from_folder(tmp_path).render([USER]) == "file What is 7 * 6?"


def test_config_template_lists_use_the_default(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "tools"},
                                          {"name": "default", "template": "default"}])
    assert ChatTemplate.from_folder(tmp_path).render([USER]) == "default"
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "tools"}])
    with pytest.raises(ChatTemplateError, match=r"\['tool_use'\] but no 'default'"):
        ChatTemplate.from_folder(tmp_path)
    write_config(tmp_path, chat_template=3)
    with pytest.raises(ChatTemplateError, match="expected a str or a list"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: cannot be parsed"):
        ChatTemplate.from_folder(tmp_path)


def test_template_files_and_arguments_are_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match="path: no chat template file"):
        ChatTemplate.from_file(tmp_path / "missing.jinja", {})
    with pytest.raises(FileNotFoundError, match="folder: .* is not a directory"):
        ChatTemplate.from_folder(tmp_path / "missing")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="broken.jinja: not a valid jinja template"):
        ChatTemplate.from_file(tmp_path / "broken.jinja", {})
    with pytest.raises(TypeError, match="special_tokens"):
        ChatTemplate("x", {"eos_token": 2})


# ---- bad input and hostile templates ------------------------------------------------------


def test_raise_exception_is_a_clear_error():
    qwen = ChatTemplate.from_file(TEMPLATES / "qwen2.5.jinja", QWEN_TOKENS)
    with pytest.raises(ChatTemplateError, match="refused the messages: Unknown role: critic"):
        qwen.render([USER, {"role": "critic", "content": "no"}])
    llama = ChatTemplate.from_file(TEMPLATES / "llama3.jinja", LLAMA_TOKENS)
    two_calls = {**TOOL_CALL, "tool_calls": TOOL_CALL["tool_calls"] * 2}
    with pytest.raises(ValueError, match="only supports single tool-calls"):
        llama.render([USER, two_calls])


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ namespace(_private=1) }}",
])
def test_templates_cannot_escape_the_sandbox(attack):
    with pytest.raises(ChatTemplateError, match="sandbox forbids") as caught:
        ChatTemplate(attack, {}).render([USER])
    assert isinstance(caught.value.__cause__, jinja2.exceptions.SecurityError)


def test_printing_an_internal_prints_nothing():
    """The sandbox makes an unsafe attribute undefined: printed, it is empty; used, an error."""
    assert ChatTemplate("{{ messages.__class__ }}", {}).render([USER]) == ""


def test_runtime_failures_name_the_template():
    with pytest.raises(ChatTemplateError, match=r"my.jinja: rendering failed \(TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}", {}, origin="my.jinja").render([USER])


@pytest.mark.parametrize("messages, error, match", [
    ("hello", TypeError, "messages: expected a list"),
    ([], ValueError, "messages: empty"),
    ([USER, "hi"], TypeError, r"messages\[1\]: expected a dict"),
    ([{"role": "user"}], ValueError, r"messages\[0\]: needs a str 'content'"),
    ([{"role": "user", "content": None}], ValueError, r"messages\[0\]: needs a str 'content'"),
    ([{"role": 1, "content": "x"}], ValueError, r"messages\[0\]: needs a str 'role'"),
    ([{**USER, "meta": {"f": object()}}], TypeError, r"messages\[0\]\['meta'\]\['f'\]: object"),
])
def test_bad_messages_are_named(messages, error, match):
    with pytest.raises(error, match=match):
        ChatTemplate("x", {}).render(messages)


def test_bad_render_arguments_are_named():
    template = ChatTemplate("x", {})
    with pytest.raises(TypeError, match="system_prompt"):
        template.render([USER], system_prompt=["no"])
    with pytest.raises(TypeError, match="add_generation_prompt"):
        template.render([USER], add_generation_prompt="yes")
    with pytest.raises(ValueError, match="template_vars: 'messages' cannot be set"):
        template.render([USER], template_vars={"messages": []})


def test_render_leaves_the_callers_messages_alone():
    messages = [{"role": "user", "content": "hi", "reasoning": "r", "name": None}]
    before = json.dumps(messages)
    ChatTemplate("{{ messages | tojson }}", {}).render(messages, system_prompt="s")
    assert json.dumps(messages) == before
