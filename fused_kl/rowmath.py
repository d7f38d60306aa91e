"""Per-row math between the kernel phases, written once for both frameworks (``xp`` is
``torch`` or ``jax.numpy``; operators and same-named functions only).

The row kernels exchange per-row float32 columns with the driver:

* ``stats`` (phase 1) gives ``STATS``: three log-sum-exps, combined across vocabulary shards
  with a log-sum-exp, three sums, combined with a sum, and reverse KL's part ``rho`` of the
  slice, combined with the slices' softmax weights (:func:`combine_stats`);
* :func:`coefficients` turns them (and JSD's phase 2 sums) into ``COEFS``, which ``finish``
  (phase 3) reads to write ``dL/dz``;
* :func:`row_losses` assembles each row's loss; :func:`topk` does the top-k teacher's part,
  whose ``[rows, k]`` arrays are too small for a kernel of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import terms
from .loss import Loss

STATS = ("lse", "lse_hard", "lse_teacher", "mass", "logit_sum", "label_logit", "reverse")
N_LSE = 3  # the first three are log-sum-exps
# Reverse KL's sum R = sum q (log q - log p) made in the stats pass, online like a log-sum-exp: over
# a slice of the row, rho = sum softmax(a)_j (a_j - lse - b_j) with b = log p, or for teacher
# logits their g(t) / T_t (log p before its log-sum-exp, still unknown): R = rho (+ lse_teacher).
# With a running max m, l = sum exp(a - m) and u = sum exp(a - m) (a - m - b), rho = u / l - log l.
REVERSE = 6
COEFS = ("lse", "lse_hard", "lse_teacher", "row_const", "soft_scale", "hard_scale")


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


def scales(kept: Any, loss: Loss, v_total: int, float16: bool, xp: Any) -> tuple[Any, Any, Any]:
    """``(soft row weight, hard row weight, c)``: what a kept row's soft and hard losses are
    multiplied by in the total (weights included), and the float16 storage divisor ``c`` of
    ``dL/dz`` (None unless float16: no multiply-by-1 pass over the gradients)."""
    soft = reduction_scale(kept, loss.reduction, v_total) * loss.weight_soft
    hard = reduction_scale(kept, "sum" if loss.reduction == "sum" else "batchmean", v_total) * loss.weight_hard
    if not float16:
        return soft, hard, None
    return soft, hard, float16_unscale(xp.maximum(soft, hard), xp)


def combine_lse(lses: Any, reduce_max: Callable[[Any], Any], reduce_sum: Callable[[Any], Any], xp: Any) -> Any:
    """Log-sum-exps of vocabulary slices combined into the whole row's (one max, one sum)."""
    m = reduce_max(lses)
    safe = xp.where(xp.isfinite(m), m, 0.0)
    return safe + xp.log(reduce_sum(xp.exp(lses - safe)))


def combine_stats(stats: Any, reduce_max: Callable[[Any], Any], reduce_sum: Callable[[Any], Any], xp: Any) -> Any:
    """Vocabulary slices' ``STATS`` (last axis) combined into the whole row's with one max and one
    sum (collectives across shards, or reductions over segments): log-sum-exps by a log-sum-exp,
    sums by a sum, ``reverse`` by the slices' softmax weights ``exp(lse_j - lse)``."""
    n, r = N_LSE, REVERSE
    lses = stats[..., :n]
    m = reduce_max(lses)
    safe = xp.where(xp.isfinite(m), m, 0.0)
    w = xp.exp(lses - safe)
    w0 = w[..., :1]  # an empty slice (w0 = 0) has no rho: 0, not 0 * NaN
    rho = xp.where(w0 > 0, w0 * (stats[..., r:] + lses[..., :1] - safe[..., :1]), 0.0)
    sums = reduce_sum(xp.concatenate([w, stats[..., n:r], rho], axis=-1))
    s0 = sums[..., :1]
    rho = xp.where(s0 > 0, sums[..., r:] / xp.where(s0 > 0, s0, 1.0) - xp.log(s0), 0.0)
    return xp.concatenate([safe + xp.log(sums[..., :n]), sums[..., n:r], rho], axis=-1)


def reverse_sums(stats: Any, loss: Loss, xp: Any) -> Any:
    """Reverse KL's ``(R, 0)`` per row from the combined ``STATS``, in the shape of JSD's phase 2."""
    r = stats[:, REVERSE]
    if loss.teacher.has_logits:  # type: ignore[union-attr]
        r = r + stats[:, 2]
    return xp.stack([r, r * 0.0], -1)


