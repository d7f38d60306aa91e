"""Per-row math between the kernel phases, written once for both frameworks (``xp`` is
``torch`` or ``jax.numpy``; operators and same-named functions only).

The row kernels exchange per-row float32 columns with the driver, laid out as ``fused_kl.rows``
names them:

* ``stats`` (phase 1) gives ``Stats``, combined across vocabulary shards as ``rows.BY_LSE`` and
  ``rows.BY_SUM`` say (:func:`combine_stats`);
* :func:`coefficients` turns them (and reverse KL's or JSD's ``MixtureSums``) into ``Coefs``,
  which ``finish`` (phase 3) reads to write ``dL/dz``;
* :func:`row_losses` assembles each row's loss; :func:`topk` does the top-k teacher's part,
  whose ``[rows, k]`` arrays are too small for a kernel of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from . import terms
from .loss import Loss
from .rows import BY_LSE, BY_SUM, MIXTURE_SUMS, STATS, Coefs, MixtureSums, columns


def reduction_scale(kept: Any, reduction: str, v: int) -> Any:
    """``1/n``, ``1`` or ``1/(n*V)`` from the float32 count of kept rows; 0 when ``n == 0``.

    Operators only, so the same code runs on a torch tensor and a JAX array, on the device
    and without a host sync.
    """
    if reduction == "sum":  # not (kept > 0) * 1.0: JAX types that weakly, and Pallas's lowering
        return kept.clip(max=1.0)  # of a weakly typed kernel operand fails
    denom = kept * v if reduction == "mean" else kept
    return (kept > 0) / (denom + (kept == 0))


def float16_unscale(scale: Any, xp: Any) -> Any:
    """The power of two ``c`` that float16 gradients are stored divided by, and multiplied by after.

    ``dL/dz`` is stored in the logits' dtype. Scaled by ``1/n`` (or ``1/(n*V)``) it falls below
    float16's smallest normal number (2**-14) and loses its precision before the gradient GEMMs,
    as it does in the unfused float16 loss. So float16 chunks store ``dL/dz / c`` with
    ``c = 2**floor(log2(s))`` clamped to ``[2**-14, 1]``, and the gradients are multiplied by
    ``c`` after their GEMMs: exact, since ``c`` is a power of two and a normal float16 number.
    """
    return xp.exp2(xp.clip(xp.floor(xp.log2(scale)), -14.0, 0.0))


class LossWeights(NamedTuple):
    """What a kept row's soft loss, cross-entropy and squared hard log-sum-exp (the z-loss) are
    multiplied by in the total (the reduction and the loss weights; a row's own weight comes on
    top), and ``unscale``, the float16 storage divisor ``c`` of ``dL/dz`` (None unless float16:
    no multiply-by-1 pass over the gradients)."""

    soft: Any
    hard: Any
    z: Any
    unscale: Any


def loss_weights(kept: Any, loss: Loss, v_total: int, float16: bool, xp: Any) -> LossWeights:
    """The :class:`LossWeights` of a call whose kept rows number ``kept`` (float32)."""
    soft = reduction_scale(kept, loss.reduction, v_total) * loss.weight_soft
    hard_side = reduction_scale(kept, "sum" if loss.reduction == "sum" else "batchmean", v_total)
    hard, z = hard_side * loss.weight_hard, hard_side * loss.z_loss
    if not float16:
        return LossWeights(soft, hard, z, None)
    return LossWeights(soft, hard, z, float16_unscale(xp.maximum(soft, xp.maximum(hard, z)), xp))


class RowScales(NamedTuple):
    """Per row, what ``dL/dz`` as stored multiplies (the reduction, the loss weights, the row's
    weight and the float16 divisor; 0 on ignored rows): ``soft`` ``dsoft/da``, ``hard`` ``dhard/df``,
    and ``z`` the z-loss's ``lse_h**2``, whose derivative ``2 lse_h softmax(f)`` needs the row's
    statistics (:func:`z_scale`)."""

    soft: Any
    hard: Any
    z: Any


def _shifted(lses: Any, reduce_max: Callable[[Any], Any], xp: Any) -> tuple[Any, Any]:
    """``(m, exp(lses - m))``: the slices' common max (0 where every slice is empty) and their
    exponentials shifted by it."""
    m = reduce_max(lses)
    safe = xp.where(xp.isfinite(m), m, 0.0)
    return safe, xp.exp(lses - safe)


def combine_lse(lses: Any, reduce_max: Callable[[Any], Any], reduce_sum: Callable[[Any], Any], xp: Any) -> Any:
    """Log-sum-exps of vocabulary slices combined into the whole row's (one max, one sum)."""
    safe, w = _shifted(lses, reduce_max, xp)
    return safe + xp.log(reduce_sum(w))


