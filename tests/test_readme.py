"""The README is a user's guide that stays true: every Python snippet in it runs as written,
each in a fresh process (as a user would paste it), and the guide keeps its shape."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_the_three_snippets():
    assert len(SNIPPETS) == 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=["ops", "engine", "grpo"])
def test_a_snippet_runs_as_written(index, tmp_path):
    result = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_readme_opens_with_the_two_set_up_commands_and_stays_short():
    text = README.read_text()
    first_block = re.search(r"```shell\n(.*?)```", text, flags=re.S).group(1)
    assert first_block.strip().splitlines() == ["bash scripts/setup.sh && tlt train",
                                                "bash scripts/setup.sh && python -m pytest"]
    assert text.index("```shell") < text.index("## "), "the set-up commands come first"
    assert len(text.splitlines()) <= 300


def test_docs_speak_of_the_software_not_its_history():
    """No issue numbers, no links outside the repository, in the README and the docs."""
    for path in [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]:
        text = path.read_text()
        assert not re.search(r"\bissues? #?\d+", text, flags=re.I), path
        assert "../shared" not in text and "](../" not in text, path
