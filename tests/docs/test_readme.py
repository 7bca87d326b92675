"""The README's first Python example runs as written (the shipped pair, on this machine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert match is not None, "README.md has no ```python block"
    return match.group(1)


def test_first_python_block_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    code = first_python_block(README.read_text(encoding="utf-8"))
    assert "builtin_pair()" in code and "blockdraft.generate(" in code
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    text, _, stats = capsys.readouterr().out.rstrip("\n").rpartition("\n")
    assert text.startswith("def fibonacci(n):") and len(text.strip()) > len("def fibonacci(n):"), text
    assert re.fullmatch(r"tau \d+\.\d\d  \d+\.\d tok/s", stats), stats
