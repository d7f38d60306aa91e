"""The row phases in plain ``jax.numpy``: the ``"xla"`` backend, for any device.

``fused_kl.wholerow`` (shared with torch's ``"torch"`` backend) in JAX's spelling: the same
inputs, outputs and math as ``pallas_triton``, with whole-row array ops that XLA fuses. ``t`` is
a dense teacher and the row of it where the chunk starts (``(array, row0)``), or None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fused_kl import factored, wholerow
from fused_kl.loss import Loss

from ..ops import ROW_OPS
from ..teachers import DenseChunk


def stats(z: jax.Array, t: DenseChunk | None, y: jax.Array | None, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """``fused_kl.rows.Stats`` of each row of the chunk (local to this vocabulary slice)."""
    del tile  # whole rows at once
    return wholerow.stats(z, t, y, loss, ROW_OPS)


def exp_stats(z: jax.Array, y: jax.Array | None, loss: Loss) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A factored chunk's pass (``fused_kl.factored``; no dense teacher): ``(E`` in
    ``z``'s dtype, the rows' ``fused_kl.rows.Stats``, each row's maximum exponent)``."""
    f32 = z.astype(jnp.float32)
    e = factored.exponentials(f32, loss, jnp).astype(z.dtype)
    row_max = jnp.max(factored.exponent(f32, loss, jnp), axis=1)
    return e, wholerow.stats(z, None, y, loss, ROW_OPS), row_max


def mixture_sums(z: jax.Array, t: DenseChunk, stats: jax.Array, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """Phase 2 (JSD): each row's ``fused_kl.rows.MixtureSums``, of ``fused_kl.terms.jsd_terms``."""
    del tile
    return wholerow.mixture_sums(z, t, stats, loss, ROW_OPS)


def finish(
    z: jax.Array,
    t: DenseChunk | None,
    y: jax.Array | None,
    coefs: jax.Array,
    loss: Loss,
    v_total: int,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:
    """Phase 3: ``(dL/dz in z's dtype or None, the rows' forward-KL sums)``."""
    del tile
    return wholerow.finish(z, t, y, coefs, loss, v_total, write_grad, ROW_OPS)
