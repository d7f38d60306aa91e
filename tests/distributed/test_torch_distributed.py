"""torch_kl on several ranks: rows sharded (``batch_group``), vocabulary sharded
(``vocab_group``), both together, the cross-rank checks and ``LinearLossParallel``, on gloo (CPU).

The ranks are started once per session (starting gloo processes is the slow part): two for
``torch_worker.py``, four for the 2 x 2 grid of ``torch_grid_worker.py``; they run every case
and each test reads one case's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spawned import once
from torch_grid_worker import CASES as GRID_CASES
from torch_style_cases import STYLE_CASES
from torch_worker import CASES

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORLD = 2
TIMEOUT_S = 240


def _run_ranks(
    out: Path, script: str = "torch_worker.py", world: int = WORLD, env: dict[str, str] | None = None
) -> list[dict[str, str | None]]:
    """Every case's result on each of ``world`` ranks; ``env`` overrides (the GPU run: NCCL, compiled kernels)."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "tests")]),
        **(env or {}),
    }
    store = out / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / script), str(r), str(world), str(store), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s (a collective out of step?)")
    found = []
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        path = out / f"rank{r}.json"
        if p.returncode != 0 or not path.exists():
            pytest.fail(f"rank {r} exited with {p.returncode}:\n{log[-4000:]}")
        found.append(json.loads(path.read_text()))
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str | None]]:
    return once(tmp_path_factory, "torch_ranks", _run_ranks)  # type: ignore[return-value]


@pytest.mark.parametrize("name", [*CASES, *STYLE_CASES])
def test_case(results: list[dict[str, str | None]], name: str) -> None:
    errors = [f"rank {r}:\n{ranks[name]}" for r, ranks in enumerate(results) if ranks.get(name, "missing") is not None]
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="module")
def grid_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str | None]]:
    run = lambda out: _run_ranks(out, "torch_grid_worker.py", 4)
    return once(tmp_path_factory, "torch_grid", run)  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(GRID_CASES))
def test_grid_case(grid_results: list[dict[str, str | None]], name: str) -> None:
    """Rows and vocabulary sharded together, on four ranks."""
    errors = [f"rank {r}:\n{ranks[name]}" for r, ranks in enumerate(grid_results) if ranks.get(name, "missing")]
    assert not errors, "\n".join(errors)