def combine_stats(stats: Any, reduce_max: Callable[[Any], Any], reduce_sum: Callable[[Any], Any], xp: Any) -> Any:
    """Vocabulary slices' ``Stats`` (last axis) combined into the whole row's with one max and one
    sum (collectives across shards, or reductions over segments): ``rows.BY_LSE`` by a
    log-sum-exp, ``rows.BY_SUM`` by a sum, ``reverse`` by the slices' softmax weights
    ``exp(lse_j - lse)``."""
    lse_at, sum_at, rev = list(BY_LSE), list(BY_SUM), STATS.reverse
    own = BY_LSE.index(STATS.lse)  # the student's log-sum-exp, whose softmax weighs rho
    lses = stats[..., lse_at]
    safe, w = _shifted(lses, reduce_max, xp)
    w0 = w[..., own : own + 1]  # an empty slice (w0 = 0) has no rho: 0, not 0 * NaN
    rho = xp.where(w0 > 0, w0 * (stats[..., rev : rev + 1] + lses[..., own : own + 1] - safe[..., own : own + 1]), 0.0)
    sums = reduce_sum(xp.concatenate([w, stats[..., sum_at], rho], axis=-1))
    n, k = len(lse_at), len(sum_at)
    s0 = sums[..., own : own + 1]
    rho = xp.where(s0 > 0, sums[..., n + k :] / xp.where(s0 > 0, s0, 1.0) - xp.log(s0), 0.0)
    lse = safe + xp.log(sums[..., :n])
    combined = dict(zip(lse_at, (lse[..., j] for j in range(n)), strict=True))
    combined |= dict(zip(sum_at, (sums[..., n + j] for j in range(k)), strict=True))
    combined[rev] = rho[..., 0]
    return xp.stack([combined[at] for at in STATS], -1)


def reverse_sums(stats: Any, loss: Loss, xp: Any) -> Any:
    """Reverse KL's ``MixtureSums`` per row from the combined ``Stats``: ``R`` as the student's
    (JSD's ``B`` with ``m = p``), 0 as the teacher's."""
    r = stats[:, STATS.reverse]
    if loss.teacher.has_logits:  # type: ignore[union-attr]
        r = r + stats[:, STATS.lse_teacher]
    return xp.stack(MixtureSums(teacher=r * 0.0, student=r), -1)


def label_logit(z: Any, y: Any, loss: Loss, gather: Callable[[Any, Any], Any], xp: Any) -> Any:
    """``f(z_y)`` of each row whose label ``y`` lies in this slice of ``z``'s columns, else 0:
    the ``label_logit`` column of ``Stats``. ``gather(z, at)`` is ``z[i, at[i, j]]`` in float32."""
    inside = (y >= 0) & (y < z.shape[1])
    z_y = gather(z, xp.where(inside, y, 0)[:, None])[:, 0]
    return xp.where(inside, terms.transform(z_y, loss.logit_scale, loss.softcap, xp), 0.0)


def grad_scales(keep: Any, row_weight: Any | None, weights: LossWeights, loss: Loss, xp: Any) -> RowScales:
    """The rows' :class:`RowScales`: the row weights fold in here, so ``dL/dz`` and every gradient
    made from it carry them exactly."""
    store = 1.0 if weights.unscale is None else 1.0 / weights.unscale
    w = store if row_weight is None else row_weight * store
    return RowScales(*(xp.where(keep, c * w, 0.0) for c in (weights.soft / loss.temperature, weights.hard, weights.z)))


def z_scale(stats: Any, scales: RowScales) -> Any:
    """The z-loss's factor of ``softmax(f)`` in ``dL/dz``: ``2 c_z lse_h`` (combined ``Stats``)."""
    return 2.0 * scales.z * stats[:, STATS.lse_hard]


def hard_labels(labels: Any | None, keep: Any, loss: Loss, xp: Any) -> Any | None:
    """The labels the kernels' hard side reads: the labels with the cross-entropy; with the z-loss
    alone, a label no column holds (-1, on ``keep``'s device), so no label enters; else None."""
    if not loss.hard:
        return None
    if loss.cross_entropy:
        return labels
    return xp.zeros_like(keep, dtype=xp.int32) - 1


