"""The backends of ``torch_kl``, named for the kernel they run: the one registry.

:func:`resolve` turns a ``backend=`` name into a :class:`Backend` value once, at validation;
everything after it (the autograd layer, the chunk driver) runs what that value carries and looks
no name up. ``"auto"`` picks the first backend of ``AUTO_ORDER`` that can run on the inputs'
device. ``"jax"`` is the contract's other name of ``"pallas"``. The bridge (``"pallas"``) lives in
``fused_kl_bridges``, imported only when it is resolved: ``torch_kl`` never imports ``jax_kl``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from fused_kl.backend import Compute, NamedByEntry
from fused_kl.checks import BackendUnavailable, unknown_backend


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
class Registered:
    """A backend by name, before anything of it is imported: what it runs, in words; why it
    cannot run on a device (None if it can); ``build(entry, device)`` imports its kernels and
    makes its :class:`Backend`."""

    name: str
    runs: str
    missing: Callable[[torch.device], str | None]
    build: Callable[[Registered, torch.device], Backend]
    single_device: bool = False


@dataclass(frozen=True)
class Backend(NamedByEntry):
    """A backend resolved: what it runs. A variant is ``dataclasses.replace(backend, ...)``
    (``fused_logits=None`` prices that fusion), passed as ``backend=``.

    ``compute``: the entry that runs it (``torch_kl.driver.forward``, or a bridge);
    ``phases``: the row phases' module the chunk driver runs (None for a bridge);
    ``fused_logits(x, weight, bias, loss, z)``: the logits GEMM with the ``stats`` phase in its
    epilogue (``triton_logits``), None for cuBLAS and the ``stats`` kernel;
    ``plain_logits(x, weight, bias, z)``: the same GEMM with nothing in its epilogue, for a
    teacher head's logits (None: cuBLAS);
    ``factored``: the module for chunks whose ``dL/dz`` is a row scale of the exponentials its
    logits GEMM writes plus a few entries a row (``triton_factored``), or None;
    ``factored_topk``: a top-k teacher's part of such a chunk in one kernel (``triton_topk``),
    for a vocabulary on one device, or None;
    ``scale_grad(grad, g)``: backward's in-place ``grad *= g`` on the device (``rescale``), or
    None for torch's multiply;
    ``add_label_rows(grad_w, x, label)``: the label terms' rows of ``grad_weight`` added once
    after the last chunk (``triton_factored.add_label_rows``; None: ``torch_kl.gemm``'s, which
    reads the labels on the host);
    ``label_apart``: the hard term's label entries kept out of a chunk's ``dL/dz`` where ``finish``
    writes it (``fused_kl.chunk.LabelTerm``; a factored chunk always keeps them apart; False
    prices that);
    ``split_vocab_gemms``: at a vocabulary whose rows are not a multiple of 16 bytes, the cuBLAS
    GEMMs run over its aligned columns and the rest apart (``torch_kl.gemm.vocab_parts``; False
    prices that)."""

    entry: Registered
    compute: Compute
    phases: ModuleType | None = None
    fused_logits: Callable | None = None
    plain_logits: Callable | None = None
    factored: ModuleType | None = None
    factored_topk: Callable | None = None
    scale_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    add_label_rows: Callable | None = None
    label_apart: bool = True
    split_vocab_gemms: bool = True


# Plain import statements, not importlib: torch.compile traces through them.


def _rescale(device: torch.device) -> Callable | None:
    """The Triton ``grad *= g`` where Triton runs on CUDA tensors (it skips a unit ``g`` without
    a host sync), else None."""
    if device.type != "cuda" or _triton_missing(device) is not None:
        return None
    from .rescale import scale_

    return scale_


def _triton(entry: Registered, device: torch.device) -> Backend:
    from ..driver import forward
    from . import triton_factored, triton_logits, triton_phases, triton_topk
    from .rescale import scale_

    return Backend(
        entry,
        forward,
        triton_phases,
        fused_logits=triton_logits.logits_with_stats,
        plain_logits=triton_logits.plain_logits,
        factored=triton_factored,
        factored_topk=triton_topk.topk_part,
        scale_grad=scale_,
        add_label_rows=triton_factored.add_label_rows,
    )


def _torch(entry: Registered, device: torch.device) -> Backend:
    from ..driver import forward
    from . import torch_phases

    return Backend(entry, forward, torch_phases, scale_grad=_rescale(device))


def _pallas(entry: Registered, device: torch.device) -> Backend:
    from fused_kl_bridges.pallas_for_torch import torch_through_pallas

    return Backend(entry, torch_through_pallas, scale_grad=_rescale(device))


REGISTRY = {
    b.name: b
    for b in (
        Registered("triton", "the Triton row kernels, chunked", _triton_missing, _triton),
        Registered("torch", "the same chunked algorithm in plain PyTorch", lambda d: None, _torch),
        Registered(
            "pallas", "jax_kl's Pallas kernels through DLPack, under torch autograd", _jax_missing, _pallas, True
        ),
    )
}
ALIASES = {"jax": "pallas"}
AUTO_ORDER = ("triton", "torch")
NAMES = ("auto", *REGISTRY, *ALIASES)


def check_name(name: object) -> None:
    """Refuse a ``backend=`` value that names no backend (a :class:`Backend` value passes): what
    can be checked before the device is known."""
    if not isinstance(name, Backend) and name not in NAMES:
        raise unknown_backend(name, NAMES)


def resolve(name: object, device: torch.device) -> Backend:
    """The backend a ``backend=`` argument names on ``device``, checked to run there and built
    (a :class:`Backend` value is taken as it is)."""
    if isinstance(name, Backend):
        return name
    check_name(name)
    if name == "auto":
        for candidate in AUTO_ORDER:
            entry = REGISTRY[candidate]
            if (device.type == "cuda" or candidate == "torch") and entry.missing(device) is None:
                return entry.build(entry, device)
    entry = REGISTRY[ALIASES.get(name, name)]  # type: ignore[arg-type]
    if (why := entry.missing(device)) is not None:
        raise BackendUnavailable(str(name), why)
    return entry.build(entry, device)
