"""jax_kl on several devices: ``mesh=`` with global sharded arrays, and the caller's own
``shard_map`` (``check_vma`` True and False), rows, vocabulary and both sharded, on 4 CPU devices.

JAX fixes its device count when it starts, so the cases run once, in a subprocess started
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (``jax_worker.py``); each test
reads one case's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax_worker import CASES
from spawned import once

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TIMEOUT_S = 300


def _run_devices(out: Path, env: dict[str, str] | None = None) -> dict[str, str | None]:
    """Every case's result; ``env`` replaces the CPU settings (the GPU run: real devices, a 2-device mesh)."""
    cpu = {
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip(),
        "JAX_PLATFORMS": "cpu",
        "TRITON_INTERPRET": "1",
    }
    env = {
        **os.environ,
        **(cpu if env is None else env),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "tests")]),
    }
    cmd = [sys.executable, str(HERE / "jax_worker.py"), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the JAX cases did not finish within {TIMEOUT_S} s")
    path = out / "jax.json"
    if proc.returncode != 0 or not path.exists():
        pytest.fail(f"jax_worker.py exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return once(tmp_path_factory, "jax_devices", _run_devices)  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(CASES))
def test_case(results: dict[str, str | None], name: str) -> None:
    error = results.get(name, "missing")
    assert error is None, error
