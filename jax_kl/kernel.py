"""The row kernel in Pallas: one chunk of logits in, its row losses and ``dL/dz`` out.

Math, per row ``i`` of the chunk (``z`` the logits, ``t`` the target, all in float32)::

    lse_i   = log sum_j exp(z_ij / T)                   (online per tile row, pass 1)
    log_q   = z / T - lse_i
    p, log_p from t by target_format:
        probs:     p = t,                log_p = log(max(t, eps))
        log_probs: p = exp(t),           log_p = t
        logits:    p = softmax(t / T_t), log_p = t / T_t - lse(t / T_t)   (as lse_i)
    S_i     = sum_j p_ij                                 (pass 1; 1 for logits)
    loss_i  = s * sum_j [p_ij * (log_p_ij - log_q_ij)]   (a term with p_ij == 0 counts 0)
    dL/dz_ij = s * (q_ij * S_i - p_ij) / T               (pass 2, written over z)

``s`` is the reduction scale and ``s_g`` the scale dL/dz is stored at (``s``, or ``s / c``
for float16: see ``fused_kl.plan.float16_unscale``), both read from device memory (no host
sync). Each row is walked in ``[tile[0], tile[1]]`` tiles (``fused_kl.plan.TILE_COLS``): the
running max and sums are kept per tile row and combined once, after pass 1. Rows whose label
is ``ignore_index`` get ``loss_i = 0`` and ``dL/dz_i = 0``. ``dL/dz`` overwrites the logits
through ``input_output_aliases``, so no second ``[chunk, V]`` buffer exists. Pallas's Triton
lowering switches to 64-bit offsets itself when an operand exceeds 4 GiB (the full target
can). This is ``torch_kl/kernel.py`` translated line for line.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fused_kl.contract import Options

# The running maxima start here, not at -inf: a tile row that is all padding then keeps
# exp(m - m_new) = 1 and its sum 0, where -inf - -inf would make it NaN.
LOWEST = -3.0e38


def _kl_rows_kernel(
    *refs,
    v: int,
    ignore_index: int,
    inv_t: float,
    inv_tt: float,
    eps: float,
    target_format: str,
    has_labels: bool,
    write_grad: bool,
    tile: tuple[int, int],
):
    scale_ref, *refs = refs
    labels_ref = refs.pop(0) if has_labels else None
    z_ref, t_ref, *refs = refs  # z: this row of the chunk; t: the same row of the full target
    g_ref = refs.pop(0) if write_grad else None  # aliases z
    (loss_ref,) = refs
    # One tile: tile[0] consecutive runs of tile[1] columns; statistics are kept per tile row.
    offs = jnp.arange(tile[0])[:, None] * tile[1] + jnp.arange(tile[1])[None, :]
    block = tile[0] * tile[1]
    if has_labels:
        keep = labels_ref[0] != ignore_index
    else:
        keep = True
    scale = scale_ref[0]
    grad_scale = scale_ref[1]
    neg_inf = -jnp.inf

    # Pass 1: online log-sum-exp of the student (and teacher logits), and S = sum p.
    def pass1(i, carry):
        m, lsum, mt, ltsum, p_sum = carry
        cols = i * block + offs
        mask = cols < v
        z = plgpu.load(z_ref.at[cols], mask=mask, other=neg_inf).astype(jnp.float32) * inv_t
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        lsum = lsum * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        m = m_new
        if target_format == "logits":
            tt = plgpu.load(t_ref.at[cols], mask=mask, other=neg_inf).astype(jnp.float32) * inv_tt
            mt_new = jnp.maximum(mt, jnp.max(tt, axis=1))
            ltsum = ltsum * jnp.exp(mt - mt_new) + jnp.sum(jnp.exp(tt - mt_new[:, None]), axis=1)
            mt = mt_new
        else:
            t = plgpu.load(t_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
            if target_format == "log_probs":
                t = jnp.where(mask, jnp.exp(t), 0.0)
            p_sum += jnp.sum(t, axis=1)
        return m, lsum, mt, ltsum, p_sum

    def full(value):
        return jnp.full((tile[0],), value, jnp.float32)

    n_blocks = pl.cdiv(v, block)
    m, lsum, mt, ltsum, p_sum = jax.lax.fori_loop(
        0, n_blocks, pass1, (full(LOWEST), full(0.0), full(LOWEST), full(0.0), full(0.0))
    )
    m_all = jnp.max(m)
    lse = m_all + jnp.log(jnp.sum(lsum * jnp.exp(m - m_all)))
    if target_format == "logits":
        mt_all = jnp.max(mt)
        lse_t = mt_all + jnp.log(jnp.sum(ltsum * jnp.exp(mt - mt_all)))
        s_p = jnp.float32(1.0)
    else:
        s_p = jnp.sum(p_sum)
    g_scale = jnp.where(keep, grad_scale * inv_t, 0.0)

    # Pass 2: the row's loss, and dL/dz written over the logits.
    def pass2(i, acc):
        cols = i * block + offs
        mask = cols < v
        log_q = plgpu.load(z_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32) * inv_t - lse
        t = plgpu.load(t_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
        if target_format == "probs":
            p = t
            log_p = jnp.log(jnp.maximum(t, eps))
        elif target_format == "log_probs":
            p = jnp.exp(t)
            log_p = t
        else:
            log_p = t * inv_tt - lse_t
            p = jnp.exp(log_p)
        term = jnp.where(p == 0.0, 0.0, p * (log_p - log_q))
        acc += jnp.sum(jnp.where(mask, term, 0.0), axis=1)
        if write_grad:
            g = (jnp.exp(log_q) * s_p - p) * g_scale
            plgpu.store(g_ref.at[cols], g.astype(g_ref.dtype), mask=mask)
        return acc

    acc = jax.lax.fori_loop(0, n_blocks, pass2, full(0.0))
    loss_ref[0] = jnp.where(keep, jnp.sum(acc) * scale, 0.0)


def kl_rows(
    z: jax.Array,
    target: jax.Array,
    labels: jax.Array | None,
    scale: jax.Array,
    row0: int,
    opts: Options,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:
    """Run the kernel on chunk ``z`` (rows ``row0 ...`` of the batch).

    Returns ``(dL/dz in z's buffer or None, the chunk's float32 row losses)``.
    """
    rows, v = z.shape
    kernel = functools.partial(
        _kl_rows_kernel,
        v=v,
        ignore_index=opts.ignore_index,
        inv_t=1.0 / opts.temperature,
        inv_tt=1.0 / opts.teacher_temperature,
        eps=opts.eps,
        target_format=opts.target_format,
        has_labels=labels is not None,
        write_grad=write_grad,
        tile=tile,
    )
    this_row = pl.BlockSpec((None, v), lambda i: (i, 0))
    batch_row = pl.BlockSpec((None, v), lambda i: (i + row0, 0))
    one = pl.BlockSpec((1,), lambda i: (i,))
    in_specs = [pl.BlockSpec((2,), lambda i: (0,))]
    args = [scale]
    if labels is not None:
        in_specs.append(pl.BlockSpec((1,), lambda i: (i + row0,)))
        args.append(labels)
    in_specs += [this_row, batch_row]
    args += [z, target]
    out_shape = [jax.ShapeDtypeStruct((rows,), jnp.float32)]
    out_specs = [one]
    if write_grad:
        out_shape.insert(0, jax.ShapeDtypeStruct(z.shape, z.dtype))
        out_specs.insert(0, this_row)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(rows,),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases={len(args) - 2: 0} if write_grad else {},
        compiler_params=plgpu.CompilerParams(num_warps=8 if tile[0] * tile[1] >= 2048 else 4, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name="fused_kl_rows",
    )(*args)
    return (outs[0], outs[1]) if write_grad else (None, outs[0])
