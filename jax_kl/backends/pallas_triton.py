"""The row phases as Pallas kernels lowered through Triton: ``torch_kl``'s Triton kernels
(``torch_kl/backends/triton_phases.py``, whose docstring states the phases), translated.

The elementwise math is ``fused_kl.terms``'s jnp code itself, called inside the kernels. One
program per row of the chunk; each row is walked in ``[tile[0], tile[1]]`` tiles with running
maxima and sums per tile row (``fused_kl.plan``). The teacher is read where it lies in the
full target (``(array, row0)``), so no slice of it is copied (but a chunk in vocabulary parts:
each part's columns, ``jax_kl.teachers``). ``dL/dz`` overwrites the logits
through ``input_output_aliases``: no second ``[chunk, V]`` buffer. Pallas's Triton lowering
switches to 64-bit offsets itself when an operand exceeds 4 GiB (the full target can).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fused_kl import terms
from fused_kl.loss import Loss
from fused_kl.rows import COEFS, MIXTURE_SUMS, STATS, Coefs, Stats

from ..teachers import DenseChunk
from . import online


def _wide(row: jax.Array, like: jax.Array) -> jax.Array:
    """A per-tile-row value against the tile's columns (``online``'s ``wide``): broadcast by shape."""
    del like
    return row[:, None]


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


def _stats_kernel(*refs, v: int, loss: Loss, carries: online.StatsCarries, has_teacher: bool, tile: tuple[int, int]):
    z_ref, *refs = refs
    t_ref = refs.pop(0) if has_teacher else None
    y_ref = refs.pop(0) if carries.hard else None
    (out_ref,) = refs

    def body(cols, mask, carry):
        teacher_tile = lambda: _load(t_ref, cols, mask)
        return online.stats_tile(carry, _load(z_ref, cols, mask), teacher_tile, mask, loss, carries, _wide, jnp)

    init = [jnp.full((tile[0],), x0, jnp.float32) for x0 in carries.inits()]
    parts = _walk(v, tile, body, init)
    columns = online.stats_columns(parts, carries, online.lse_of, jnp.sum, jnp.float32(0.0))
    label_logit = jnp.float32(0.0)
    if y_ref is not None:
        y = y_ref[0]
        inside = (y >= 0) & (y < v)
        z_y = plgpu.load(z_ref.at[jnp.where(inside, y, 0)]).astype(jnp.float32)
        label_logit = jnp.where(inside, terms.transform(z_y, loss.logit_scale, loss.softcap, jnp), 0.0)
    for at, value in zip(STATS, Stats(**columns, label_logit=label_logit), strict=True):
        out_ref[at] = value


def _mixture_sums_kernel(z_ref, t_ref, stats_ref, out_ref, *, v: int, loss: Loss, tile: tuple[int, int]):
    lse, lse_t = stats_ref[STATS.lse], stats_ref[STATS.lse_teacher]

    def body(cols, mask, carry):
        a, b = online.mixture_tile(_load(z_ref, cols, mask), _load(t_ref, cols, mask), lse, lse_t, mask, loss, jnp)
        return carry[0] + a, carry[1] + b

    zero = jnp.zeros((tile[0],), jnp.float32)
    acc_a, acc_b = _walk(v, tile, body, (zero, zero))
    out_ref[MIXTURE_SUMS.teacher] = jnp.sum(acc_a)
    out_ref[MIXTURE_SUMS.student] = jnp.sum(acc_b)


def _finish_kernel(
    *refs, v: int, v_total: int, loss: Loss, has_teacher: bool, hard: bool, write_grad: bool, tile: tuple[int, int]
):
    z_ref, *refs = refs
    t_ref = refs.pop(0) if has_teacher else None
    y_ref = refs.pop(0) if hard else None
    coef_ref, *refs = refs
    g_ref = refs.pop(0) if write_grad else None  # aliases z
    (out_ref,) = refs
    coefs = Coefs(*(coef_ref[at] for at in COEFS))
    y = y_ref[0] if hard else None

    def body(cols, mask, acc):
        teacher_tile = (lambda: _load(t_ref, cols, mask)) if has_teacher else None
        z = _load(z_ref, cols, mask)
        part, g = online.finish_tile(
            z, teacher_tile, coefs, y, cols, mask, loss, v_total, write_grad, lambda r: r, jnp
        )  # one program per row: its values are scalars, broadcast as they are
        if g is not None:
            plgpu.store(g_ref.at[cols], g.astype(g_ref.dtype), mask=mask)
        return acc if part is None else acc + part

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
    """``fused_kl.rows.Stats`` of each row of the chunk (local to this vocabulary slice)."""
    rows, v = z.shape
    args, specs = _inputs(z, t, y)
    carries = online.StatsCarries.of(loss, t is not None, y is not None)
    kernel = functools.partial(_stats_kernel, v=v, loss=loss, carries=carries, has_teacher=t is not None, tile=tile)
    width = len(STATS)
    return _call(kernel, rows, args, specs, jax.ShapeDtypeStruct((rows, width), jnp.float32), _row(width), tile)


def mixture_sums(z: jax.Array, t: DenseChunk, stats: jax.Array, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """Phase 2 (JSD): each row's ``fused_kl.rows.MixtureSums``."""
    rows, v = z.shape
    args, specs = _inputs(z, t, None)
    kernel = functools.partial(_mixture_sums_kernel, v=v, loss=loss, tile=tile)
    width = len(MIXTURE_SUMS)
    out_shape = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    return _call(kernel, rows, [*args, stats], [*specs, _row(len(STATS))], out_shape, _row(width), tile)


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
        kernel, rows, [*args, coefs], [*specs, _row(len(COEFS))], out_shape, out_specs, tile,
        {0: 0} if write_grad else None,
    )
    return (outs[0], outs[1]) if write_grad else (None, outs[0])
