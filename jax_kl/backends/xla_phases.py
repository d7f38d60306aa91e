"""The row phases in plain ``jax.numpy``: the ``"xla"`` backend, for any device.

Same inputs, outputs and math as ``pallas_triton`` (``fused_kl.terms``, shared with torch),
written with whole-row array ops that XLA fuses. ``t`` is a dense teacher and the row of it
where the chunk starts (``(array, row0)``), or None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl import terms
from fused_kl.loss import Loss


def _student(z: jax.Array, loss: Loss) -> jax.Array:
    return terms.transform(z.astype(jnp.float32), loss.logit_scale, loss.softcap, jnp)


def _rows(t: tuple[jax.Array, int], rows: int) -> jax.Array:
    array, row0 = t
    return lax.dynamic_slice_in_dim(array, row0, rows).astype(jnp.float32)


def _teacher(t, rows: int, loss: Loss, lse_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    return terms.teacher_probs(_rows(t, rows), loss.teacher, lse_t[:, None], jnp)  # type: ignore[arg-type]


def stats(z: jax.Array, t, y: jax.Array | None, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """``fused_kl.rowmath.STATS`` of each row of the chunk (local to this vocabulary slice)."""
    del tile  # whole rows at once
    rows, v = z.shape
    f = _student(z, loss)
    zero = jnp.zeros(rows, jnp.float32)
    lse = jax.nn.logsumexp(f / loss.temperature, axis=-1)
    lse_h = jax.nn.logsumexp(f, axis=-1) if loss.separate_hard_lse else lse
    lse_t = mass = logit_sum = label_logit = rho = zero
    if t is not None:
        if loss.teacher.has_logits or loss.kind == "reverse":  # type: ignore[union-attr]
            b = terms.teacher_log(_rows(t, rows), loss.teacher, jnp)  # type: ignore[arg-type]
        if loss.teacher.has_logits:  # type: ignore[union-attr]
            lse_t = jax.nn.logsumexp(b, axis=-1)
        elif loss.kind == "forward":
            mass = _teacher(t, rows, loss, zero)[0].sum(-1)
        if loss.kind == "reverse":
            log_q = f / loss.temperature - lse[:, None]
            rho = terms.reverse_term(jnp.exp(log_q), log_q, b).sum(-1)
    if y is not None:
        logit_sum = f.sum(-1)
        inside = (y >= 0) & (y < v)
        label_logit = jnp.where(inside, jnp.take_along_axis(f, jnp.clip(y, 0, v - 1)[:, None], axis=1)[:, 0], 0.0)
    return jnp.stack([lse, lse_h, lse_t, mass, logit_sum, label_logit, rho], -1)


def value(z: jax.Array, t, stats: jax.Array, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """Phase 2 (JSD): each row's sums ``(A, B)``."""
    del tile
    log_q = _student(z, loss) / loss.temperature - stats[:, :1]
    p, log_p = _teacher(t, z.shape[0], loss, stats[:, 2])
    a, b = terms.jsd_terms(jnp.exp(log_q), log_q, p, log_p, loss.beta, jnp)
    return jnp.stack([a.sum(-1), b.sum(-1)], -1)


def finish(
    z: jax.Array,
    t,
    y: jax.Array | None,
    coefs: jax.Array,
    loss: Loss,
    v_total: int,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:
    """Phase 3: ``(dL/dz in z's dtype or None, the rows' forward-KL sums)``."""
    del tile
    rows, v = z.shape
    f = _student(z, loss)
    log_q = f / loss.temperature - coefs[:, :1]
    q = jnp.exp(log_q)
    partial = jnp.zeros(rows, jnp.float32)
    p = log_p = q
    if t is not None:
        p, log_p = _teacher(t, rows, loss, coefs[:, 2])
        if loss.kind == "forward":
            partial = terms.forward_term(p, log_p, log_q, jnp).sum(-1)
    if not write_grad:
        return None, partial
    g = coefs[:, 4:5] * terms.soft_direction(loss.kind, q, log_q, p, log_p, coefs[:, 3:4], loss.beta, jnp)
    if loss.hard:
        is_label = jnp.arange(v)[None, :] == y[:, None]  # type: ignore[index]
        g = g + coefs[:, 5:6] * terms.hard_direction(f, coefs[:, 1:2], is_label, loss, v_total, jnp)
    live = (coefs[:, 4:5] != 0) | (coefs[:, 5:6] != 0)  # ignored rows: exactly 0, never NaN
    g = jnp.where(live, g * terms.slope(z.astype(jnp.float32), loss.logit_scale, loss.softcap, jnp), 0.0)
    return g.astype(z.dtype), partial
