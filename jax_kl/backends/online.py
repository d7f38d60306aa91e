"""The row phases' math over one tile, shared by the two Pallas lowerings (``pallas_triton``,
``pallas_mosaic``), which differ in how they walk a row's tiles and move them, not in what
they compute; ``torch_kl/backends/triton_phases.py`` is the translation, in base 2.

``wide(value, tile)`` broadcasts a per-tile-row running value along the tile's columns, and
``row(value)`` a per-row value (a scalar in ``pallas_triton``, one program per row; ``[R]`` in
``pallas_mosaic``), as each lowering spells it. Masked entries of ``a`` are ``-inf``; running
maxima start at ``LOWEST``, so an all-masked tile row keeps ``exp(m - m_new) = 1`` and its sums 0.
``xp`` is the array namespace the terms see (``fused_kl.terms``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from fused_kl import rowmath, terms
from fused_kl.loss import Loss
from fused_kl.rows import Coefs, MixtureSums

Wide = Callable[[jax.Array, jax.Array], jax.Array]
# The running maxima start here, not at -inf: a tile row that is all padding then keeps
# exp(m - m_new) = 1 and its sum 0, where -inf - -inf would make it NaN.
LOWEST = -3.0e38
NEG_INF = float("-inf")


def lse_step(m: jax.Array, s: jax.Array, a: jax.Array, wide: Wide) -> tuple[jax.Array, jax.Array]:
    """Running max ``m`` and ``s = sum exp(a - m)`` per tile row, after one more tile ``a``."""
    m_new = jnp.maximum(m, jnp.max(a, axis=1))
    return m_new, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(a - wide(m_new, a)), axis=1)


def reverse_step(m, s, u, a: jax.Array, b: jax.Array, wide: Wide) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`lse_step` and reverse KL's ``u = sum exp(a - m) (a - m - b)`` (``fused_kl.rows.Stats.reverse``)."""
    m_new = jnp.maximum(m, jnp.max(a, axis=1))
    c = jnp.exp(m - m_new)
    d = a - wide(m_new, a)
    e = jnp.exp(d)
    du = jnp.sum(jnp.where(e > 0, e * (d - b), 0.0), axis=1)
    return m_new, s * c + jnp.sum(e, axis=1), c * (u + (m - m_new) * s) + du


def lse_of(m: jax.Array, s: jax.Array) -> jax.Array:
    """The log-sum-exp from the running ``(max, sum)`` of tile rows or segments (axis 0)."""
    return rowmath.combine_lse(m + jnp.log(s), lambda a: jnp.max(a, axis=0), lambda a: jnp.sum(a, axis=0), jnp)


def reverse_part(m: jax.Array, s: jax.Array, u: jax.Array) -> jax.Array:
    """``rho = U / S - log S`` from the running ``(m, s, u)`` of tile rows or segments (axis 0),
    each shifted to their common max."""
    top = jnp.max(m, axis=0)
    c = jnp.exp(m - top)
    total = jnp.sum(c * s, axis=0)
    return jnp.sum(c * (u + (m - top) * s), axis=0) / total - jnp.log(total)


@dataclass(frozen=True)
class StatsCarries:
    """What the statistics pass carries over a row's tiles, in this order: the student's (max,
    sum), reverse KL's ``u``, the hard term's (max, sum), ``sum f``, the teacher logits' (max,
    sum) or the teacher's mass; each only where the loss needs it."""

    reverse: bool
    hard_lse: bool
    hard: bool
    logits: bool
    mass: bool

    @staticmethod
    def of(loss: Loss, has_teacher: bool, hard: bool) -> StatsCarries:
        logits = has_teacher and loss.teacher.has_logits  # type: ignore[union-attr]
        return StatsCarries(
            reverse=has_teacher and loss.kind == "reverse",
            hard_lse=loss.separate_hard_lse,
            hard=hard,
            logits=logits,
            mass=has_teacher and not logits and loss.kind == "forward",
        )

    def inits(self) -> list[float]:
        pair = [LOWEST, 0.0]
        out = pair + [0.0] * self.reverse + pair * self.hard_lse + [0.0] * self.hard
        return out + (pair if self.logits else [0.0] * self.mass)


