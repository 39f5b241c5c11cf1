"""Every Python code block of README.md runs, in order, as a reader would paste them, in an empty directory.

Blocks share one global namespace (a later block may use what an earlier one defined) and run
with the current directory set to a fresh temporary directory, so relative roots such as
./sparkqueue-data start empty. A block preceded by `<!-- not-run -->` is only shown, not run.
Blocks using Spark get the shared test session as the active session.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = "<!-- not-run -->"


@dataclass(frozen=True)
class Block:
    """One fenced python block: its first line number in README.md and its code."""

    line: int
    code: str
    run: bool


def python_blocks(text: str) -> list[Block]:
    """The README's ```python blocks, each flagged not to run when `<!-- not-run -->` is the last thing before it."""
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip()
        line = text.count("\n", 0, m.start()) + 2  # the block's first code line
        blocks.append(Block(line, m.group(1), not before.endswith(NOT_RUN)))
    return blocks


def test_extractor_finds_blocks_and_honours_not_run():
    text = "x\n```python\na = 1\n```\n<!-- not-run -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [Block(3, "a = 1\n", True), Block(7, "b = 2\n", False)]


@pytest.mark.spark  # the Spark section starts (or joins) a local session
def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3, "README.md should show Python examples"
    runnable = [b for b in blocks if b.run]
    assert len(runnable) * 2 > len(blocks), "most README blocks must run: mark only the exceptions <!-- not-run -->"
    if any("spark" in b.code for b in runnable):
        pytest.importorskip("pyspark")
        # the shared session when the Spark tests run in this process; else the README's spark_session() starts one
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.sparkContext.setLogLevel("FATAL")
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "__readme__"}
    for block in runnable:
        try:
            exec(compile(block.code, f"README.md:{block.line}", "exec"), scope)
        except Exception as exc:
            raise AssertionError(f"README.md block at line {block.line} failed: {type(exc).__name__}: {exc}") from exc
    printed = capsys.readouterr().out
    assert "['eu-20', 'us-vip']" in printed  # the topic example's rules select what its comment says
