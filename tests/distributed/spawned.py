"""Run a subprocess's checks once per test session, even under pytest-xdist.

Each xdist worker imports the test module; the first to get here runs ``produce`` and leaves
its results in the session's shared temporary directory, the others wait for them and read.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def once(tmp_path_factory: pytest.TempPathFactory, name: str, produce: Callable[[Path], object]) -> object:
    """``produce(folder)``'s JSON-able result, computed by one process of the session."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the session's workers
    cached = base / f"{name}.json"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.exists():
            return json.loads(cached.read_text())
        folder = base / name
        folder.mkdir(exist_ok=True)
        result = produce(folder)
        cached.write_text(json.dumps(result))
        return result
