"""The row phases with whole-row array ops, written once for the plain backends of both
frameworks (torch's ``"torch"``, JAX's ``"xla"``): the same inputs, outputs and math
(``fused_kl.terms``) as the kernels' online passes, holding a few float32 copies of the chunk,
which the chunk size bounds. :class:`RowOps` brings what torch and JAX spell differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import rowmath, terms
from .chunk import ChunkOps
from .loss import Loss
from .rows import COEFS, STATS, Coefs, MixtureSums, Stats


@dataclass(frozen=True)
class RowOps:
    """``chunk``: the framework's :class:`~fused_kl.chunk.ChunkOps` (``xp``, ``gather``, ``f32``);
    ``lse(a)``: the log-sum-exp of each row, -inf for an empty one; ``teacher_rows(t, shape)``: the
    dense teacher's block of this chunk (``shape``, the logits': its rows, its first columns) in
    float32; ``columns(a)``: ``0 .. a.shape[1] - 1`` on ``a``'s device; ``write(z, g)``: ``dL/dz``
    out in ``z``'s dtype (torch: over ``z``; JAX: a new array)."""

    chunk: ChunkOps
    lse: Callable[[Any], Any]
    teacher_rows: Callable[[Any, tuple[int, int]], Any]
    columns: Callable[[Any], Any]
    write: Callable[[Any, Any], Any]


def _student(z: Any, loss: Loss, ops: RowOps) -> Any:
    return terms.transform(ops.chunk.f32(z), loss.logit_scale, loss.softcap, ops.chunk.xp)


def _teacher(t: Any, shape: tuple[int, int], loss: Loss, lse_t: Any, ops: RowOps) -> tuple[Any, Any]:
    return terms.teacher_probs(ops.teacher_rows(t, shape), loss.teacher, lse_t[:, None], ops.chunk.xp)  # type: ignore[arg-type]


def stats(z: Any, t: Any | None, y: Any | None, loss: Loss, ops: RowOps) -> Any:
    """``fused_kl.rows.Stats`` of each row of the chunk (local to this vocabulary slice)."""
    xp = ops.chunk.xp
    f = _student(z, loss, ops)
    lse = ops.lse(f / loss.temperature)
    lse_h = ops.lse(f) if loss.separate_hard_lse else lse
    lse_t = mass = logit_sum = label_logit = rho = xp.zeros_like(lse)
    if t is not None:
        teacher = loss.teacher
        if teacher.has_logits or loss.kind == "reverse":  # type: ignore[union-attr]
            b = terms.teacher_log(ops.teacher_rows(t, z.shape), teacher, xp)  # type: ignore[arg-type]
        if teacher.has_logits:  # type: ignore[union-attr]
            lse_t = ops.lse(b)
        elif loss.kind == "forward":
            mass = _teacher(t, z.shape, loss, lse_t, ops)[0].sum(-1)
        if loss.kind == "reverse":
            log_q = f / loss.temperature - lse[:, None]
            rho = terms.reverse_term(xp.exp(log_q), log_q, b).sum(-1)
    if y is not None:
        logit_sum = f.sum(-1)
        label_logit = rowmath.label_logit(z, y, loss, ops.chunk.gather, xp)
    return xp.stack(Stats(lse, lse_h, lse_t, mass, logit_sum, label_logit, rho), -1)


def mixture_sums(z: Any, t: Any, stats: Any, loss: Loss, ops: RowOps) -> Any:
    """Phase 2 (JSD): each row's ``fused_kl.rows.MixtureSums``, of ``fused_kl.terms.jsd_terms``."""
    xp = ops.chunk.xp
    log_q = _student(z, loss, ops) / loss.temperature - stats[:, STATS.lse, None]
    p, log_p = _teacher(t, z.shape, loss, stats[:, STATS.lse_teacher], ops)
    a, b = terms.jsd_terms(xp.exp(log_q), log_q, p, log_p, loss.beta, xp)
    return xp.stack(MixtureSums(teacher=a.sum(-1), student=b.sum(-1)), -1)


def finish(
    z: Any, t: Any | None, y: Any | None, coefs: Any, loss: Loss, v_total: int, write_grad: bool, ops: RowOps
) -> tuple[Any | None, Any]:
    """Phase 3: ``(dL/dz or None, the rows' forward-KL sums)``; ``dL/dz`` through ``ops.write``."""
    xp = ops.chunk.xp
    row = Coefs(*(coefs[:, at, None] for at in COEFS))  # each [rows, 1], against the row's columns
    f = _student(z, loss, ops)
    log_q = f / loss.temperature - row.lse
    q = xp.exp(log_q)
    partial = xp.zeros_like(coefs[:, COEFS.lse])
    p = log_p = q
    if t is not None:
        p, log_p = _teacher(t, z.shape, loss, coefs[:, COEFS.lse_teacher], ops)
        if loss.kind == "forward":
            partial = terms.forward_term(p, log_p, log_q, xp).sum(-1)
    if not write_grad:
        return None, partial
    g = row.soft_scale * terms.soft_direction(loss.kind, q, log_q, p, log_p, row.soft_const, loss.beta, xp)
    if loss.hard:
        is_label = ops.columns(f)[None, :] == y[:, None]  # type: ignore[index]
        g = g + terms.hard_gradient(f, row.lse_hard, is_label, row.hard_scale, row.z_scale, loss, v_total, xp)
    live = (row.soft_scale != 0) | (row.hard_scale != 0) | (row.z_scale != 0)  # ignored rows: exactly 0, never NaN
    g = xp.where(live, g * terms.slope(ops.chunk.f32(z), loss.logit_scale, loss.softcap, xp), 0.0)
    return ops.write(z, g), partial
