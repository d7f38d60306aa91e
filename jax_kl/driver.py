"""The chunk driver in JAX (mirror of ``torch_kl/driver.py``): per chunk of rows, the logits
GEMM, the teacher's chunk, the row phases with the layout's collective points between them,
and the gradient GEMMs.

The ``[N, V]`` logits never exist: each chunk's logits become its ``dL/dz`` in place and die
before the next chunk's are made. The chunk loop is unrolled at trace time, so every slice is
static and, where the chunk is one array, the kernels read the target where it lies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl import rowmath
from fused_kl.chunk import LabelTerm, VocabPart, row_phases
from fused_kl.loss import Loss
from fused_kl.options import Needs, RunOptions
from fused_kl.plan import plan_chunks

from . import factored as jax_factored
from . import gemm, teachers
from .layout import Layout
from .ops import OPS
from .teachers import TeacherArrays

if TYPE_CHECKING:
    from .backends import Backend


def _add(acc: jax.Array | None, term: jax.Array) -> jax.Array:
    return term if acc is None else acc + term


def forward(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    teacher: TeacherArrays,
    labels: jax.Array | None,
    row_weight: jax.Array | None,
    loss: Loss,
    run: RunOptions,
    layout: Layout,
    needs: Needs,
    backend: Backend,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Loss, the rows' own losses (``rowmath.row_losses``, float32 ``[N]``) and the needed gradients
    of 2-D inputs ``x [N, H]``, ``labels [N]``, ``row_weight [N]`` (float32, or None) and a teacher,
    with the kernels of ``backend``: the entry a bridge calls, ``torch_kl.driver.forward``'s
    signature. A gradient ``needs`` leaves out is None and never made (a frozen head costs no
    ``grad_weight`` GEMM, through a bridge too).
    """
    n, h = x.shape
    v = weight.shape[0]
    v0, v_total = layout.vocab_start(v), v * layout.vocab_shards
    plan = plan_chunks(n, v, x.dtype.itemsize, run.chunk_size, loss.teacher_head)
    vocab_cols = gemm.vocab_parts(v, backend.vocab_parts)

    keep = jnp.ones(n, bool) if labels is None else labels != loss.ignore_index
    kept = layout.batch_sum(jnp.sum(keep, dtype=jnp.float32))
    weights, scales, invalid, hard_labels = rowmath.row_plan(
        keep, kept, labels, row_weight, teacher.indices, loss, run.values_checked, v_total, x.dtype == jnp.float16,
        OPS.sort, jnp,
    )  # fmt: skip
    accum = jnp.dtype(run.accum_dtype) if run.accum_dtype else weight.dtype
    factors = backend.factored is not None and jax_factored.takes(x, bias, loss, layout)
    one_array = gemm.single_array(v, h, vocab_cols, plan.bounds, x.dtype, accum, backend.in_place_grad_weight)
    row_losses, own_losses = [], []
    # Each chunk's rows of grad_x are written into one [N, H] buffer, as torch_kl's driver does:
    # products gathered by a concatenation at the end would all live beside its result.
    grad_x = jnp.zeros_like(x) if needs.x else None
    grad_ws = grad_b = None  # the first chunk makes them (gemm.accumulate)
    # The chunks' label terms of grad_weight (fused_kl.chunk.LabelTerm), its largest entries:
    # summed over every chunk in float32 and rounded into grad_weight once, after the last chunk.
    labels: list[LabelTerm] = []
    done = kept  # what the previous chunk produced last

    def _per_row(start: int, stop: int) -> tuple:
        """The chunk's rows of the per-row inputs: ``(labels, keep, row_weight, RowScales, top-k
        teacher)``, None where absent."""
        return (
            None if hard_labels is None else hard_labels[start:stop],
            keep[start:stop],
            None if row_weight is None else row_weight[start:stop],
            rowmath.RowScales(*(s[start:stop] for s in scales)),
            None if teacher.indices is None else (teacher.target[start:stop], teacher.indices[start:stop]),
        )

    for start, stop in plan.bounds:
        # Start a chunk only once the previous one is done, so XLA cannot hoist the
        # logits GEMMs and keep several [chunk, V] buffers alive at once. grad_x passes the
        # barrier too: its update in place is then ordered after the previous chunk's.
        (xc, hidden, grad_x), _ = lax.optimization_barrier(
            ((x[start:stop], _hidden_rows(loss, teacher, start, stop), grad_x), done)
        )
        y, kept_rows, rw, row_scales, topk = _per_row(start, stop)
        ts = teachers.dense_chunk(loss, teacher, start, stop, hidden, vocab_cols)
        zs = gemm.logits(xc, weight, bias, x.dtype, vocab_cols)
        parts = tuple(
            VocabPart(z, t, c.start, backend.chunk_phases(z, t)) for z, t, c in zip(zs, ts, vocab_cols, strict=True)
        )
        alpha, x_w = None, xc  # a factored chunk's row scale and what grad_weight's GEMM reads with E
        if factors and backend.factors(zs[0]):
            (row_loss, own_loss), fac = jax_factored.chunk(
                parts, xc, weight, y, kept_rows, rw, row_scales, topk, v0, v_total, weights, loss, layout, needs.any
            )  # fmt: skip
            gs, label = (None, None) if fac is None else (fac.e, fac.label)
            if fac is not None:
                alpha, x_w = fac.alpha, fac.scaled_rows(xc) if needs.weight else xc
        else:
            gs, label, row_loss, own_loss = row_phases(
                parts, y, kept_rows, rw, row_scales, topk, v0, v_total, weights, loss, layout, plan.tile, needs.any,
                OPS, label_apart=backend.label_apart,
            )  # fmt: skip
        row_losses.append(row_loss)
        own_losses.append(own_loss)
        done = row_loss
        if needs.x:
            product = gemm.grad_x(gs, weight, x.dtype, vocab_cols, label, alpha)
            grad_x = lax.dynamic_update_slice(grad_x, product, (start, 0))
        if needs.weight:
            grad_ws = gemm.accumulate(grad_ws, gs, x_w, accum, backend.in_place_grad_weight, one_array)
            if label is not None:
                labels.append(label)
        if needs.bias:
            grad_b = _add(grad_b, jnp.concatenate([jnp.sum(g, axis=0, dtype=jnp.float32) for g in gs]))
            if label is not None:
                grad_b = grad_b.at[label.y].add(label.coef)
        if needs.weight or needs.bias:
            done = (grad_ws, grad_b)  # grad_x passes the next barrier itself

    total = jnp.sum(rowmath.nan_rows(invalid, jnp.concatenate(row_losses), jnp)) if row_losses else jnp.float32(0.0)
    rows = rowmath.nan_rows(invalid, jnp.concatenate(own_losses), jnp) if own_losses else jnp.zeros((0,), jnp.float32)
    grad_w = None if grad_ws is None else gemm.join(grad_ws, one_array, backend.in_place_grad_weight)
    if labels:
        together = LabelTerm(*(jnp.concatenate(column) for column in zip(*labels, strict=True)))
        grad_w = gemm.add_label_rows(grad_w, x, together, backend.in_place_label_rows)  # type: ignore[arg-type]
    if not plan.bounds:  # no rows
        grad_w = jnp.zeros((v, h), accum) if needs.weight else None
        grad_b = jnp.zeros((v,), jnp.float32) if needs.bias else None

    def unscaled(grad: jax.Array, dtype) -> jax.Array:
        if weights.unscale is not None:  # float16; exact: a power of two
            grad = grad * weights.unscale.astype(grad.dtype)
        return grad.astype(dtype)

    if grad_x is not None:
        grad_x = unscaled(grad_x, x.dtype)
        if layout.vocab_axis is not None and layout.sum_grad_x:
            grad_x = layout.vocab_sum(grad_x)
    grad_w = None if grad_w is None else unscaled(grad_w, weight.dtype)
    grad_b = None if grad_b is None else unscaled(grad_b, bias.dtype)  # type: ignore[union-attr]
    return total, rows, grad_x, grad_w, grad_b


def _hidden_rows(loss: Loss, teacher: TeacherArrays, start: int, stop: int) -> jax.Array | None:
    """A teacher head's hidden states of the chunk, else None."""
    return teacher.target[start:stop] if loss.teacher is not None and loss.teacher_head else None  # type: ignore[index]
