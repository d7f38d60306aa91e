"""The ``"pallas"`` backend's row phases: the Mosaic GPU kernels (``pallas_mosaic``) where they
run — a Hopper or newer GPU, jax >= 0.11, a chunk the TMA can move; there they are at least as
fast as the Triton lowering in every mode (benchmarks/RESULTS-2026-12-01.md) — and the Triton-lowered
kernels (``pallas_triton``) everywhere else, interpret mode on CPU included. Both compute the
same phases; the choice is made per chunk, at trace time."""

from __future__ import annotations

from types import ModuleType

import jax

from fused_kl.loss import Loss

from ..teachers import DenseChunk
from . import mosaic_missing, pallas_triton


def _pick(z: jax.Array, t) -> ModuleType:
    if mosaic_missing() is None:
        try:
            from . import pallas_mosaic
        except (ImportError, AttributeError):  # a JAX whose Mosaic GPU API moved: the Triton lowering
            return pallas_triton
        if pallas_mosaic.fits(z, t):
            return pallas_mosaic
    return pallas_triton


def stats(z: jax.Array, t: DenseChunk | None, y: jax.Array | None, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """``fused_kl.rowmath.STATS`` of each row of the chunk."""
    return _pick(z, t).stats(z, t, y, loss, tile)


def value(z: jax.Array, t: DenseChunk, stats: jax.Array, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """Phase 2 (JSD): each row's sums."""
    return _pick(z, t).value(z, t, stats, loss, tile)


def finish(
    z: jax.Array, t: DenseChunk | None, y: jax.Array | None, coefs: jax.Array, loss: Loss, v_total: int,
    tile: tuple[int, int], write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:  # fmt: skip
    """Phase 3: ``(dL/dz in z's buffer or None, the rows' forward-KL sums)``."""
    return _pick(z, t).finish(z, t, y, coefs, loss, v_total, tile, write_grad)