def label_logit(z: Any, y: Any, loss: Loss, gather: Callable[[Any, Any], Any], xp: Any) -> Any:
    """``f(z_y)`` of each row whose label ``y`` lies in this slice of ``z``'s columns, else 0:
    the ``label_logit`` column of ``STATS``. ``gather(z, at)`` is ``z[i, at[i, j]]`` in float32."""
    inside = (y >= 0) & (y < z.shape[1])
    z_y = gather(z, xp.where(inside, y, 0)[:, None])[:, 0]
    return xp.where(inside, terms.transform(z_y, loss.logit_scale, loss.softcap, xp), 0.0)


def row_scales(keep: Any, weights: tuple[Any, Any, Any], loss: Loss, xp: Any) -> tuple[Any, Any]:
    """``(c_soft, c_hard)`` per row: what ``dsoft/da`` and ``dhard/df`` are multiplied by in
    ``dL/dz`` as stored (the float16 divisor included); 0 on ignored rows."""
    soft_w, hard_w, unscale = weights
    store = 1.0 if unscale is None else 1.0 / unscale
    return xp.where(keep, soft_w * store / loss.temperature, 0.0), xp.where(keep, hard_w * store, 0.0)


def coefficients(
    stats: Any,
    scales: tuple[Any, Any],
    value_sums: Any | None,
    topk_const: Any | None,
    loss: Loss,
    xp: Any,
) -> Any:
    """``COEFS`` per row, from the combined ``STATS``, the rows' :func:`row_scales`, the value
    sums (reverse KL: ``R``, :func:`reverse_sums`; JSD: phase 2's ``B``) and the top-k dense factor."""
    kind = loss.kind
    if kind == "forward":
        k = stats[:, 3] if loss.teacher.dense_format != "logits" else xp.ones_like(stats[:, 3])  # type: ignore[union-attr]
    elif kind == "reverse":
        k = value_sums[:, 0]
    elif kind == "jsd":
        k = value_sums[:, 1]
    else:
        k = xp.zeros_like(stats[:, 3]) if topk_const is None else topk_const
    return xp.stack([stats[:, 0], stats[:, 1], stats[:, 2], k, *scales], -1)


def row_losses(
    stats: Any,
    keep: Any,
    labels_ok: Any,
    soft_rows: Any,
    weights: tuple[Any, Any, Any],
    loss: Loss,
    v_total: int,
    xp: Any,
) -> Any:
    """Each row's share of the loss: ``w_soft s soft_i + w_hard s_hard hard_i``, 0 if ignored,
    NaN where a kept label of the hard term lies outside the vocabulary."""
    soft_w, hard_w, _ = weights
    total = soft_rows * soft_w if loss.soft else stats[:, 0] * 0.0
    if loss.hard:
        ls = loss.label_smoothing
        hard = stats[:, 1] - (1.0 - ls) * stats[:, 5] - (ls / v_total) * stats[:, 4]
        total = total + xp.where(labels_ok, hard, float("nan")) * hard_w
    return xp.where(keep, total, 0.0)


def soft_rows(kind: str, value_sums: Any, beta: float) -> Any:
    """Reverse KL's or JSD's soft loss of each row, from its ``value_sums`` (``R``; ``A, B``)."""
    return value_sums[:, 0] if kind == "reverse" else beta * value_sums[:, 0] + (1.0 - beta) * value_sums[:, 1]


def topk(
    z_at: Any,
    local: Any,
    t: Any,
    is_label: Any,
    coefs_lse: tuple[Any, Any],
    scale: tuple[Any, Any],
    loss: Loss,
    v_total: int,
    vocab_sum: Callable[[Any], Any],
    xp: Any,
) -> tuple[Any, Any, Any]:
    """The top-k teacher of one chunk: ``(soft loss per row, dense factor K, dL/dz at the k tokens)``.

    ``z_at`` are the student's raw logits at the row's tokens (valid where ``local``: the token
    lies in this vocabulary slice), ``t`` the teacher's log-probabilities (``-inf``: padding, not
    part of the support ``S``),
    ``coefs_lse`` the rows' ``(lse, lse_hard)``, ``scale`` their :func:`row_scales`.
    With ``P = sum p`` and ``Q = sum q`` over the tokens, ``dL/da_j = K q_j + (r q_j - p'_j) 1[j in S]``:

      bin          K = P - r Q,  r = p_t / q_t  (p_t = max(1 - P, 0), q_t = 1 - Q; r = 0 if q_t <= eps)
      renormalize  K = sum p^, r = 0, p' = p^ = p / P
      drop         K = P,      r = 0
    """
    teacher = loss.teacher
    eps = teacher.eps  # type: ignore[union-attr]
    tail = teacher.topk_tail  # type: ignore[union-attr]
    lse, lse_h = coefs_lse
    soft_scale, hard_scale = scale
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
        g = g + hard_scale[:, None] * terms.hard_direction(f, lse_h[:, None], is_label, loss, v_total, xp)
    g = g * terms.slope(z_at, loss.logit_scale, loss.softcap, xp)
    return soft, k, g
