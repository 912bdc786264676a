"""The README's and docs/' Python blocks run as written. Every ```python block runs, each in a
process of its own from the repository root, unless the line before it (blank lines apart) is
`<!-- not run: why -->`: then it is skipped with that reason, and only then."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """Each ```python block of `page`: its first line's number, its code, and why it is not run
    (None: it runs)."""
    blocks = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.name}:{i + 1}: a code block that never ends"
        if fence.group(1) == "python":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(before.strip())
            blocks.append((i + 1, "\n".join(lines[i + 1:end]) + "\n", marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = [(page, line, code, why) for page in PAGES for line, code, why in python_blocks(page)]


def test_every_not_run_marker_precedes_a_python_block():
    """A marker left before prose or another language would hide nothing and mean nothing."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        marked = {line for line, _, why in python_blocks(page) if why is not None}
        for number, text in enumerate(lines, 1):
            if NOT_RUN.match(text.strip()):
                after = next((n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip()), None)
                assert after in marked, f"{page.name}:{number}: a not-run marker with no python block after it"


def test_the_readme_has_blocks_that_run():
    assert any(page.name == "README.md" and why is None for page, _, _, why in BLOCKS)


@pytest.mark.parametrize(
    ("page", "line", "code", "why"), BLOCKS, ids=[f"{page.relative_to(ROOT)}:{line}" for page, line, _, _ in BLOCKS]
)
def test_python_block_runs(page, line, code, why, tmp_path):
    if why is not None:
        pytest.skip(f"marked not run: {why}")
    env = {**os.environ, "P2PSYNC_TOKEN_DIR": str(tmp_path / "tokens"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{page.name}:{line} exited {done.returncode}:\n{done.stderr[-4000:]}"
