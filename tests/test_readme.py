"""The README's code runs as printed: its PyTorch and JAX examples run in a fresh process, from outside
the repository, on the CPU; every other Python block of it at least compiles."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUN = ("PyTorch", "JAX")  # the sections whose examples must run as they stand


def _python_blocks() -> dict[str, list[str]]:
    """The ```python blocks of the README, by the ``## `` section they are in."""
    blocks: dict[str, list[str]] = {}
    for section in re.split(r"^## ", README, flags=re.MULTILINE)[1:]:
        title = section.splitlines()[0].strip()
        blocks[title] = re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    return blocks


def test_readme_has_one_example_in_each_framework_section() -> None:
    blocks = _python_blocks()
    assert all(len(blocks.get(title, [])) == 1 for title in RUN), {t: len(b) for t, b in blocks.items()}


@pytest.mark.parametrize("title", RUN)
def test_readme_example_runs_as_printed(title: str, tmp_path: Path) -> None:
    (code,) = _python_blocks()[title]
    script = tmp_path / "example.py"
    script.write_text(code + "\nprint('loss', float(loss))\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    loss = float(proc.stdout.split()[-1])
    assert math.isfinite(loss) and loss > 0, proc.stdout  # a KL plus a cross-entropy


def test_every_other_python_block_compiles() -> None:
    others = [(t, code) for t, codes in _python_blocks().items() if t not in RUN for code in codes]
    assert others, "the integrations section shows code"
    for title, code in others:
        compile(code, f"README.md ({title})", "exec")