def coefficients(
    stats: Any,
    scales: RowScales,
    soft_sums: Any | None,
    topk_const: Any | None,
    loss: Loss,
    xp: Any,
) -> Any:
    """``Coefs`` per row, from the combined ``Stats``, the rows' :func:`grad_scales`, their
    ``MixtureSums`` (reverse KL: :func:`reverse_sums`; JSD: its ``mixture_sums`` phase) and the
    top-k dense factor."""
    s = columns(STATS, stats)
    kind = loss.kind
    if kind == "forward":
        k = s.mass if loss.teacher.dense_format != "logits" else xp.ones_like(s.mass)  # type: ignore[union-attr]
    elif kind in ("reverse", "jsd"):
        k = soft_sums[:, MIXTURE_SUMS.student]  # type: ignore[index]
    else:
        k = xp.zeros_like(s.mass) if topk_const is None else topk_const
    coefs = Coefs(
        s.lse, s.lse_hard, s.lse_teacher, soft_const=k, soft_scale=scales.soft, hard_scale=scales.hard,
        z_scale=z_scale(stats, scales),
    )  # fmt: skip
    return xp.stack(coefs, -1)


def row_losses(
    stats: Any,
    keep: Any,
    soft_rows: Any,
    row_weight: Any | None,
    weights: LossWeights,
    loss: Loss,
    v_total: int,
    xp: Any,
) -> tuple[Any, Any]:
    """Each row's ``(share of the loss, own loss)``: the share ``r_i (w_soft s soft_i + s_hard
    (w_hard ce_i + z lse_i**2))`` with ``r_i`` its weight, the own loss unweighted and unnormalised,
    ``w_soft soft_i + w_hard ce_i + z lse_i**2``; both 0 if ignored. A kept row with a label
    outside the vocabulary never gets here checked: the eager value check refuses it, and an
    unchecked call's driver makes it NaN (:func:`invalid_rows`, :func:`nan_rows`)."""
    s = columns(STATS, stats)
    zero = s.lse * 0.0
    soft = soft_rows if loss.soft else zero
    ce = zero
    if loss.cross_entropy:
        ls = loss.label_smoothing
        ce = s.lse_hard - (1.0 - ls) * s.label_logit - (ls / v_total) * s.logit_sum
    z_sq = s.lse_hard * s.lse_hard if loss.z_term else zero
    share = soft * weights.soft + ce * weights.hard + z_sq * weights.z
    own = soft * loss.weight_soft + ce * loss.weight_hard + z_sq * loss.z_loss
    share = share if row_weight is None else share * row_weight
    return xp.where(keep, share, 0.0), xp.where(keep, own, 0.0)


def soft_rows(kind: str, soft_sums: Any, beta: float) -> Any:
    """Reverse KL's or JSD's soft loss of each row, from its ``MixtureSums`` (``R``; ``A, B``)."""
    m = columns(MIXTURE_SUMS, soft_sums)
    return m.student if kind == "reverse" else beta * m.teacher + (1.0 - beta) * m.student


