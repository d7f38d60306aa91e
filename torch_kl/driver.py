"""The chunk driver in PyTorch: per chunk of rows, the logits GEMM, the teacher's chunk, the
row phases with the layout's collective points between them, and the gradient GEMMs.

The ``[N, V]`` logits never exist: one ``[chunk, V]`` buffer is reused for every chunk's
logits and, after the ``finish`` phase, for its ``dL/dz``. ``jax_kl/driver.py`` is the mirror.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fused_kl import factored as factored_math
from fused_kl import rowmath
from fused_kl.chunk import LabelTerm, VocabPart, local_labels, row_phases, topk_part
from fused_kl.loss import Loss
from fused_kl.options import Needs, RunOptions
from fused_kl.plan import padded_row_stride, plan_chunks

from . import gemm, teachers
from .layout import Layout
from .ops import OPS
from .teachers import TeacherArrays

if TYPE_CHECKING:
    from .backends import Backend


@dataclass
class Grads:
    """The gradient buffers being filled, ``None`` where not needed."""

    x: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def chunk_buffer(rows: int, v: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized ``[rows, v]`` buffer whose rows lie ``padded_row_stride(v)`` elements apart:
    the first ``v`` columns of a wider buffer (all of it when ``v`` is aligned). Every GEMM and row
    kernel takes the row stride and no kernel of ours reads the padding, which is zeroed: torch's
    bfloat16 GEMMs on the CPU read a row's padding and multiply it by zeros, so a NaN left there
    would reach the product."""
    wide = torch.empty(rows, padded_row_stride(v), dtype=dtype, device=device)
    wide[:, v:].zero_()
    return wide[:, :v]


class LabelRows:
    """The call's label terms of ``grad_weight`` (``fused_kl.chunk.LabelTerm``), every chunk's
    rows in one ``[N]`` pair, made at the first chunk that has one: a call without pays nothing.
    Their sums are rounded into ``grad_weight`` once, after the last chunk, so that the chunks'
    bfloat16 roundings of the accumulator fall on the small terms alone."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.n, self.device = n, device
        self.term: LabelTerm | None = None

    def put(self, start: int, label: LabelTerm) -> None:
        if self.term is None:
            zeros = [torch.zeros(self.n, dtype=t, device=self.device) for t in (torch.float32, torch.long)]
            self.term = LabelTerm(*zeros)
        stop = start + label.coef.shape[0]
        self.term.coef[start:stop] = label.coef
        self.term.y[start:stop] = label.y


def _allocate(x, weight, needs: Needs, run: RunOptions, has_chunks: bool, out: dict) -> Grads:
    n, h = x.shape
    v, dev = weight.shape[0], x.device
    accum = getattr(torch, run.accum_dtype) if run.accum_dtype else weight.dtype

    def buffer(key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        given = out.get(key)  # the caller's buffer (the bridge hands JAX's this way)
        return given if given is not None and given.dtype == dtype else torch.empty(shape, dtype=dtype, device=dev)

    grad_w = buffer("grad_weight", accum, (v, h)) if needs.weight else None
    if grad_w is not None and not has_chunks:  # otherwise the first chunk's GEMM writes it
        grad_w.zero_()
    return Grads(
        x=buffer("grad_x", x.dtype, (n, h)) if needs.x else None,
        weight=grad_w,
        bias=buffer("grad_bias", torch.float32, (v,)).zero_() if needs.bias else None,
    )


def _factored_chunk(
    backend: Backend, exp: tuple, z, xc, weight, y, y_local, keep, row_weight, scales: rowmath.RowScales, topk,
    v0: int, grads: Grads, start: int, weights, loss: Loss, layout, v_total: int, parts: tuple[slice, ...],
    label_rows: LabelRows,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rows' ``(shares of the loss, own losses)`` of a chunk whose logits GEMM wrote ``E``
    (``exp``: ``exp_logits``'s ``(stats, tiles)``, ``backend.factored``), and its gradients:
    ``grad_x = diag(alpha) (E W)`` with the label's term (``triton_factored``'s docstring),
    ``grad_W += E^T (diag(alpha) x)``; the label's term of ``grad_W`` goes to ``label_rows``."""
    factored = backend.factored
    local_stats, tiles = exp
    stats = layout.combine_stats(local_stats(y_local))
    c_soft, c_hard = scales.soft, scales.hard
    c_z = rowmath.z_scale(stats, scales)  # the z-loss's gradient is a multiple of q: it joins q's factor
    soft, sparse, k = None, None, None  # k: a top-k teacher's rows' K
    if topk is not None:  # the student's logits at the teacher's tokens come from E
        if backend.factored_topk is not None and layout.vocab_group is None:  # the whole part in one kernel
            soft, k, at, g_at, write = backend.factored_topk(
                z, tiles, topk, y, stats, (c_soft, c_hard, c_z), xc, weight, loss
            )  # fmt: skip
        else:  # a collective between its sums
            soft, k, at, g_at, write = topk_part(
                lambda at, inside: factored.logits_at(z, tiles, at, inside, xc, weight, loss),
                topk, y, (c_soft, c_hard, c_z), v0, z.shape[1], stats, loss, v_total, layout, OPS,
            )  # fmt: skip
        sparse = (at, g_at, write)
    q_factor = factored_math.q_factor(c_soft, c_hard, c_z, k, loss, torch)
    losses = rowmath.row_losses(stats, keep, soft, row_weight, weights, loss, v_total, torch)
    if grads.x is None and grads.weight is None:
        return losses
    alpha, label = factored.settle(z, tiles, stats, q_factor, c_hard, y_local, loss, sparse, OPS.set_at)
    if grads.x is not None:
        product = gemm.mm_f32(z, weight, parts)
        factored.scale_rows(product, alpha, grads.x[start : start + z.shape[0]], label, weight)
    if grads.weight is not None:
        scaled = factored.scale_rows(xc, alpha, torch.empty_like(xc))
        gemm.accumulate(grads.weight, z, scaled, start == 0, parts)
        if label is not None:
            label_rows.put(start, label)
    return losses


