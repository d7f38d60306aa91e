"""The row phases as Pallas kernels lowered through Triton: ``torch_kl``'s Triton kernels
(``torch_kl/backends/triton_phases.py``, whose docstring states the phases), translated.

The elementwise math is ``fused_kl.terms``'s jnp code itself, called inside the kernels. One
program per row of the chunk; each row is walked in ``[tile[0], tile[1]]`` tiles with running
maxima and sums per tile row (``fused_kl.plan``). The teacher is read where it lies in the
full target (``(array, row0)``), so no slice of it is copied. ``dL/dz`` overwrites the logits
through ``input_output_aliases``: no second ``[chunk, V]`` buffer. Pallas's Triton lowering
switches to 64-bit offsets itself when an operand exceeds 4 GiB (the full target can).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fused_kl import rowmath, terms
from fused_kl.loss import Loss

from ..teachers import DenseChunk
from . import online

# The running maxima start here, not at -inf: a tile row that is all padding then keeps
# exp(m - m_new) = 1 and its sum 0, where -inf - -inf would make it NaN.
LOWEST = -3.0e38
NEG_INF = float("-inf")


def _wide(row: jax.Array, like: jax.Array) -> jax.Array:
    """A per-tile-row value against the tile's columns (``online``'s ``wide``): broadcast by shape."""
    del like
    return row[:, None]


def _lse(m, s):
    m_all = jnp.max(m)
    return m_all + jnp.log(jnp.sum(s * jnp.exp(m - m_all)))


def _walk(v: int, tile: tuple[int, int], body, init):
    """``fori_loop`` over the row's tiles: ``body(cols, mask, carry)``."""
    offs = jnp.arange(tile[0])[:, None] * tile[1] + jnp.arange(tile[1])[None, :]
    block = tile[0] * tile[1]

    def step(i, carry):
        cols = i * block + offs
        return body(cols, cols < v, carry)

    return jax.lax.fori_loop(0, pl.cdiv(v, block), step, init)


def _load(ref, cols, mask):
    return plgpu.load(ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)


def _student(ref, cols, mask, loss: Loss):
    z = _load(ref, cols, mask)
    return z, terms.transform(z, loss.logit_scale, loss.softcap, jnp)


def _stats_kernel(*refs, v: int, loss: Loss, has_teacher: bool, hard: bool, tile: tuple[int, int]):
    z_ref, *refs = refs
    t_ref = refs.pop(0) if has_teacher else None
    y_ref = refs.pop(0) if hard else None
    (out_ref,) = refs
    teacher = loss.teacher
    logits = has_teacher and teacher.has_logits
    reverse = has_teacher and loss.kind == "reverse"

    def body(cols, mask, carry):
        m, s, u, mh, sh, mt, st, mass, f_sum = carry
        f = _student(z_ref, cols, mask, loss)[1]
        a = jnp.where(mask, f / loss.temperature, NEG_INF)
        if logits or reverse:
            b = terms.teacher_log(_load(t_ref, cols, mask), teacher, jnp)
        if reverse:
            m, s, u = online.reverse_step(m, s, u, a, b, _wide)
        else:
            m, s = online.lse_step(m, s, a, _wide)
        if loss.separate_hard_lse:
            mh, sh = online.lse_step(mh, sh, jnp.where(mask, f, NEG_INF), _wide)
        if hard:
            f_sum += jnp.sum(jnp.where(mask, f, 0.0), axis=1)
        if logits:
            mt, st = online.lse_step(mt, st, jnp.where(mask, b, NEG_INF), _wide)
        elif has_teacher and loss.kind == "forward":
            p = terms.teacher_probs(_load(t_ref, cols, mask), teacher, 0.0, jnp)[0]
            mass += jnp.sum(jnp.where(mask, p, 0.0), axis=1)
        return m, s, u, mh, sh, mt, st, mass, f_sum

    low, zero = jnp.full((tile[0],), LOWEST, jnp.float32), jnp.zeros((tile[0],), jnp.float32)
    init = (low, zero, zero, low, zero, low, zero, zero, zero)
    m, s, u, mh, sh, mt, st, mass, f_sum = _walk(v, tile, body, init)
    lse = _lse(m, s)
    lse_h = _lse(mh, sh) if loss.separate_hard_lse else lse
    lse_t = _lse(mt, st) if logits else jnp.float32(0.0)
    label_logit = jnp.float32(0.0)
    if hard:
        y = y_ref[0]
        inside = (y >= 0) & (y < v)
        z_y = plgpu.load(z_ref.at[jnp.where(inside, y, 0)]).astype(jnp.float32)
        label_logit = jnp.where(inside, terms.transform(z_y, loss.logit_scale, loss.softcap, jnp), 0.0)
    out_ref[0] = lse
    out_ref[1] = lse_h
    out_ref[2] = lse_t
    out_ref[3] = jnp.sum(mass)
    out_ref[4] = jnp.sum(f_sum)
    out_ref[5] = label_logit
    out_ref[rowmath.REVERSE] = online.reverse_part(m, s, u) if reverse else jnp.float32(0.0)


