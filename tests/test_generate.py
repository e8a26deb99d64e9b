"""`tlt generate`, run in-process: lossless greedy (the same text with and without SD) from a
local checkpoint, batch inputs from flags and files, interactive mode on the embedded-model path,
and bad input reported by flag."""

import io
import json

import pytest

from tests.cli_fixtures import tiny_checkpoint, word
from tlt_core.cli import main

PROMPTS = [" ".join(word(i) for i in ids) for ids in ([1, 2, 3], [5, 6, 7, 8, 9], [4], [20, 21])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("generate"))


def run_json(capsys, argv):
    """(records, summaries) of `tlt generate --json ...`."""
    assert main(["generate", "--json", "--no-progress"] + argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return ([line for line in lines if "summary" not in line],
            [line["summary"] for line in lines if "summary" in line])


def test_greedy_text_is_the_same_with_and_without_sd(checkpoint, capsys):
    model, drafter = checkpoint
    argv = ["--model", str(model), "--drafter", str(drafter), "--max-tokens", "24",
            "--max-batch", "2"] + [arg for p in PROMPTS for arg in ("--prompt", p)]
    with_sd, (sd_summary,) = run_json(capsys, argv)
    plain, (plain_summary,) = run_json(capsys, argv + ["--no-sd"])
    assert [r["token_ids"] for r in with_sd] == [r["token_ids"] for r in plain]
    assert [r["response"] for r in with_sd] == [r["response"] for r in plain]
    assert [r["prompt"] for r in with_sd] == PROMPTS
    assert all(r["num_tokens"] == 24 and r["finish_reason"] == "length" for r in with_sd)
    # SD ran and was measured: fewer steps than tokens, acceptance from the engine's stats
    assert sd_summary["strategy"] == "(6,1,7)" and sd_summary["speculative_steps"] > 0
    assert sd_summary["acceptance_length"] > 1.0
    assert sd_summary["decode_steps"] < plain_summary["decode_steps"]
    assert plain_summary["strategy"] is None and plain_summary["acceptance_length"] is None


def test_tree_strategy_and_prompt_files_give_the_same_text(checkpoint, capsys, tmp_path):
    model, drafter = checkpoint
    common = ["--model", str(model), "--drafter", str(drafter), "--max-tokens", "12"]
    flags, _ = run_json(capsys, common + [arg for p in PROMPTS for arg in ("--prompt", p)])
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROMPTS))
    text = tmp_path / "prompts.txt"
    text.write_text("\n".join(PROMPTS[:2]) + "\n\n" + "\n".join(PROMPTS[2:]) + "\n")
    tree, (summary,) = run_json(capsys, common + ["--prompts", str(jsonl), "--draft-depth", "3",
                                                  "--draft-topk", "3", "--num-verify-tokens",
                                                  "8"])
    lines, _ = run_json(capsys, common + ["--prompts", str(text)])
    assert summary["strategy"] == "(3,3,8)"
    assert [r["token_ids"] for r in tree] == [r["token_ids"] for r in flags]
    assert [r["token_ids"] for r in lines] == [r["token_ids"] for r in flags]


def test_text_output_and_a_config_file(checkpoint, capsys, tmp_path):
    model, drafter = checkpoint
    config = tmp_path / "generate.toml"
    config.write_text(f'model = "{model}"\ndrafter = "{drafter}"\nmax_tokens = 5\n'
                      f'prompt = ["{PROMPTS[0]}", "{PROMPTS[1]}"]\n')
    assert main(["generate", "--config", str(config), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"--- 0: {PROMPTS[0]}" and lines[2] == f"--- 1: {PROMPTS[1]}"
    assert len(lines[1].split()) == 5  # five generated words
    assert "2 prompt(s), 10 tokens" in err and "acceptance length" in err
    # a flag overrides the file's prompt list
    assert main(["generate", "--config", str(config), "--prompt", PROMPTS[2], "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records if "prompt" in r] == [PROMPTS[2]]


def test_interactive_mode_answers_each_line_with_the_embedded_model(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("37+04\n\n12!04\n12-03\n"))
    assert main(["generate", "--interactive", "--json", "--max-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    records = [line for line in lines if "prompt" in line]
    assert [r["prompt"] for r in records] == ["37+04", "12-03"]
    assert [r["index"] for r in records] == [0, 1]
    assert sum("summary" in line for line in lines) == 2  # one per prompt
    assert "prompt 1: text: character '!'" in err  # the bad line is reported and skipped
    assert all(set(r["response"]) <= set("0123456789+-=;#?<>bdeopsa") for r in records)


def test_no_prompts_and_bad_flags_are_reported(checkpoint, monkeypatch, tmp_path):
    import shutil

    model, drafter = checkpoint
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal
    with pytest.raises(SystemExit, match="--prompt TEXT, --prompts FILE, or --interactive"):
        main(["generate", "--model", str(model)])
    with pytest.raises(SystemExit, match="--top-p"):
        main(["generate", "--top-p", "1.5", "--prompt", "x"])
    with pytest.raises(SystemExit, match="--draft-topk"):
        main(["generate", "--draft-topk", "0", "--prompt", "x"])
    with pytest.raises(SystemExit, match="--min-tokens"):
        main(["generate", "--min-tokens", "9", "--max-tokens", "8", "--prompt", "x"])
    with pytest.raises(SystemExit, match="not both"):
        main(["generate", "--interactive", "--prompt", "x"])
    with pytest.raises(SystemExit, match="config.json"):  # a drafter is not a checkpoint
        main(["generate", "--model", str(drafter), "--prompt", "x"])
    bare = tmp_path / "bare"
    shutil.copytree(model, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(SystemExit, match="tokenizer.json: not found"):
        main(["generate", "--model", str(bare), "--prompt", "x"])


def test_live_line_reports_measured_acceptance(checkpoint):
    """The observe hook's live line: tokens, tokens/s and the running acceptance length."""
    from tlt_core.cli.generate import GenerateConfig, checkpoint_text_model, generate
    from tlt_core.model.placement import resolve_placement

    model, drafter = checkpoint
    text_model = checkpoint_text_model(model, drafter, True, resolve_placement("cpu", "float32"))
    live = io.StringIO()
    records, summary = generate(text_model, PROMPTS[:1], GenerateConfig(max_tokens=8), live=live)
    line = live.getvalue()
    assert "tok/s" in line and "acceptance" in line and "acceptance -" not in line
    assert summary["tokens"] == 8 == records[0]["num_tokens"]
