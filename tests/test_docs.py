"""The docs' code runs: every ```python block of each doc page is executed, in order, in one
namespace per page, so the documentation cannot drift from the API.

Each page runs in its own subprocess: pages register allocators and backends, and the backend
registry has no unregister, so a fresh interpreter per page keeps this process's registries
clean and lets a page register a backend id once without clashing with another run.

Mark a block that must not run (it needs a GPU, say) with ```python no-run; it is still
compiled, so a syntax error in it fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["docs/concepts.md", "docs/new-device.md", "docs/distributed.md"]

_FENCE = re.compile(r"^```(\S*)(.*)$")


def code_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, source, runs) of every ```python block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        lang, rest = m.group(1), m.group(2).split()
        start, i = i + 1, i + 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start}: code block never closed")
        if lang == "python":
            blocks.append((start + 1, "\n".join(lines[start:i]) + "\n", "no-run" not in rest))
        i += 1
    return blocks


def run_page(path: Path) -> None:
    """Execute the page's runnable blocks in one namespace (used by the subprocess)."""
    namespace: dict = {"__name__": "__doc__"}
    for line, source, runs in code_blocks(path.read_text()):
        # pad with blank lines so tracebacks show the line number in the .md file
        code = compile("\n" * (line - 1) + source, str(path), "exec")
        if runs:
            exec(code, namespace)


@pytest.mark.parametrize("doc", DOCS)
def test_doc_has_runnable_code(doc):
    blocks = code_blocks((ROOT / doc).read_text())
    assert any(runs for _, _, runs in blocks), f"{doc} has no runnable ```python block"
    for line, source, _ in blocks:  # no-run blocks must at least be valid Python
        compile("\n" * (line - 1) + source, doc, "exec")


def test_readme_code_is_valid_python():
    """The README's blocks need GPUs to run; they must at least compile."""
    blocks = code_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 3
    for line, source, _ in blocks:
        compile("\n" * (line - 1) + source, "README.md", "exec")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_runs(doc):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, str(ROOT / doc)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{doc} failed:\n{proc.stdout}\n{proc.stderr}"


def test_code_blocks_parser():
    text = "x\n```python\na = 1\n```\n```python no-run\nb\n```\n```bash\nls\n```\n```\nplain\n```\n"
    assert code_blocks(text) == [(3, "a = 1\n", True), (6, "b\n", False)]


if __name__ == "__main__":
    run_page(Path(sys.argv[1]))
