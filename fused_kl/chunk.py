"""The row phases of one chunk, in order, written once for both frameworks' drivers.

``stats`` → the layout's first collective point → (JSD: ``mixture_sums`` → the second) →
the top-k teacher's ``[rows, k]`` part (``rowmath.topk``) → ``finish`` (``dL/dz``) → the rows'
losses. A chunk's logits come as one or more :class:`VocabPart`, each with its backend's module
of row kernels (``phases``); ``layout`` says what the collective points do, and
:class:`ChunkOps` brings the few operations whose spelling differs between torch and JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import factored, rowmath
from .loss import Loss
from .rows import STATS


@dataclass(frozen=True)
class ChunkOps:
    """``xp`` (torch or jax.numpy); ``gather(z, at)``: ``z[i, at[i, j]]`` in float32;
    ``set_at(g, at, values, mask)``: ``g`` with ``values[i, j]`` written at ``[i, at[i, j]]``
    where ``mask[i, j]`` (those positions are distinct within a row; in place in torch),
    returned; ``f32(a)``: ``a`` in float32; ``materialize(z, values)``: both (``z`` a tuple of
    logits arrays), ``values`` made before ``finish`` overwrites ``z`` (JAX: else XLA may make
    them from ``z`` later, inside a fusion that reads them, and keep a copy of ``z`` for it);
    ``sort(a)``: ``a`` sorted along its last axis."""

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


class LabelTerm(NamedTuple):
    """The hard term's entry at each row's label, kept apart from a chunk's bfloat16 ``dL/dz``:
    ``dL/dz_{r, y_r}`` less what ``dL/dz`` holds there is ``coef_r`` (float32; 0 where the label is
    not in this vocabulary slice, the row is ignored, or a top-k teacher's entry at the label
    holds it); ``y`` the labels as columns of this slice, 0 where ``coef`` is. The drivers add
    ``diag(coef) weight[y]`` to ``grad_x`` in float32 and ``coef_r x_r`` to ``grad_weight[y_r]``
    once, after the last chunk: a row's largest entry then takes no bfloat16 rounding of ``dL/dz``
    nor one of the accumulator per chunk."""

    coef: Any
    y: Any


def label_term(y: Any, v_local: int, c_hard: Any, label_logit: Any, loss: Loss, held: Any | None, xp: Any) -> LabelTerm:
    """The rows' :class:`LabelTerm`: ``-(1 - eps_ls) c_hard f'(z_y)`` (``fused_kl.terms``), with
    ``y`` the local labels of a slice of ``v_local`` columns, ``label_logit`` the rows' ``f(z_y)``
    (``Stats.label_logit``, whence the softcap's slope) and ``held`` where another writer holds
    the label's entry (None: nowhere)."""
    inside = (y >= 0) & (y < v_local)
    if held is not None:
        inside = inside & ~held
    u_y = 1.0 if loss.softcap is None else 1.0 - (label_logit / loss.softcap) ** 2
    coef = -(1.0 - loss.label_smoothing) * loss.logit_scale * u_y * c_hard
    return LabelTerm(xp.asarray(xp.where(inside, coef, 0.0), dtype=xp.float32), xp.where(inside, y, 0))


class VocabPart(NamedTuple):
    """Columns ``start ...`` of this vocabulary slice as one array: their logits ``z`` (``[rows,
    width]``), the dense teacher's same columns ``t`` (as the row kernels take it, or None) and
    the row kernels (``phases``) that run them. A chunk is one part, or (``jax_kl`` at an
    unaligned vocabulary) its aligned columns and the few left, so that each GEMM and kernel
    reads rows of an aligned stride."""

    z: Any
    t: Any
    start: int
    phases: Any


def _in_part(at: Any, part: VocabPart) -> Any:
    return (at >= part.start) & (at < part.start + part.z.shape[1])


def _column_in(at: Any, part: VocabPart, xp: Any) -> Any:
    """``at`` as columns of ``part`` (0 where outside it)."""
    return xp.where(_in_part(at, part), at - part.start, 0)


def part_labels(y: Any | None, parts: Sequence[VocabPart]) -> list:
    """The local labels ``y`` (or None) as columns of each part."""
    return [y if y is None or p.start == 0 else y - p.start for p in parts]


def parts_stats(each: Sequence[Any], xp: Any) -> Any:
    """The parts' ``Stats`` combined into the chunk's, as vocabulary slices' are."""
    if len(each) == 1:
        return each[0]
    return rowmath.combine_stats(xp.stack(each), lambda a: xp.amax(a, 0), lambda a: xp.sum(a, 0), xp)


def gather_parts(parts: Sequence[VocabPart], at: Any, ops: ChunkOps) -> Any:
    """The parts' logits at the chunk's columns ``at`` (``[rows, k]``, in float32)."""
    if len(parts) == 1:
        return ops.gather(parts[0].z, at)
    return sum(ops.xp.where(_in_part(at, p), ops.gather(p.z, _column_in(at, p, ops.xp)), 0.0) for p in parts)


def set_in_parts(arrays: Sequence[Any], parts: Sequence[VocabPart], at: Any, values: Any, write: Any,
                 ops: ChunkOps) -> tuple:  # fmt: skip
    """``arrays`` (one a part, its columns) with ``values`` written at the chunk's columns ``at``
    where ``write``."""
    if len(parts) == 1:
        return (ops.set_at(arrays[0], at, values, write),)
    return tuple(
        ops.set_at(a, _column_in(at, p, ops.xp), values, write & _in_part(at, p))
        for a, p in zip(arrays, parts, strict=True)
    )


def row_phases(
    parts: Sequence[VocabPart],
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
    tile: tuple[int, int],
    write_grad: bool,
    ops: ChunkOps,
    local_stats: Any | None = None,
    label_apart: bool = False,
) -> tuple[tuple[Any, ...] | None, LabelTerm | None, Any, Any]:
    """``(each part's dL/dz, or None; its LabelTerm, or None; the rows' shares of the loss; their
    own losses)`` of a chunk
    whose logits and dense teacher are ``parts`` (``rowmath.row_losses``): ``y`` its hard side's
    labels (``rowmath.hard_labels``), ``keep`` its kept-row mask, ``row_weight`` its rows'
    weights (or None) and ``scales`` its ``rowmath.grad_scales`` (made once per call: per chunk
    they would be a few more small kernels each), ``topk`` its ``(log-probs, token ids)``;
    ``local_stats``: the ``stats`` phase's result when the logits GEMM already made it;
    ``label_apart``: the cross-entropy's label entries are left out of ``dL/dz`` and returned as a
    :class:`LabelTerm` (the caller adds them). The parts' statistics and sums combine as
    vocabulary slices' do, before the layout's."""
    xp = ops.xp
    y_local = local_labels(y, v0, loss)
    ys = part_labels(y_local, parts)
    if local_stats is None:
        each = [p.phases.stats(p.z, stats_teacher(p.t, loss), yp, loss, tile) for p, yp in zip(parts, ys, strict=True)]
        local_stats = parts_stats(each, xp)
    # The statistics hold the label's logit, read from the logits: made before finish overwrites them.
    zs, local_stats = ops.materialize(tuple(p.z for p in parts), local_stats)
    parts = [p._replace(z=z) for p, z in zip(parts, zs, strict=True)]
    stats = layout.combine_stats(local_stats)
    kind = loss.kind
    soft_sums = None
    if kind == "jsd":  # reads lse, lse_teacher
        part_sums = [p.phases.mixture_sums(p.z, p.t, stats, loss, tile) for p in parts]
        soft_sums = layout.vocab_sum(sum(part_sums[1:], part_sums[0]))
    elif kind == "reverse":  # R came with the statistics
        soft_sums = rowmath.reverse_sums(stats, loss, xp)
    topk_const = None
    width = sum(z.shape[1] for z in zs)
    if topk is not None:
        row_scales = (scales.soft, scales.hard, rowmath.z_scale(stats, scales))
        soft, topk_const, at, g_at, write = topk_part(
            lambda at, _: gather_parts(parts, at, ops), topk, y, row_scales, v0, width, stats, loss, v_total, layout,
            ops,
        )  # fmt: skip
    coefs = rowmath.coefficients(stats, scales, soft_sums, topk_const, loss, xp)
    if topk is not None and write_grad:
        zs, g_at = ops.materialize(zs, g_at)
    label = None
    if label_apart and write_grad and loss.cross_entropy:
        held = None if topk is None else factored.label_held(at, write, y_local)
        label = label_term(y_local, width, scales.hard, stats[:, STATS.label_logit], loss, held, xp)
        ys = [xp.full_like(yp, -1) for yp in ys]  # finish's labels: no column matches, the entry is apart
    gs = partial = None
    if write_grad or kind == "forward":
        finished = [
            p.phases.finish(z, p.t, yp, coefs, loss, v_total, tile, write_grad)
            for p, z, yp in zip(parts, zs, ys, strict=True)
        ]
        gs, partials = tuple(g for g, _ in finished), [r for _, r in finished]
        partial = None if partials[0] is None else sum(partials[1:], partials[0])
    if kind == "forward":
        soft = layout.vocab_sum(partial)
    elif topk is None:
        soft = rowmath.soft_rows(kind, soft_sums, loss.beta) if loss.soft else None
    if topk is not None and write_grad:
        gs = set_in_parts(gs, parts, at, g_at, write, ops)
    losses = rowmath.row_losses(stats, keep, soft, row_weight, weights, loss, v_total, xp)
    return (gs if write_grad else None), label, *losses
