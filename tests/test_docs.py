"""The examples in README.md and docs/ run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_examples_run(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for block in _python_blocks(path):
        exec(compile(block, str(path), "exec"), {})


def test_readme_example_prints_what_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_python_blocks(ROOT / "README.md")[0], "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "[0, -1, -1]"
    assert out[2] == "torch.Size([1, 64])"
    assert out[4] == "sequence_too_long"
