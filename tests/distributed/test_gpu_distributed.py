"""The distributed checks on real GPUs: the torch cases on NCCL (one process per GPU, the
compiled Triton kernels) and the JAX cases on a GPU mesh (2 x 1 and 1 x 2 on two GPUs), each
against the single-device result on the gathered inputs, as the CPU tests do.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu tests/distributed -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jax_worker import mesh_shape
from test_jax_sharding import _run_devices
from test_torch_distributed import _run_ranks

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()  # NVML: no CUDA context in this process


def _errors(ranks: list[dict[str, str | None]]) -> list[str]:
    return [f"rank {r}, {name}:\n{err}" for r, cases in enumerate(ranks) for name, err in cases.items() if err]


@pytest.mark.parametrize(("script", "world"), [("torch_worker.py", 2), ("torch_grid_worker.py", 4)])
def test_torch_nccl(tmp_path: Path, script: str, world: int) -> None:
    if _gpus() < world:
        pytest.skip(f"{script} needs {world} GPUs, this machine has {_gpus()}")
    ranks = _run_ranks(tmp_path, script, world, env={"FUSED_KL_DIST_DEVICE": "cuda", "TRITON_INTERPRET": "0"})
    assert len(ranks[0]) > 10, f"too few cases ran: {sorted(ranks[0])}"
    errors = _errors(ranks)
    assert not errors, f"{len(errors)} failed:\n" + "\n".join(errors)


@pytest.mark.parametrize("mesh", ["2,1", "1,2", "2,2"])
def test_jax_gpu_mesh(tmp_path: Path, mesh: str) -> None:
    b, v = mesh_shape(mesh)
    size = b * v
    if _gpus() < size:
        pytest.skip(f"a {mesh} mesh needs {size} GPUs, this machine has {_gpus()}")
    # Full float32 GEMMs (not TF32), so the layouts are compared as tightly as on the CPU.
    env = {"FUSED_KL_MESH": mesh, "TRITON_INTERPRET": "0", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}  # fmt: skip
    results = _run_devices(tmp_path, env)
    assert len(results) > 10, f"too few cases ran: {sorted(results)}"
    errors = [f"{name}:\n{err}" for name, err in results.items() if err]
    assert not errors, f"{len(errors)} failed:\n" + "\n".join(errors)