def stats_tile(
    carry: list, z: jax.Array, teacher_tile: Callable[[], jax.Array], mask: jax.Array, loss: Loss,
    carries: StatsCarries, wide: Wide, xp: Any,
) -> list:  # fmt: skip
    """The carries after one more tile: ``z`` the student's logits (float32), ``teacher_tile()``
    the teacher's (read only where needed)."""
    vals = iter(carry)
    f = terms.transform(z, loss.logit_scale, loss.softcap, xp)
    a = jnp.where(mask, f / loss.temperature, NEG_INF)
    if carries.logits or carries.reverse:
        b = terms.teacher_log(teacher_tile(), loss.teacher, xp)  # type: ignore[arg-type]
    if carries.reverse:
        new = list(reverse_step(next(vals), next(vals), next(vals), a, b, wide))
    else:
        new = list(lse_step(next(vals), next(vals), a, wide))
    if carries.hard_lse:
        new += lse_step(next(vals), next(vals), jnp.where(mask, f, NEG_INF), wide)
    if carries.hard:
        new.append(next(vals) + jnp.sum(jnp.where(mask, f, 0.0), axis=1))
    if carries.logits:
        new += lse_step(next(vals), next(vals), jnp.where(mask, b, NEG_INF), wide)
    elif carries.mass:
        p = terms.teacher_probs(teacher_tile(), loss.teacher, 0.0, xp)[0]  # type: ignore[arg-type]
        new.append(next(vals) + jnp.sum(jnp.where(mask, p, 0.0), axis=1))
    return new


def stats_columns(
    parts: list, carries: StatsCarries, lse: Callable[[Any, Any], Any], total: Callable[[Any], Any], zero: Any
) -> dict[str, Any]:
    """Every column of ``fused_kl.rows.Stats`` but ``label_logit``, by name, from the carries'
    final values (in :class:`StatsCarries`' order); ``lse(m, s)`` and ``total(a)`` reduce them
    over axis 0."""
    parts = iter(parts)
    m, s = next(parts), next(parts)
    rho = reverse_part(m, s, next(parts)) if carries.reverse else zero
    lse_s = lse(m, s)
    lse_h = lse(next(parts), next(parts)) if carries.hard_lse else lse_s
    f_sum = total(next(parts)) if carries.hard else zero
    lse_t = lse(next(parts), next(parts)) if carries.logits else zero
    mass = total(next(parts)) if carries.mass else zero
    return dict(lse=lse_s, lse_hard=lse_h, lse_teacher=lse_t, mass=mass, logit_sum=f_sum, reverse=rho)


def mixture_tile(
    z: jax.Array, t: jax.Array, lse: Any, lse_t: Any, mask: jax.Array, loss: Loss, xp: Any
) -> MixtureSums:
    """JSD's ``MixtureSums`` of one tile's rows (``fused_kl.terms.jsd_terms``); ``lse``, ``lse_t``
    broadcast."""
    log_q = terms.transform(z, loss.logit_scale, loss.softcap, xp) / loss.temperature - lse
    p, log_p = terms.teacher_probs(t, loss.teacher, lse_t, xp)  # type: ignore[arg-type]
    a, b = terms.jsd_terms(jnp.exp(log_q), log_q, p, log_p, loss.beta, xp)
    return MixtureSums(jnp.sum(jnp.where(mask, a, 0.0), axis=1), jnp.sum(jnp.where(mask, b, 0.0), axis=1))


def finish_tile(
    z: jax.Array, teacher_tile: Callable[[], jax.Array] | None, coefs: Coefs, y: Any, cols: jax.Array,
    mask: jax.Array, loss: Loss, v_total: int, write_grad: bool, row: Callable[[Any], Any], xp: Any,
) -> tuple[jax.Array | None, jax.Array | None]:  # fmt: skip
    """One tile's forward-KL sums (None for another divergence) and ``dL/dz`` (float32, 0 where
    masked; None without ``write_grad``): ``coefs`` the rows' values, ``y`` their labels (hard
    term) or None."""
    f = terms.transform(z, loss.logit_scale, loss.softcap, xp)
    log_q = f / loss.temperature - row(coefs.lse)
    q = jnp.exp(log_q)
    p, log_p = q, log_q
    if teacher_tile is not None:
        p, log_p = terms.teacher_probs(teacher_tile(), loss.teacher, row(coefs.lse_teacher), xp)  # type: ignore[arg-type]
    acc = None
    if loss.kind == "forward":
        acc = jnp.sum(jnp.where(mask, terms.forward_term(p, log_p, log_q, xp), 0.0), axis=1)
    if not write_grad:
        return acc, None
    # ignored rows: exactly 0. A float row broadcast, then compared: both lowerings take this form
    live = row(jnp.abs(coefs.soft_scale) + jnp.abs(coefs.hard_scale) + jnp.abs(coefs.z_scale)) != 0.0
    soft = terms.soft_direction(loss.kind, q, log_q, p, log_p, row(coefs.soft_const), loss.beta, xp)
    g = row(coefs.soft_scale) * soft
    if y is not None:
        is_label = cols == row(y)
        g += terms.hard_gradient(
            f, row(coefs.lse_hard), is_label, row(coefs.hard_scale), row(coefs.z_scale), loss, v_total, xp
        )  # fmt: skip
    return acc, jnp.where(live & mask, g * terms.slope(z, loss.logit_scale, loss.softcap, xp), 0.0)