def _cast_into(value: torch.Tensor, dest: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in ``dtype``, written into ``dest`` when one is given (a no-op if it is ``dest``)."""
    if dest is None:
        return value.to(dtype)
    if dest is not value:
        dest.copy_(value)
    return dest


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher: TeacherArrays,
    labels: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    loss: Loss,
    run: RunOptions,
    layout: Layout,
    needs: Needs,
    backend: Backend,
    *,
    out: dict[str, torch.Tensor] | None = None,
    ready: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss, the rows' own losses (``rowmath.row_losses``, float32 ``[N]``) and the needed gradients
    of 2-D inputs ``x [N, H]``, ``labels [N]``, ``row_weight [N]`` (float32, or None) and a teacher,
    with the kernels of ``backend``: the entry a bridge calls, ``jax_kl.driver.forward``'s
    signature (and torch's two keywords).

    ``out`` may hold preallocated ``loss``/``row_losses``/``grad_x``/``grad_weight``/``grad_bias`` to write into;
    ``ready()``, if given, runs before any kernel reads ``labels`` or the teacher's token ids (it
    raises on invalid values: the eager value check's wait, ``torch_kl.validate.check_values``).
    """
    out = out or {}
    n = x.shape[0]
    v, dev = weight.shape[0], x.device
    v0, v_total = layout.vocab_start(v), v * layout.vocab_shards
    plan = plan_chunks(n, v, x.element_size(), run.chunk_size, loss.teacher_head, blocks=True)
    phases = backend.phases

    rows = plan.chunk_rows if n else 0
    buf = chunk_buffer(rows, v, x.dtype, dev)  # logits, then dL/dz in place
    t_buf = chunk_buffer(plan.block_rows, v, teacher.target.dtype, dev) if loss.teacher_head else None
    fused_logits, factored = backend.fused_logits, backend.factored
    parts = gemm.vocab_parts(v, x.element_size(), backend.split_vocab_gemms)

    def logits(start: int, stop: int) -> tuple:
        """The chunk's logits GEMM, which reads no label nor token id: ``(E's (stats, tiles) if
        factored, stats if the GEMM made them)``; ``stats(y_local)`` completes the statistics,
        reading the labels."""
        xc, z = x[start:stop], buf[: stop - start]
        exp = None if factored is None else factored.exp_logits(xc, weight, bias, loss, z)
        if exp is not None:
            return exp, None
        stats = None if fused_logits is None else fused_logits(xc, weight, bias, loss, z)
        if stats is None:  # the backend has no fused logits GEMM, or not for these operands
            gemm.logits(xc, weight, bias, z, parts)
        return exp, stats

    def teacher_block(start: int, stop: int) -> torch.Tensor | None:
        return teachers.dense_chunk(loss, teacher, start, stop, t_buf, backend.plain_logits, parts)

    # The first chunk's GEMMs (its first teacher block's, then the student's) are queued before
    # the host waits for the eager value check (``ready``) and before the call's small setup
    # kernels: the GPU runs them meanwhile instead of idling until the host launches its next kernel.
    first = None
    if plan.bounds:
        first_block = plan.blocks(*plan.bounds[0])[0]
        first = teacher_block(*first_block), logits(*plan.bounds[0])
    if ready is not None:
        ready()
    keep = torch.ones(n, dtype=torch.bool, device=dev) if labels is None else labels != loss.ignore_index
    kept = layout.batch_sum(keep.sum(dtype=torch.float32))
    weights, scales, invalid, hard_labels = rowmath.row_plan(
        keep, kept, labels, row_weight, teacher.indices, loss, run.values_checked, v_total, x.dtype == torch.float16,
        OPS.sort, torch,
    )  # fmt: skip
    grads = _allocate(x, weight, needs, run, bool(plan.bounds), out)
    row_loss = torch.empty(n, dtype=torch.float32, device=dev)  # each row's share of the loss
    own_loss = out.get("row_losses")
    own_loss = torch.empty(n, dtype=torch.float32, device=dev) if own_loss is None else own_loss
    label_rows = LabelRows(n, dev)
    for start, stop in plan.bounds:
        xc, z = x[start:stop], buf[: stop - start]
        t_first, (exp, stats) = first if start == 0 else (None, logits(start, stop))
        y = None if hard_labels is None else hard_labels[start:stop]
        y_local = local_labels(y, v0, loss)
        rw = None if row_weight is None else row_weight[start:stop]
        topk = None if teacher.indices is None else (teacher.target[start:stop], teacher.indices[start:stop])
        if exp is not None:
            row_loss[start:stop], own_loss[start:stop] = _factored_chunk(
                backend, exp, z, xc, weight, y, y_local, keep[start:stop], rw,
                rowmath.RowScales(*(s[start:stop] for s in scales)), topk, v0, grads, start, weights, loss, layout,
                v_total, parts, label_rows,
            )  # fmt: skip
            continue
        local_stats = None if stats is None else stats(y_local)
        # One block unless a teacher head: its logits are made a block at a time, each block's
        # row phases done (dL/dz written over z) before the next block's GEMM overwrites them.
        labels_of_blocks = []
        for a, b in plan.blocks(start, stop):
            at = slice(a - start, b - start)
            t = t_first if a == 0 else teacher_block(a, b)
            _, label, row_loss[a:b], own_loss[a:b] = row_phases(
                (VocabPart(z[at], t, 0, phases),), None if y is None else y[at], keep[a:b],
                None if rw is None else rw[at],
                rowmath.RowScales(*(s[a:b] for s in scales)),
                None if topk is None else (topk[0][at], topk[1][at]),
                v0, v_total, weights, loss, layout, plan.tile, needs.any, OPS,
                None if local_stats is None else local_stats[at], backend.label_apart,
            )  # fmt: skip
            labels_of_blocks.append(label)
        label = None if labels_of_blocks[0] is None else LabelTerm(*map(torch.cat, zip(*labels_of_blocks, strict=True)))
        if grads.x is not None:
            gemm.grad_x(z, weight, grads.x[start:stop], parts, label)
        if grads.weight is not None:
            gemm.accumulate(grads.weight, z, xc, start == 0, parts)
            if label is not None:
                label_rows.put(start, label)
        if grads.bias is not None:
            grads.bias.add_(z.sum(0, dtype=torch.float32))
            if label is not None:
                grads.bias.index_add_(0, label.y, label.coef)

    if label_rows.term is not None:
        (backend.add_label_rows or gemm.add_label_rows)(grads.weight, x, label_rows.term)
    if invalid is not None:
        row_loss.masked_fill_(invalid, float("nan"))
        own_loss.masked_fill_(invalid, float("nan"))
    total = _cast_into(row_loss.sum(), out.get("loss"), torch.float32)
    unscale = weights.unscale
    if unscale is not None:  # float16; exact: a power of two
        for grad in (grads.x, grads.weight, grads.bias):
            if grad is not None:
                grad.mul_(unscale)
    if grads.x is not None and layout.vocab_group is not None:
        grads.x = _cast_into(layout.vocab_sum(grads.x), grads.x, grads.x.dtype)
    grad_w = None if grads.weight is None else _cast_into(grads.weight, out.get("grad_weight"), weight.dtype)
    grad_b = None if grads.bias is None else _cast_into(grads.bias, out.get("grad_bias"), bias.dtype)  # type: ignore[union-attr]
    return total, own_loss, grads.x, grad_w, grad_b
