"""The loss's elementwise terms, written once for every whole-array implementation.

``xp`` is ``torch`` or ``jax.numpy``: only operators and functions both spell alike are used,
so the plain-torch backend, the plain-JAX backend and the Pallas kernels (jnp inside the
kernel) compute the same expressions. The Triton kernels translate them to ``tl``
(``torch_kl/backends/triton_terms.py``). The math, per row, with ``a = f(z) / T``::

    f(z)   = logit_scale * z, then softcap * tanh(. / softcap) if softcap     (student transform)
    log_q  = a - lse(a)                  q = exp(log_q)
    teacher: probs p = t, log_p = log(max(t, eps, TINY)); log_probs p = exp(t), log_p = t;
             logits (and hidden) log_p = g(t) / T_t - lse(g(t) / T_t), g the teacher transform
    soft loss and dsoft/da_j, with K the row's constant:
      forward  sum p (log_p - log_q)                     q_j K - p_j            K = sum p
      reverse  R = sum q (log_q - log_p)                 q_j (log_q_j - log_p_j - R)
      jsd      beta A + (1 - beta) B, m = beta p + (1 - beta) q,
               A = sum p (log_p - log m), B = sum q (log_q - log m)
                                                         (1 - beta) q_j (log_q_j - log m_j - B)
      coef     (top-k teachers, no teacher)              K q_j
    hard (temperature 1): lse(f(z)) - (1 - eps_ls) f(z_y) - eps_ls / V sum_j f(z_j)
                          d/df_j = softmax(f(z))_j - (1 - eps_ls) [j = y] - eps_ls / V
    z-loss:               lse(f(z))**2,   d/df_j = 2 lse(f(z)) softmax(f(z))_j
    dL/dz_j = f'(z_j) (c_soft dsoft/da_j + c_hard dhard/df_j + c_z softmax(f(z))_j)
with ``c_soft = w_soft s / T``, ``c_hard = w_hard s_hard`` and ``c_z = 2 z s_hard lse(f(z))``, times the
row's weight, on kept rows, 0 on ignored ones (``fused_kl.rowmath``).
"""

from __future__ import annotations

from typing import Any

from .loss import Loss, Teacher

# float32's smallest normal number. The logarithms' arguments are clamped here: the GPU kernels'
# approximate lg2 flushes anything smaller to 0 (log -inf), and every backend must agree.
TINY = 1.1754943508222875e-38


def tanh_by_exp(x: Any, xp: Any) -> Any:
    """``tanh(x) = 1 - 2 / (exp(2x) + 1)``, exact at both infinities: the GPU kernels' ``tanh``,
    whose hardware ``tanh.approx`` errs by up to 2^-11 where the approximate ``exp2`` errs by
    about 2^-22 (an absolute error near 1e-7 here, ``cap`` times that on the capped logits)."""
    return 1.0 - 2.0 / (xp.exp(2.0 * x) + 1.0)


def transform(z: Any, scale: float, cap: float | None, xp: Any) -> Any:
    """``scale * z``, then ``cap * tanh(. / cap)`` when capped."""
    s = z * scale
    return s if cap is None else cap * xp.tanh(s / cap)


def slope(z: Any, scale: float, cap: float | None, xp: Any) -> Any:
    """The derivative of :func:`transform` at ``z``."""
    if cap is None:
        return scale
    th = xp.tanh(z * (scale / cap))
    return scale * (1.0 - th * th)


def teacher_log(t: Any, teacher: Teacher, xp: Any) -> Any:
    """``log_p`` of a dense teacher chunk, for logits before their log-sum-exp: ``g(t) / T_t``."""
    fmt = teacher.dense_format
    if fmt == "probs":
        return xp.log(t.clip(min=max(teacher.eps, TINY)))
    if fmt == "log_probs":
        return t
    return transform(t, teacher.logit_scale, teacher.softcap, xp) / teacher.temperature


def teacher_probs(t: Any, teacher: Teacher, lse_t: Any, xp: Any) -> tuple[Any, Any]:
    """``(p, log_p)`` of a dense teacher chunk; ``lse_t`` is used by the logits formats."""
    fmt = teacher.dense_format
    if fmt == "probs":
        return t, teacher_log(t, teacher, xp)
    if fmt == "log_probs":
        return xp.exp(t), t
    log_p = teacher_log(t, teacher, xp) - lse_t
    return xp.exp(log_p), log_p


def forward_term(p: Any, log_p: Any, log_q: Any, xp: Any) -> Any:
    """``p (log_p - log_q)``, 0 where ``p == 0``."""
    return xp.where(p == 0, 0.0, p * (log_p - log_q))


def _log_mix(p: Any, q: Any, beta: float, xp: Any) -> tuple[Any, Any]:
    m = beta * p + (1.0 - beta) * q
    return m > 0, xp.log(m.clip(min=TINY))


def reverse_term(q: Any, log_q: Any, b: Any) -> Any:
    """Reverse KL's summand ``q (log_q - b)`` (``fused_kl.rows.Stats.reverse``: ``b`` is ``log_p`` up
    to the teacher logits' log-sum-exp)."""
    return q * (log_q - b)


def jsd_terms(q: Any, log_q: Any, p: Any, log_p: Any, beta: float, xp: Any) -> tuple[Any, Any]:
    """JSD's second reduction's summands, the ``A`` and ``B`` terms."""
    pos, log_m = _log_mix(p, q, beta, xp)
    a = xp.where(p > 0, p * (log_p - log_m), 0.0)
    b = xp.where(pos, q * (log_q - log_m), 0.0)
    return a, b


def soft_direction(kind: str, q: Any, log_q: Any, p: Any, log_p: Any, k: Any, beta: float, xp: Any) -> Any:
    """``dsoft/da`` of one element, ``k`` the row's constant (see the module docstring)."""
    if kind == "forward":
        return q * k - p
    if kind == "reverse":
        return q * (log_q - log_p - k)
    if kind == "jsd":
        pos, log_m = _log_mix(p, q, beta, xp)
        return xp.where(pos, (1.0 - beta) * q * (log_q - log_m - k), 0.0)
    return q * k


def hard_gradient(
    f: Any, lse_h: Any, is_label: Any, c_hard: Any, c_z: Any, loss: Loss, v_total: int, xp: Any
) -> Any:
    """The hard side's part of ``dL/df``: ``c_hard dhard/df + c_z softmax(f)`` (the z-loss's)."""
    ls = loss.label_smoothing
    return (c_hard + c_z) * xp.exp(f - lse_h) - c_hard * (xp.where(is_label, 1.0 - ls, 0.0) + ls / v_total)
