"""The backends of ``jax_kl``, named for the kernel they run: the one registry.

``"auto"`` picks the first backend of ``AUTO_ORDER`` that can run here. ``"pallas"`` runs the
Pallas kernels on Mosaic GPU where they can run (Hopper or newer, jax >= 0.11), else lowered
through Triton; ``"pallas_mosaic"`` and ``"pallas_triton"`` force one of the two.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import jax

from fused_kl.checks import backend_unavailable, unknown_backend


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def jax_version() -> tuple[int, int]:
    """JAX's ``(major, minor)``, pre-release suffixes ignored (``0.12rc1`` is ``(0, 12)``)."""
    return tuple(int(re.match(r"\d+", p)[0]) for p in jax.__version__.split(".")[:2])  # type: ignore[return-value,index]


def mosaic_missing() -> str | None:
    """Why the Mosaic GPU kernels cannot run here, or None."""
    if jax_version() < (0, 11):
        return f"Mosaic GPU kernels need jax >= 0.11 (this is {jax.__version__})"
    if not _on_gpu():
        return "Mosaic GPU kernels need an NVIDIA GPU"
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    if float(capability) < 9.0:
        return f"Mosaic GPU kernels need a Hopper or newer GPU (compute capability {capability})"
    return None


def _torch_triton_missing() -> str | None:
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return "it runs torch_kl's Triton kernels, which need torch and triton (pip install 'fused-kl[all]')"
    if not _on_gpu() and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels need a GPU (or TRITON_INTERPRET=1, set before triton is imported)"
    return None


@dataclass(frozen=True)
class Backend:
    """``phases``: module of the row phases the chunk driver runs, or None for a backend that
    brings its own driver (the bridge); ``missing()`` says why it cannot run here, or None;
    ``in_place_grad_weight``: whether it adds each chunk's ``grad_weight`` GEMM into the
    accumulator in place (``mosaic_accumulate``) where that kernel runs."""

    name: str
    runs: str
    missing: Callable[[], str | None]
    phases: str | None
    single_device: bool = False
    in_place_grad_weight: bool = False


REGISTRY = {
    b.name: b
    for b in (
        Backend(
            "pallas",
            "the Pallas row kernels, chunked: on Mosaic GPU where it runs, else lowered through Triton"
            " (interpreted on CPU)",
            lambda: None,
            "pallas_phases",
            in_place_grad_weight=True,
        ),
        Backend(
            "pallas_mosaic",
            "the Pallas row kernels on Mosaic GPU (Hopper or newer, jax >= 0.11), chunked",
            mosaic_missing,
            "pallas_mosaic",
            in_place_grad_weight=True,
        ),
        Backend(
            "pallas_triton",
            "the Pallas row kernels lowered through Triton, chunked (interpreted on CPU)",
            lambda: None,
            "pallas_triton",
        ),
        Backend("xla", "the same chunked algorithm in plain jax.numpy", lambda: None, "xla_phases"),
        Backend(
            "triton",
            "torch_kl's Triton kernels through DLPack, under jax.jit and jax.grad",
            _torch_triton_missing,
            None,
            True,
        ),
    )
}
ALIASES: dict[str, str] = {}
AUTO_ORDER = ("pallas", "xla")
NAMES = ("auto", *REGISTRY, *ALIASES)


def resolve(name: object) -> Backend:
    """The backend a ``backend=`` argument names, checked to run here."""
    if name not in NAMES:
        raise unknown_backend(name, NAMES)
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = REGISTRY[candidate]
            if (_on_gpu() or candidate == "xla") and backend.missing() is None:
                return backend
    backend = REGISTRY[ALIASES.get(name, name)]  # type: ignore[arg-type]
    if (why := backend.missing()) is not None:
        raise backend_unavailable(str(name), why)
    return backend


def phases_of(name: str) -> ModuleType:
    """The row-phase module of a chunked backend, imported when first asked for."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name].phases}")


def xla_folds_the_add() -> bool:
    """Whether ``XLA_FLAGS`` turns XLA's Triton GEMMs off, so that XLA itself folds ``acc + gᵀ x``
    into a cuBLAS GEMM (beta = 1), a few per cent faster than ``mosaic_accumulate`` on the H200
    (benchmarks/RESULTS-2026-12-01.md). Options given to ``jit(..., compiler_options=)`` are not visible here."""
    flags = os.environ.get("XLA_FLAGS", "").lower()
    return bool(re.search(r"--xla_gpu_enable_triton_gemm=(false|0)\b", flags))


def in_place_grad_weight_of(name: str) -> ModuleType | None:
    """The module whose ``accumulate(acc, g, x)`` adds ``gᵀ x`` into ``acc`` in place (where its
    ``fits`` says so), or None where the add is left to XLA: the backend has no such kernel,
    Mosaic GPU cannot run, or XLA folds the add itself (:func:`xla_folds_the_add`)."""
    if not REGISTRY[name].in_place_grad_weight or mosaic_missing() is not None or xla_folds_the_add():
        return None
    try:
        from . import mosaic_accumulate
    except (ImportError, AttributeError):  # a JAX whose Mosaic GPU API moved: XLA's add
        return None
    return mosaic_accumulate


def compute_of(name: str) -> Callable:
    """The function that computes loss and gradients for a backend."""
    if REGISTRY[name].phases is None:
        from .triton_bridge import jax_through_triton

        return jax_through_triton
    from ..driver import forward

    return forward
