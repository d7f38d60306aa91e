"""Each script in ``examples/`` runs as a user would run it (``python examples/NAME.py``), on the
CPU, offline, and passes its own checks: it exits non-zero when one fails, and prints ``OK`` last."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# What each example imports beyond this library (the "examples" extra of pyproject.toml).
NEEDS = {
    "hf_llama_distill.py": ("transformers",),
    "hf_softcap_logit_scale.py": ("transformers",),
    "flax_nnx_train.py": ("flax", "optax"),
    "trl_gkd_jsd.py": ("transformers", "trl", "datasets"),
}


def test_every_example_is_tested_and_listed_in_the_readme() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(NEEDS)
    readme = (EXAMPLES / "README.md").read_text()
    assert all(name in readme for name in scripts)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_example_runs_and_passes_its_checks(name: str) -> None:
    missing = [m for m in NEEDS[name] if importlib.util.find_spec(m) is None]
    if missing:
        message = f"{name} needs {', '.join(missing)}: pip install -e '.[examples]'"
        if os.environ.get("CI"):  # CI installs the extra: a missing package there is a setup bug
            pytest.fail(message)
        pytest.skip(message)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{output[-6000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "OK", output[-6000:]
