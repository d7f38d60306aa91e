"""The chunk driver in JAX (mirror of ``torch_kl/driver.py``): per chunk of rows, the logits
GEMM, the teacher's chunk, the row phases with the layout's collective points between them,
and the gradient GEMMs.

The ``[N, V]`` logits never exist: each chunk's logits become its ``dL/dz`` in place and die
before the next chunk's are made. The chunk loop is unrolled at trace time, so every slice is
static and the kernels read the target where it lies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl import rowmath
from fused_kl.loss import Loss
from fused_kl.options import RunOptions
from fused_kl.plan import plan_chunks

from . import teachers
from .backends import phases_of
from .gemm import dot
from .layout import Layout
from .teachers import TeacherArrays


def _add(acc: jax.Array | None, term: jax.Array) -> jax.Array:
    return term if acc is None else acc + term


def forward(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    teacher: TeacherArrays,
    labels: jax.Array | None,
    loss: Loss,
    run: RunOptions,
    layout: Layout,
    with_grads: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Loss and gradients of 2-D inputs ``x [N, H]``, ``labels [N]`` and a teacher.

    With ``with_grads=False`` only the loss is computed. Gradients nobody uses are dead code
    that XLA removes (a frozen head costs no ``grad_weight`` GEMM).
    """
    n, h = x.shape
    v = weight.shape[0]
    v0, v_total = layout.vocab_start(v), v * layout.vocab_shards
    plan = plan_chunks(n, v, x.dtype.itemsize, run.chunk_size, teachers.buffers(loss))
    phases = phases_of(run.backend)

    keep = jnp.ones(n, bool) if labels is None else labels != loss.ignore_index
    kept = layout.batch_sum(jnp.sum(keep, dtype=jnp.float32))
    weights = rowmath.scales(kept, loss, v_total, x.dtype == jnp.float16, jnp)
    accum = jnp.dtype(run.accum_dtype) if run.accum_dtype else weight.dtype
    row_losses, grad_x_rows = [], []
    grad_w = grad_b = None  # the first chunk's GEMM writes the accumulators: no [V, H] zero fill
    done = kept  # what the previous chunk produced last
    for start, stop in plan.bounds:
        # Start a chunk only once the previous one is done, so XLA cannot hoist the
        # logits GEMMs and keep several [chunk, V] buffers alive at once.
        (xc, hidden), _ = lax.optimization_barrier(((x[start:stop], _hidden_rows(loss, teacher, start, stop)), done))
        if bias is None:
            z = dot(xc, weight, (1, 1), x.dtype)
        else:
            z = (dot(xc, weight, (1, 1), jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
        t = teachers.dense_chunk(loss, teacher, start, stop, hidden)
        g, row_loss = _rows(
            z, t, labels, keep, teacher, start, stop, v0, v_total, weights, loss, layout, phases, plan.tile, with_grads
        )
        row_losses.append(row_loss)
        done = row_loss
        if with_grads:
            grad_x_rows.append(dot(g, weight, (1, 0), x.dtype))
            # XLA (0.11, H200) does not fold this add into the GEMM: each chunk after the first
            # costs a [V, H] product buffer and an add pass (benchmarks/RESULTS.md).
            grad_w = _add(grad_w, dot(g, xc, (0, 0), accum))
            grad_b = _add(grad_b, jnp.sum(g, axis=0, dtype=jnp.float32))
            done = (grad_x_rows[-1], grad_w, grad_b)

    total = jnp.sum(jnp.concatenate(row_losses)) if row_losses else jnp.float32(0.0)
    if not with_grads:
        return total, None, None, None
    grad_x = jnp.concatenate(grad_x_rows) if grad_x_rows else jnp.zeros_like(x)
    if grad_w is None:  # no rows
        grad_w, grad_b = jnp.zeros((v, h), accum), jnp.zeros((v,), jnp.float32)

    def unscaled(grad: jax.Array, dtype) -> jax.Array:
        if weights[2] is not None:  # float16; exact: a power of two
            grad = grad * weights[2].astype(grad.dtype)
        return grad.astype(dtype)

    grad_x = unscaled(grad_x, x.dtype)
    if layout.vocab_axis is not None and layout.sum_grad_x:
        grad_x = layout.vocab_sum(grad_x)
    grad_b = None if bias is None else unscaled(grad_b, bias.dtype)
    return total, grad_x, unscaled(grad_w, weight.dtype), grad_b


def _hidden_rows(loss: Loss, teacher: TeacherArrays, start: int, stop: int) -> jax.Array | None:
    if loss.teacher is None or loss.teacher.format != "hidden" or not loss.soft:
        return None
    return teacher.target[start:stop]  # type: ignore[index]


def _rows(
    z,
    t,
    labels,
    keep,
    teacher,
    start,
    stop,
    v0,
    v_total,
    weights,
    loss: Loss,
    layout: Layout,
    phases,
    tile,
    write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:
    """The row phases of one chunk: ``(dL/dz or None, its row losses)``."""
    keep_c = keep[start:stop]
    y = None if labels is None else labels[start:stop]
    y_local = y - v0 if loss.hard else None
    stats = layout.combine_stats(phases.stats(z, t, y_local, loss, tile))
    kind = loss.kind
    topk = loss.soft and t is None
    value_sums = None
    if kind in ("reverse", "jsd"):
        value_sums = layout.vocab_sum(phases.value(z, t, stats, loss, tile))  # reads lse, lse_teacher
    topk_const = None
    if topk:
        idx = teacher.indices[start:stop]
        local = (idx >= v0) & (idx < v0 + z.shape[1])
        at = jnp.where(local, idx - v0, 0)
        soft, topk_const, g_at = rowmath.topk(
            jnp.take_along_axis(z, at, axis=1).astype(jnp.float32),
            local,
            teacher.target[start:stop].astype(jnp.float32),
            idx == y[:, None] if loss.hard else False,
            (stats[:, 0], stats[:, 1]),
            rowmath.row_scales(keep_c, weights, loss, jnp),
            loss,
            v_total,
            layout.vocab_sum,
            jnp,
        )
    coefs = rowmath.coefficients(stats, keep_c, value_sums, topk_const, weights, loss, jnp)
    g = partial = None
    if write_grad or kind == "forward":
        g, partial = phases.finish(z, t, y_local, coefs, loss, v_total, tile, write_grad)
    if kind == "forward":
        soft = layout.vocab_sum(partial)
    elif not topk:
        soft = rowmath.soft_rows(kind, value_sums, None, loss.beta) if loss.soft else None
    if topk and write_grad:
        live = (coefs[:, 4:5] != 0) | (coefs[:, 5:6] != 0)
        delta = jnp.where(local & live, g_at - jnp.take_along_axis(g, at, axis=1).astype(jnp.float32), 0.0)
        g = g.at[jnp.arange(g.shape[0])[:, None], at].add(delta.astype(g.dtype))
    labels_ok = True if y is None else (y >= 0) & (y < v_total)
    return g, rowmath.row_losses(stats, keep_c, labels_ok, soft, weights, loss, v_total, jnp)