def topk(
    z_at: Any,
    local: Any,
    t: Any,
    is_label: Any,
    lses: tuple[Any, Any],
    scales: tuple[Any, Any, Any],
    loss: Loss,
    v_total: int,
    vocab_sum: Callable[[Any], Any],
    xp: Any,
) -> tuple[Any, Any, Any]:
    """The top-k teacher of one chunk: ``(soft loss per row, dense factor K, dL/dz at the k tokens)``.

    ``z_at`` are the student's raw logits at the row's tokens (valid where ``local``: the token
    lies in this vocabulary slice), ``t`` the teacher's log-probabilities (``-inf``: padding, not
    part of the support ``S``),
    ``lses`` the rows' ``(lse, lse_hard)``, ``scales`` their ``(c_soft, c_hard, z_scale)``
    (:func:`grad_scales`, :func:`z_scale`).
    With ``P = sum p`` and ``Q = sum q`` over the tokens, ``dL/da_j = K q_j + (r q_j - p'_j) 1[j in S]``:

      bin          K = P - r Q,  r = p_t / q_t  (p_t = max(1 - P, 0), q_t = 1 - Q; r = 0 if q_t <= eps)
      renormalize  K = sum p^, r = 0, p' = p^ = p / P
      drop         K = P,      r = 0
    """
    teacher = loss.teacher
    eps = teacher.eps  # type: ignore[union-attr]
    tail = teacher.topk_tail  # type: ignore[union-attr]
    lse, lse_h = lses
    soft_scale, hard_scale, z_factor = scales
    f = terms.transform(z_at, loss.logit_scale, loss.softcap, xp)
    log_q = f / loss.temperature - lse[:, None]
    q = xp.where(local, xp.exp(log_q), 0.0)
    in_s = t != float("-inf")  # a NaN log-probability stays in the support, and propagates
    p = xp.exp(t)
    mass = p.sum(-1)
    big_q = vocab_sum(xp.where(in_s, q, 0.0).sum(-1))
    r = mass * 0.0
    if tail == "renormalize":
        p = p / xp.where(mass > 0, mass, 1.0)[:, None]
        k = p.sum(-1)
    elif tail == "drop":
        k = mass
    else:
        p_t = (1.0 - mass).clip(min=0.0)
        q_t = 1.0 - big_q
        r = xp.where(q_t > eps, p_t / xp.where(q_t > eps, q_t, 1.0), 0.0)
        k = mass - r * big_q
    log_p = xp.where(p > 0, xp.log(xp.where(p > 0, p, 1.0)), 0.0)
    soft = vocab_sum(xp.where(local & in_s, p * (log_p - log_q), 0.0).sum(-1))
    if tail == "bin":
        tail_term = p_t * (xp.log(p_t.clip(min=eps)) - xp.log(q_t.clip(min=eps)))
        soft = soft + xp.where(p_t > 0, tail_term, 0.0)
    g = soft_scale[:, None] * (k[:, None] * q + xp.where(in_s, r[:, None] * q - p, 0.0))
    if loss.hard:
        c_hard, c_z = hard_scale[:, None], z_factor[:, None]
        g = g + terms.hard_gradient(f, lse_h[:, None], is_label, c_hard, c_z, loss, v_total, xp)
    g = g * terms.slope(z_at, loss.logit_scale, loss.softcap, xp)
    return soft, k, g


def invalid_rows(
    labels: Any | None, indices: Any | None, keep: Any, loss: Loss, v_total: int, sort: Callable[[Any], Any]
) -> Any | None:
    """The kept rows that the eager value check (``fused_kl.value_checks.check_value_summary``) would
    have refused, for a call whose values went unchecked (``RunOptions.values_checked``): a label
    of the cross-entropy outside ``[0, V)``, a top-k token id outside ``[0, V)`` or repeated within
    its row (``sort`` sorts the last axis; ``[rows, k]`` is small). None when nothing can be wrong.
    The driver makes those rows' losses and gradient scales NaN (:func:`nan_rows`), so the loss and
    every gradient the row touches show it."""
    bad = None
    if labels is not None and loss.cross_entropy:
        bad = (labels < 0) | (labels >= v_total)
    if indices is not None and indices.shape[-1] > 0:
        ordered = sort(indices)
        wrong = (ordered[:, 0] < 0) | (ordered[:, -1] >= v_total) | (ordered[:, 1:] == ordered[:, :-1]).any(-1)
        bad = wrong if bad is None else bad | wrong
    return None if bad is None else keep & bad


def nan_rows(invalid: Any | None, rows: Any, xp: Any) -> Any:
    """``rows`` (a per-row array, or a NamedTuple of them) with NaN at the ``invalid`` rows
    (:func:`invalid_rows`)."""
    if invalid is None:
        return rows
    if isinstance(rows, tuple):
        return type(rows)(*(nan_rows(invalid, r, xp) for r in rows))
    return xp.where(invalid, float("nan"), rows)


class RowPlan(NamedTuple):
    """What a call's rows need before its first chunk: the :class:`LossWeights`, the rows'
    :class:`RowScales` (NaN at the ``invalid`` rows), the rows a compiled call could not check
    (:func:`invalid_rows`, or None) and the labels the kernels' hard side reads (:func:`hard_labels`)."""

    weights: LossWeights
    scales: RowScales
    invalid: Any | None
    hard_labels: Any | None


def row_plan(
    keep: Any, kept: Any, labels: Any | None, row_weight: Any | None, indices: Any | None, loss: Loss,
    values_checked: bool, v_total: int, float16: bool, sort: Callable[[Any], Any], xp: Any,
) -> RowPlan:  # fmt: skip
    """The :class:`RowPlan` of a call: ``keep`` its kept rows, ``kept`` their number over every
    device (float32); both drivers make it here, in one place."""
    weights = loss_weights(kept, loss, v_total, float16, xp)
    invalid = None if values_checked else invalid_rows(labels, indices, keep, loss, v_total, sort)
    scales = nan_rows(invalid, grad_scales(keep, row_weight, weights, loss, xp), xp)
    return RowPlan(weights, scales, invalid, hard_labels(labels, keep, loss, xp))
