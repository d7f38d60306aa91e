"""Test modes. ``pytest`` runs the CPU suite on any machine: Triton's interpreter and JAX on
the CPU (Pallas in interpret mode). ``pytest -m gpu`` runs the GPU tests on an NVIDIA GPU, with
the compiled kernels. The mode is fixed here, before any test module imports triton or JAX."""

from __future__ import annotations

import os
import shutil

import pytest


def _gpu_mode(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr and "not gpu" not in expr


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run with -m gpu, on the H200)")
    # torch and JAX share the test process: JAX must not take 75 % of the GPU up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not _gpu_mode(config):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_mode(config) and shutil.which("nvidia-smi") is not None:
        return
    reason = "GPU test: run with -m gpu on a GPU machine" if not _gpu_mode(config) else "needs an NVIDIA GPU"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