def _value_kernel(z_ref, t_ref, stats_ref, out_ref, *, v: int, loss: Loss, tile: tuple[int, int]):
    lse, lse_t = stats_ref[0], stats_ref[2]

    def body(cols, mask, carry):
        acc_a, acc_b = carry
        log_q = _student(z_ref, cols, mask, loss)[1] / loss.temperature - lse
        p, log_p = terms.teacher_probs(_load(t_ref, cols, mask), loss.teacher, lse_t, jnp)  # type: ignore[arg-type]
        a, b = terms.jsd_terms(jnp.exp(log_q), log_q, p, log_p, loss.beta, jnp)
        return acc_a + jnp.sum(jnp.where(mask, a, 0.0), axis=1), acc_b + jnp.sum(jnp.where(mask, b, 0.0), axis=1)

    zero = jnp.zeros((tile[0],), jnp.float32)
    acc_a, acc_b = _walk(v, tile, body, (zero, zero))
    out_ref[0] = jnp.sum(acc_a)
    out_ref[1] = jnp.sum(acc_b)


def _finish_kernel(
    *refs, v: int, v_total: int, loss: Loss, has_teacher: bool, hard: bool, write_grad: bool, tile: tuple[int, int]
):
    z_ref, *refs = refs
    t_ref = refs.pop(0) if has_teacher else None
    y_ref = refs.pop(0) if hard else None
    coef_ref, *refs = refs
    g_ref = refs.pop(0) if write_grad else None  # aliases z
    (out_ref,) = refs
    lse, lse_h, lse_t, k, c_soft, c_hard = (coef_ref[i] for i in range(len(rowmath.COEFS)))
    live = (c_soft != 0.0) | (c_hard != 0.0)  # ignored rows: exactly 0, never NaN
    y = y_ref[0] if hard else -1

    def body(cols, mask, acc):
        z, f = _student(z_ref, cols, mask, loss)
        log_q = f / loss.temperature - lse
        q = jnp.exp(log_q)
        p, log_p = q, log_q
        if has_teacher:
            p, log_p = terms.teacher_probs(_load(t_ref, cols, mask), loss.teacher, lse_t, jnp)  # type: ignore[arg-type]
        if loss.kind == "forward":
            acc += jnp.sum(jnp.where(mask, terms.forward_term(p, log_p, log_q, jnp), 0.0), axis=1)
        if write_grad:
            g = c_soft * terms.soft_direction(loss.kind, q, log_q, p, log_p, k, loss.beta, jnp)
            if hard:
                g += c_hard * terms.hard_direction(f, lse_h, cols == y, loss, v_total, jnp)
            g = jnp.where(live, g * terms.slope(z, loss.logit_scale, loss.softcap, jnp), 0.0)
            plgpu.store(g_ref.at[cols], g.astype(g_ref.dtype), mask=mask)
        return acc

    out_ref[0] = jnp.sum(_walk(v, tile, body, jnp.zeros((tile[0],), jnp.float32)))


def _row(v: int, row0: int = 0) -> pl.BlockSpec:
    return pl.BlockSpec((None, v), lambda i: (i + row0, 0))


def _call(kernel, rows: int, args: list, specs: list, out_shape: list, out_specs: list, tile, aliases=None):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(rows,),
        in_specs=specs,
        out_specs=out_specs,
        input_output_aliases=aliases or {},
        compiler_params=plgpu.CompilerParams(num_warps=8 if tile[0] * tile[1] >= 2048 else 4, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name="fused_kl_rows",
    )(*args)


def _inputs(z: jax.Array, t, y: jax.Array | None) -> tuple[list, list]:
    v = z.shape[1]
    args, specs = [z], [_row(v)]
    if t is not None:
        array, row0 = t
        args.append(array)
        specs.append(_row(array.shape[1], row0))
    if y is not None:
        args.append(y)
        specs.append(pl.BlockSpec((1,), lambda i: (i,)))
    return args, specs


def stats(z: jax.Array, t: DenseChunk | None, y: jax.Array | None, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """``fused_kl.rowmath.STATS`` of each row of the chunk (local to this vocabulary slice)."""
    rows, v = z.shape
    args, specs = _inputs(z, t, y)
    kernel = functools.partial(_stats_kernel, v=v, loss=loss, has_teacher=t is not None, hard=y is not None, tile=tile)
    width = len(rowmath.STATS)
    return _call(kernel, rows, args, specs, jax.ShapeDtypeStruct((rows, width), jnp.float32), _row(width), tile)


def value(z: jax.Array, t: DenseChunk, stats: jax.Array, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """Phase 2 (JSD): each row's sums ``(A, B)``."""
    rows, v = z.shape
    args, specs = _inputs(z, t, None)
    kernel = functools.partial(_value_kernel, v=v, loss=loss, tile=tile)
    two = jax.ShapeDtypeStruct((rows, 2), jnp.float32)
    return _call(kernel, rows, [*args, stats], [*specs, _row(len(rowmath.STATS))], two, _row(2), tile)


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
    """Phase 3: ``(dL/dz in z's buffer or None, the rows' forward-KL sums)``."""
    rows, v = z.shape
    args, specs = _inputs(z, t, y)
    kernel = functools.partial(
        _finish_kernel,
        v=v,
        v_total=v_total,
        loss=loss,
        has_teacher=t is not None,
        hard=y is not None,
        write_grad=write_grad,
        tile=tile,
    )
    out_shape = [jax.ShapeDtypeStruct((rows,), jnp.float32)]
    out_specs = [pl.BlockSpec((1,), lambda i: (i,))]
    if write_grad:
        out_shape.insert(0, jax.ShapeDtypeStruct(z.shape, z.dtype))
        out_specs.insert(0, _row(v))
    outs = _call(
        kernel, rows, [*args, coefs], [*specs, _row(len(rowmath.COEFS))], out_shape, out_specs, tile,
        {0: 0} if write_grad else None,
    )
    return (outs[0], outs[1]) if write_grad else (None, outs[0])
