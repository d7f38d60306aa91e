"""Test setup: CPU runs use Triton's interpreter and Pallas interpret mode; GPU tests are
marked ``gpu`` and skipped where no GPU is present."""

import os
import shutil

# Both must be set before triton / JAX are imported anywhere.
HAS_GPU = shutil.which("nvidia-smi") is not None and os.environ.get("FUSED_KL_FORCE_CPU") != "1"
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run on the H200)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
