"""``fused_kl.terms`` translated to ``tl`` term by term, for the Triton kernels
(``triton_phases``, and the logits GEMM's epilogue in ``triton_logits``/``triton_factored``),
with what every kernel shares: the row layout (``fused_kl.rows``) and the online log-sum-exp.

At HBM speed the row passes are bound by their arithmetic, so it is kept short. The scales arrive
at run time (one compiled kernel serves every temperature) and the compiler cannot fold them: the
kernels fold them themselves and work in base 2 (``log2 q = c z - lse2``, one FMA before an
``exp2``). ``tl.log`` expands to about thirty instructions; :func:`fast_log` is the hardware's
approximate ``lg2`` (two), within float32's rounding of the result (docs/design-notes.md, row kernels).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fused_kl import rows, terms

PROBS: tl.constexpr = tl.constexpr(0)
LOG_PROBS: tl.constexpr = tl.constexpr(1)
LOGITS: tl.constexpr = tl.constexpr(2)
NO_TEACHER: tl.constexpr = tl.constexpr(3)
FORWARD: tl.constexpr = tl.constexpr(0)
REVERSE: tl.constexpr = tl.constexpr(1)
JSD: tl.constexpr = tl.constexpr(2)
# The running maxima start here, not at -inf: a tile row that is all padding then keeps
# exp(m - m_new) = 1 and its sum 0, where -inf - -inf would make it NaN.
LOWEST: tl.constexpr = tl.constexpr(-3.0e38)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# float32's smallest normal number: the approximate lg2 flushes anything smaller to 0.
TINY: tl.constexpr = tl.constexpr(terms.TINY)
# The approximate logarithm is CUDA's libdevice; Triton's interpreter (the CPU tests) and ROCm take tl.log.
FAST_LOG: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None)
# The row layout's offsets as compile-time constants: ``STATS.value.lse`` (``.value`` is the one
# attribute of a constexpr global that both the compiler and the interpreter resolve). A constexpr
# global's value is part of the kernels' cache key: a changed layout recompiles them.
STATS: tl.constexpr = tl.constexpr(rows.STATS)
COEFS: tl.constexpr = tl.constexpr(rows.COEFS)
MIXTURE_SUMS: tl.constexpr = tl.constexpr(rows.MIXTURE_SUMS)
N_STATS: tl.constexpr = tl.constexpr(len(rows.STATS))
N_COEFS: tl.constexpr = tl.constexpr(len(rows.COEFS))
N_MIXTURE_SUMS: tl.constexpr = tl.constexpr(len(rows.MIXTURE_SUMS))


@triton.jit
def lse_step(m, s, a, AXIS: tl.constexpr = 1, BASE_E: tl.constexpr = False):
    """The online log-sum-exp: the running max ``m`` and sum ``s`` of ``2**(a - m)`` along ``AXIS``
    after one more block ``a`` (base 2, as the row passes work; ``e**(a - m)`` with ``BASE_E``)."""
    m_new = tl.maximum(m, tl.max(a, axis=AXIS))
    d = a - tl.expand_dims(m_new, AXIS)
    if BASE_E:
        c = tl.exp(m - m_new)
        e = tl.exp(d)
    else:
        c = tl.exp2(m - m_new)
        e = tl.exp2(d)
    return m_new, s * c + tl.sum(e, axis=AXIS)


@triton.jit
def lse_of(m, s):
    """The natural log-sum-exp from the tile rows' base-2 running ``(max, sum)``."""
    m_all = tl.max(m, axis=0)
    return (m_all + tl.log2(tl.sum(s * tl.exp2(m - m_all), axis=0))) * LN2


@triton.jit
def reverse_step(m, s, u, a, b):
    """:func:`lse_step` and reverse KL's ``u = sum 2**(a - m) (a - m - b)`` (base 2;
    ``fused_kl.rows.Stats.reverse``), one exponential an element for both."""
    m_new = tl.maximum(m, tl.max(a, axis=1))
    c = tl.exp2(m - m_new)
    d = a - m_new[:, None]
    e = tl.exp2(d)
    du = tl.sum(tl.where(e > 0, e * (d - b), 0.0), axis=1)
    return m_new, s * c + tl.sum(e, axis=1), c * (u + (m - m_new) * s) + du


@triton.jit
def reverse_part(m, s, u):
    """``rho`` (natural units) from the tile rows' base-2 running ``(m, s, u)``."""
    top = tl.max(m, axis=0)
    c = tl.exp2(m - top)
    total = tl.sum(c * s, axis=0)
    return (tl.sum(c * (u + (m - top) * s), axis=0) / total - tl.log2(total)) * LN2


@triton.jit
def tanh(x):
    """``terms.tanh_by_exp``."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def transform(z, scale, cap, CAPPED: tl.constexpr):
    s = z * scale
    if CAPPED:
        s = cap * tanh(s / cap)
    return s


@triton.jit
def fast_log(x):
    """``log(max(x, TINY))``: ``lg2.approx`` times ln 2 on the GPU, absolute error ~2e-7."""
    x = tl.maximum(x, TINY)
    if FAST_LOG:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def scaled(z, scale, cap, c, CAPPED: tl.constexpr):
    """``c * f(z)``; uncapped, one multiply (``scale * c`` is a scalar)."""
    if CAPPED:
        return c * transform(z, scale, cap, CAPPED)
    else:
        return z * (scale * c)


@triton.jit
def log_softmax(z, lse, inv_t, scale, cap, CAPPED: tl.constexpr):
    """``(q, log q)`` of ``log q = f(z) / T - lse``, through base 2: one FMA before the ``exp2``."""
    log2_q = scaled(z, scale, cap, inv_t * LOG2E, CAPPED) - lse * LOG2E
    return tl.exp2(log2_q), log2_q * LN2


@triton.jit
def slope(z, scale, cap, CAPPED: tl.constexpr):
    if CAPPED:
        th = tanh(z * (scale / cap))
        return scale * (1.0 - th * th)
    else:
        return scale  # a scalar, broadcast: no work per element


@triton.jit
def teacher_probs(t, lse_t, inv_tt, t_scale, t_cap, eps, FORMAT: tl.constexpr, T_CAPPED: tl.constexpr):
    if FORMAT == PROBS:
        p = t
        log_p = fast_log(tl.maximum(t, eps))
    elif FORMAT == LOG_PROBS:
        p = tl.exp(t)
        log_p = t
    else:
        p, log_p = log_softmax(t, lse_t, inv_tt, t_scale, t_cap, T_CAPPED)
    return p, log_p


@triton.jit
def log_mix(p, q, beta):
    m = beta * p + (1.0 - beta) * q
    return m > 0, fast_log(m)


@triton.jit
def soft_direction(q, log_q, p, log_p, k, beta, KIND: tl.constexpr):
    if KIND == FORWARD:
        d = q * k - p
    elif KIND == REVERSE:
        d = q * (log_q - log_p - k)
    elif KIND == JSD:
        pos, log_m = log_mix(p, q, beta)
        d = tl.where(pos, (1.0 - beta) * q * (log_q - log_m - k), 0.0)
    else:
        d = q * k
    return d
