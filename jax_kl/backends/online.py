"""Running sums over a row's tiles, shared by the two Pallas lowerings (``pallas_triton``,
``pallas_mosaic``); ``torch_kl/backends/triton_phases.py`` has their translation, in base 2.

``wide(row, tile)`` broadcasts a per-tile-row value along the tile's columns, as each lowering
spells it. Masked entries of ``a`` are ``-inf``; running maxima start at a finite lowest value,
so an all-masked tile row keeps ``exp(m - m_new) = 1`` and its sums 0.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Wide = Callable[[jax.Array, jax.Array], jax.Array]


def lse_step(m: jax.Array, s: jax.Array, a: jax.Array, wide: Wide) -> tuple[jax.Array, jax.Array]:
    """Running max ``m`` and ``s = sum exp(a - m)`` per tile row, after one more tile ``a``."""
    m_new = jnp.maximum(m, jnp.max(a, axis=1))
    return m_new, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(a - wide(m_new, a)), axis=1)


def reverse_step(m, s, u, a: jax.Array, b: jax.Array, wide: Wide) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`lse_step` and reverse KL's ``u = sum exp(a - m) (a - m - b)`` (``fused_kl.rowmath.REVERSE``)."""
    m_new = jnp.maximum(m, jnp.max(a, axis=1))
    c = jnp.exp(m - m_new)
    d = a - wide(m_new, a)
    e = jnp.exp(d)
    du = jnp.sum(jnp.where(e > 0, e * (d - b), 0.0), axis=1)
    return m_new, s * c + jnp.sum(e, axis=1), c * (u + (m - m_new) * s) + du


def reverse_part(m: jax.Array, s: jax.Array, u: jax.Array) -> jax.Array:
    """``rho = U / S - log S`` from the running ``(m, s, u)`` of tile rows or segments (axis 0),
    each shifted to their common max."""
    top = jnp.max(m, axis=0)
    c = jnp.exp(m - top)
    total = jnp.sum(c * s, axis=0)
    return jnp.sum(c * (u + (m - top) * s), axis=0) / total - jnp.log(total)
