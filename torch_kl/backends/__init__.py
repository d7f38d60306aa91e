"""The backends of ``torch_kl``, named for the kernel they run: the one registry.

``"auto"`` picks the first backend of ``AUTO_ORDER`` that can run on the inputs' device.
``"jax"`` (the name of ``"pallas"`` before it was named for its kernel) is kept as an alias.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from fused_kl.checks import backend_unavailable, unknown_backend


def _triton_missing(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernel needs CUDA tensors, got {device.type} (or set TRITON_INTERPRET=1 to interpret it)"
    return None


def _jax_missing(device: torch.device) -> str | None:
    del device
    try:
        import jax  # noqa: F401
    except ImportError:
        return "JAX is not installed (pip install 'fused-kl[jax]')"
    return None


@dataclass(frozen=True)
class Backend:
    """``phases``: module of the row phases the chunk driver runs, or None for a backend that
    brings its own driver (the bridge); ``missing(device)`` says why it cannot run, or None;
    ``fused_logits``: whether it has a logits GEMM that makes the ``stats`` phase on the way;
    ``factored``: whether that GEMM also writes ``dL/dz`` factored where it can (the
    cross-entropy, top-k teachers: ``triton_factored``)."""

    name: str
    runs: str
    missing: Callable[[torch.device], str | None]
    phases: str | None
    single_device: bool = False
    fused_logits: bool = False
    factored: bool = False


REGISTRY = {
    b.name: b
    for b in (
        Backend(
            "triton",
            "the Triton row kernels, chunked",
            _triton_missing,
            "triton_phases",
            fused_logits=True,
            factored=True,
        ),
        Backend("torch", "the same chunked algorithm in plain PyTorch", lambda d: None, "torch_phases"),
        Backend("pallas", "jax_kl's Pallas kernels through DLPack, under torch autograd", _jax_missing, None, True),
    )
}
ALIASES = {"jax": "pallas"}
AUTO_ORDER = ("triton", "torch")
NAMES = ("auto", *REGISTRY, *ALIASES)


def resolve(name: object, device: torch.device) -> Backend:
    """The backend a ``backend=`` argument names on ``device``, checked to run there."""
    if name not in NAMES:
        raise unknown_backend(name, NAMES)
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = REGISTRY[candidate]
            if (device.type == "cuda" or candidate == "torch") and backend.missing(device) is None:
                return backend
    backend = REGISTRY[ALIASES.get(name, name)]  # type: ignore[arg-type]
    if (why := backend.missing(device)) is not None:
        raise backend_unavailable(str(name), why)
    return backend


def _triton_phases() -> ModuleType:
    from . import triton_phases

    return triton_phases


def _torch_phases() -> ModuleType:
    from . import torch_phases

    return torch_phases


# Plain import statements, not importlib: torch.compile traces through them.
_PHASES = {"triton_phases": _triton_phases, "torch_phases": _torch_phases}


def phases_of(name: str) -> ModuleType:
    """The row-phase module of a chunked backend, imported when first asked for."""
    return _PHASES[REGISTRY[name].phases]()  # type: ignore[index]


def fused_logits_of(name: str) -> Callable | None:
    """The backend's logits GEMM with the ``stats`` phase in its epilogue, if it has one."""
    if not REGISTRY[name].fused_logits:
        return None
    from .triton_logits import logits_with_stats

    return logits_with_stats


def plain_logits_of(name: str) -> Callable | None:
    """The backend's logits GEMM with nothing in its epilogue (a teacher head's), if it has one."""
    if not REGISTRY[name].fused_logits:
        return None
    from .triton_logits import plain_logits

    return plain_logits


def factored_of(name: str) -> ModuleType | None:
    """The backend's module for chunks whose ``dL/dz`` is a row scale of the exponentials its
    logits GEMM writes plus a few entries a row (``triton_factored``), if it has one."""
    if not (REGISTRY[name].fused_logits and REGISTRY[name].factored):
        return None
    from . import triton_factored

    return triton_factored


def compute_of(name: str) -> Callable:
    """The function that computes loss and gradients for a backend."""
    if REGISTRY[name].phases is None:
        from .pallas_bridge import torch_through_pallas

        return torch_through_pallas
    from ..driver import forward

    return forward
