"""The backends of ``jax_kl``, named for the kernel they run: the one registry (mirror of
``torch_kl/backends``).

:func:`resolve` turns a ``backend=`` name into a :class:`Backend` value once, at validation;
everything after it (``custom_vjp``, the sharding, the chunk driver) runs what that value carries
and looks no name up. ``"auto"`` picks the first backend of ``AUTO_ORDER`` that can run here.
``"pallas"`` runs the Pallas kernels on Mosaic GPU where they can run (Hopper or newer,
jax >= 0.11); a chunk the TMA cannot move there (:meth:`Backend.chunk_phases`) runs the XLA
phases, so the deprecated Triton lowering is never on a default path. Where Mosaic GPU cannot
run, ``"pallas"`` is the Triton lowering (interpreted on CPU), and ``"auto"`` picks ``"xla"``.
``"pallas_mosaic"`` and ``"pallas_triton"`` force one of the two lowerings. The bridge (``"triton"``)
lives in ``fused_kl_bridges``, imported only when it is resolved: ``jax_kl`` never imports ``torch_kl``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import jax

from fused_kl.backend import Compute, NamedByEntry
from fused_kl.checks import BackendUnavailable, unknown_backend


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
class Registered:
    """A backend by name, before anything of it is imported: what it runs, in words; why it
    cannot run here (None if it can); ``build(entry)`` imports its kernels and makes its
    :class:`Backend`; ``tracks_vma``: whether its outputs carry the varying axes that a
    ``shard_map`` with ``check_vma=True`` checks (Pallas kernels' do not)."""

    name: str
    runs: str
    missing: Callable[[], str | None]
    build: Callable[[Registered], Backend]
    single_device: bool = False
    tracks_vma: bool = True


@dataclass(frozen=True)
class Backend(NamedByEntry):
    """A backend resolved: what it runs. A variant is ``dataclasses.replace(backend, ...)``
    (``in_place_grad_weight=None`` prices that kernel), passed as ``backend=``.

    ``compute``: the entry that runs it (``jax_kl.driver.forward``, or a bridge);
    ``phases``: the row phases' module the chunk driver runs (None for a bridge);
    ``mosaic_phases``: the Mosaic GPU row phases, run instead where a chunk fits them
    (:meth:`chunk_phases`), or None;
    ``in_place_grad_weight``: the module whose ``accumulate(acc, g, x)`` adds ``gᵀ x`` into
    ``acc`` in place where its ``fits`` says so (``mosaic_accumulate``; its ``product`` and
    ``put_rows`` make and finish an unaligned vocabulary's one array), or None where the add
    is left to XLA;
    ``in_place_label_rows``: the module whose ``add_label_rows(acc, x, label)`` adds the label's
    term to ``grad_weight`` in place where its ``fits`` says so (``mosaic_label_rows``), or None
    where XLA's segment sum makes it (``jax_kl.gemm.add_label_rows``);
    ``vocab_parts``: at a vocabulary (slice) not a multiple of 128, a chunk (and its dense
    teacher) is made as its aligned columns and the rest (``jax_kl.gemm.vocab_parts``), so that
    every GEMM writes and reads rows of an aligned stride and the aligned part runs on the
    Mosaic GPU kernels (False prices that: the benchmark's ``jax_kl/pallas-whole-vocab``);
    ``label_apart``: the hard term's label entries kept out of a chunk's ``dL/dz``
    (``fused_kl.chunk.LabelTerm``; False prices that);
    ``factored``: the row phases' module whose ``exp_stats`` pass writes a factored chunk's ``E``
    (``jax_kl.factored``), used where :meth:`factors` says so, or None (every chunk runs the
    phases; the benchmark's ``jax_kl/pallas-unfactored`` prices that)."""

    entry: Registered
    compute: Compute
    phases: ModuleType | None = None
    mosaic_phases: ModuleType | None = None
    in_place_grad_weight: ModuleType | None = None
    in_place_label_rows: ModuleType | None = None
    vocab_parts: bool = True
    label_apart: bool = True
    factored: ModuleType | None = None

    def chunk_phases(self, z: jax.Array, t: object) -> ModuleType:
        """The row phases of one chunk (``z`` its logits, ``t`` its dense teacher or None): the
        Mosaic GPU kernels where the backend has them and the TMA can move the chunk (there they
        are at least as fast as the Triton lowering in every mode), else ``phases`` (for
        ``"pallas"`` on Mosaic GPU: the XLA phases)."""
        if self.mosaic_phases is not None and self.mosaic_phases.fits(z, t):
            return self.mosaic_phases
        return self.phases  # type: ignore[return-value]

    def factors(self, z: jax.Array) -> bool:
        """Whether a chunk whose logits (or their aligned part, ``vocab_parts``) are ``z``, of a
        call ``jax_kl.factored.takes``, is factored: where the phases that would run ``z``
        (:meth:`chunk_phases`) are ``factored``; the rest's phases run their own ``exp_stats``."""
        return self.factored is not None and self.chunk_phases(z, None) is self.factored


def xla_folds_the_add() -> bool:
    """Whether ``XLA_FLAGS`` turns XLA's Triton GEMMs off, so that XLA itself folds ``acc + gᵀ x``
    into a cuBLAS GEMM (beta = 1), a few per cent faster than ``mosaic_accumulate`` on the H200.
    Options given to ``jit(..., compiler_options=)`` are not visible here."""
    flags = os.environ.get("XLA_FLAGS", "").lower()
    return bool(re.search(r"--xla_gpu_enable_triton_gemm=(false|0)\b", flags))


def _mosaic_phases() -> ModuleType | None:
    """``pallas_mosaic`` where Mosaic GPU runs, else None."""
    if mosaic_missing() is not None:
        return None
    from . import pallas_mosaic

    return pallas_mosaic


def _in_place_grad_weight() -> ModuleType | None:
    """``mosaic_accumulate`` where Mosaic GPU runs and XLA does not fold the add itself
    (:func:`xla_folds_the_add`), else None."""
    if mosaic_missing() is not None or xla_folds_the_add():
        return None
    from . import mosaic_accumulate

    return mosaic_accumulate


def _in_place_kernels() -> dict[str, ModuleType | None]:
    """The Mosaic GPU backends' in-place ``grad_weight`` kernels, as :class:`Backend` fields:
    ``mosaic_accumulate`` (:func:`_in_place_grad_weight`) and ``mosaic_label_rows`` where Mosaic
    GPU runs."""
    label_rows = None
    if mosaic_missing() is None:
        from . import mosaic_label_rows as label_rows
    return {"in_place_grad_weight": _in_place_grad_weight(), "in_place_label_rows": label_rows}


def _pallas(entry: Registered) -> Backend:
    from ..driver import forward
    from . import pallas_triton, xla_phases

    mosaic = _mosaic_phases()
    if mosaic is None:
        return Backend(entry, forward, pallas_triton)
    return Backend(entry, forward, xla_phases, mosaic, **_in_place_kernels(), factored=mosaic)


def _pallas_mosaic(entry: Registered) -> Backend:
    from ..driver import forward
    from . import pallas_mosaic

    return Backend(entry, forward, pallas_mosaic, **_in_place_kernels(), factored=pallas_mosaic)


def _pallas_triton(entry: Registered) -> Backend:
    from ..driver import forward
    from . import pallas_triton

    return Backend(entry, forward, pallas_triton)


def _xla(entry: Registered) -> Backend:
    from ..driver import forward
    from . import xla_phases

    return Backend(entry, forward, xla_phases)


def _triton(entry: Registered) -> Backend:
    from fused_kl_bridges.triton_for_jax import jax_through_triton

    return Backend(entry, jax_through_triton)


REGISTRY = {
    b.name: b
    for b in (
        Registered(
            "pallas",
            "the Pallas row kernels, chunked: on Mosaic GPU where it runs (the XLA phases for a chunk it cannot"
            " move), else lowered through Triton (interpreted on CPU)",
            lambda: None,
            _pallas,
            tracks_vma=False,
        ),
        Registered(
            "pallas_mosaic",
            "the Pallas row kernels on Mosaic GPU (Hopper or newer, jax >= 0.11), chunked",
            mosaic_missing,
            _pallas_mosaic,
            tracks_vma=False,
        ),
        Registered(
            "pallas_triton",
            "the Pallas row kernels lowered through Triton, chunked (interpreted on CPU)",
            lambda: None,
            _pallas_triton,
            tracks_vma=False,
        ),
        Registered("xla", "the same chunked algorithm in plain jax.numpy", lambda: None, _xla),
        Registered(
            "triton",
            "torch_kl's Triton kernels through DLPack, under jax.jit and jax.grad",
            _torch_triton_missing,
            _triton,
            True,
        ),
    )
}
AUTO_ORDER = ("pallas", "xla")
NAMES = ("auto", *REGISTRY)


def _auto_may_pick(name: str) -> bool:
    """``"auto"`` takes the Pallas kernels only where they run on Mosaic GPU: elsewhere they are
    the deprecated Triton lowering (an explicit choice), and ``"xla"`` runs."""
    return name == "xla" or mosaic_missing() is None


def resolve(name: object, *, check_vma: bool = False) -> Backend:
    """The backend a ``backend=`` argument names, checked to run here and built (a
    :class:`Backend` value is taken as it is). ``check_vma``: the call runs inside a
    ``shard_map`` with ``check_vma=True``, where ``"auto"`` passes over the backends that do not
    track varying axes and naming one is refused."""
    if isinstance(name, Backend):
        _check_vma(name.entry, check_vma)
        return name
    if name not in NAMES:
        raise unknown_backend(name, NAMES)
    if name == "auto":
        for candidate in AUTO_ORDER:
            entry = REGISTRY[candidate]
            usable = entry.tracks_vma or not check_vma
            if _auto_may_pick(candidate) and usable and entry.missing() is None:
                return entry.build(entry)
    entry = REGISTRY[name]  # type: ignore[index]
    if (why := entry.missing()) is not None:
        raise BackendUnavailable(str(name), why)
    _check_vma(entry, check_vma)
    return entry.build(entry)


def _check_vma(entry: Registered, check_vma: bool) -> None:
    if check_vma and not entry.tracks_vma:
        raise ValueError(
            f"backend: {entry.name!r} cannot run inside a shard_map with check_vma=True (Pallas does not track the "
            "varying axes of its outputs); pass check_vma=False to shard_map, use mesh= with global arrays, or "
            "backend='xla'"
        )
