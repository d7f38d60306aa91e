"""The row phases of one chunk, in order, written once for both frameworks' drivers.

``stats`` → the layout's first collective point → (JSD: ``mixture_sums`` → the second) →
the top-k teacher's ``[rows, k]`` part (``rowmath.topk``) → ``finish`` (``dL/dz``) → the rows'
losses. ``phases`` is a backend's module of row kernels, ``layout`` says what the collective
points do, and :class:`ChunkOps` brings the few operations whose spelling differs between
torch and JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import rowmath
from .loss import Loss
from .rows import STATS


@dataclass(frozen=True)
class ChunkOps:
    """``xp`` (torch or jax.numpy); ``gather(z, at)``: ``z[i, at[i, j]]`` in float32;
    ``set_at(g, at, values, mask)``: ``g`` with ``values[i, j]`` written at ``[i, at[i, j]]``
    where ``mask[i, j]`` (those positions are distinct within a row; in place in torch),
    returned; ``f32(a)``: ``a`` in float32; ``materialize(z, values)``: both, ``values`` made
    before ``finish`` overwrites ``z`` (JAX: else XLA recomputes them from ``z`` inside the scatter
    and keeps a copy of ``z`` for it); ``sort(a)``: ``a`` sorted along its last axis."""

    xp: Any
    gather: Callable[[Any, Any], Any]
    set_at: Callable[[Any, Any, Any, Any], Any]
    f32: Callable[[Any], Any]
    materialize: Callable[[Any, Any], tuple[Any, Any]]
    sort: Callable[[Any], Any]


def local_labels(y: Any | None, v0: Any, loss: Loss) -> Any | None:
    """The hard side's labels (``rowmath.hard_labels``) as column indices of this vocabulary
    slice, else None."""
    return y - v0 if loss.hard else None


def stats_teacher(t: Any | None, loss: Loss) -> Any | None:
    """The dense teacher chunk if the ``stats`` phase needs it (``Loss.stats_read_teacher``), else
    None: one pass over the teacher fewer, and the logits GEMM can make the statistics."""
    return t if loss.stats_read_teacher else None


def topk_part(
    logits_at: Callable[[Any, Any], Any],
    topk: tuple[Any, Any],
    y: Any | None,
    scales: tuple[Any, Any, Any],
    v0: Any,
    v_local: int,
    stats: Any,
    loss: Loss,
    v_total: int,
    layout: Any,
    ops: ChunkOps,
) -> tuple[Any, Any, Any, Any, Any]:
    """The top-k teacher's ``[rows, k]`` part of a chunk (``rowmath.topk``): ``(soft loss per
    row, dense factor K, columns at, dL/dz there, where to write it)``. ``logits_at(at, local)``
    gives the student's raw logits at the columns ``at`` of this vocabulary slice of ``v_local``
    columns, valid where ``local``; ``stats`` are the rows' combined ``Stats``, ``scales`` their
    ``(c_soft, c_hard, z_scale)`` (``rowmath.grad_scales``, ``rowmath.z_scale``)."""
    xp = ops.xp
    log_p, idx = topk
    local = (idx >= v0) & (idx < v0 + v_local)
    at = xp.where(local, idx - v0, 0)
    is_label = idx == y[:, None] if loss.hard else False
    soft, k, g_at = rowmath.topk(
        logits_at(at, local), local, ops.f32(log_p), is_label, (stats[:, STATS.lse], stats[:, STATS.lse_hard]), scales,
        loss, v_total, layout.vocab_sum, xp,
    )  # fmt: skip
    weighed = (scales[0] != 0) | (scales[1] != 0) | (scales[2] != 0)
    return soft, k, at, g_at, local & weighed[:, None]


def row_phases(
    z: Any,
    t: Any,
    y: Any | None,
    keep: Any,
    row_weight: Any | None,
    scales: rowmath.RowScales,
    topk: tuple[Any, Any] | None,
    v0: Any,
    v_total: int,
    weights: rowmath.LossWeights,
    loss: Loss,
    layout: Any,
    phases: Any,
    tile: tuple[int, int],
    write_grad: bool,
    ops: ChunkOps,
    local_stats: Any | None = None,
) -> tuple[Any | None, Any, Any]:
    """``(dL/dz or None, the rows' shares of the loss, their own losses)`` of a chunk of logits
    ``z`` (``rowmath.row_losses``): ``t`` its dense teacher (or None), ``y`` its hard side's labels
    (``rowmath.hard_labels``), ``keep`` its kept-row mask, ``row_weight`` its rows' weights (or
    None) and ``scales`` its ``rowmath.grad_scales`` (made once per call: per chunk they would be
    a few more small kernels each), ``topk`` its ``(log-probs, token ids)``;
    ``local_stats``: the ``stats`` phase's result when the logits GEMM already made it."""
    xp = ops.xp
    y_local = local_labels(y, v0, loss)
    if local_stats is None:
        local_stats = phases.stats(z, stats_teacher(t, loss), y_local, loss, tile)
    stats = layout.combine_stats(local_stats)
    kind = loss.kind
    soft_sums = None
    if kind == "jsd":
        soft_sums = layout.vocab_sum(phases.mixture_sums(z, t, stats, loss, tile))  # reads lse, lse_teacher
    elif kind == "reverse":  # R came with the statistics
        soft_sums = rowmath.reverse_sums(stats, loss, xp)
    topk_const = None
    if topk is not None:
        row_scales = (scales.soft, scales.hard, rowmath.z_scale(stats, scales))
        soft, topk_const, at, g_at, write = topk_part(
            lambda at, _: ops.gather(z, at), topk, y, row_scales, v0, z.shape[1], stats, loss, v_total, layout, ops
        )
    coefs = rowmath.coefficients(stats, scales, soft_sums, topk_const, loss, xp)
    if topk is not None and write_grad:
        z, g_at = ops.materialize(z, g_at)
    g = partial = None
    if write_grad or kind == "forward":
        g, partial = phases.finish(z, t, y_local, coefs, loss, v_total, tile, write_grad)
    if kind == "forward":
        soft = layout.vocab_sum(partial)
    elif topk is None:
        soft = rowmath.soft_rows(kind, soft_sums, loss.beta) if loss.soft else None
    if topk is not None and write_grad:
        g = ops.set_at(g, at, g_at, write)
    return g, *rowmath.row_losses(stats, keep, soft, row_weight, weights, loss, v_total, xp)
