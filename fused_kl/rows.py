"""The per-row columns the row phases hand each other, named once for every backend.

Each layout is a :class:`~typing.NamedTuple` class whose fields are the columns in order; its
instance of offsets (``STATS``, ``COEFS``, ``MIXTURE_SUMS``) says where each column lies in a
``[rows, n]`` float32 array: ``stats[:, STATS.lse]``. The same class holds one value per column
by name (``Coefs(*columns)``, ``xp.stack(Stats(lse=..., ...), -1)``). Every backend takes its
offsets from here: the Triton kernels as compile-time constants (``triton_terms``), the Pallas
kernels and the array code as static Python ints. A new column is one field here.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar


class Stats(NamedTuple):
    """What the ``stats`` phase writes per row, local to its vocabulary slice."""

    lse: Any  # log-sum-exp of the student's a = f(z) / T
    lse_hard: Any  # of f(z): the hard term's, at T = 1
    lse_teacher: Any  # of teacher logits' g(t) / T_t
    mass: Any  # the teacher's sum p (the forward KL on probabilities)
    logit_sum: Any  # sum f(z) (label smoothing's term)
    label_logit: Any  # f(z_y), where the label lies in this slice
    # Reverse KL's sum R = sum q (log q - log p), made online like a log-sum-exp: over a slice of
    # the row, rho = sum softmax(a)_j (a_j - lse - b_j) with b = log p, or for teacher logits
    # their g(t) / T_t (log p before its log-sum-exp, still unknown): R = rho (+ lse_teacher).
    # With a running max m, l = sum exp(a - m) and u = sum exp(a - m) (a - m - b), rho = u / l - log l.
    reverse: Any


class Coefs(NamedTuple):
    """What the ``finish`` phase reads per row (``fused_kl.rowmath.coefficients``)."""

    lse: Any
    lse_hard: Any
    lse_teacher: Any
    soft_const: Any  # K, the row's constant of dsoft/da (``fused_kl.terms.soft_direction``)
    soft_scale: Any  # c_soft: what dsoft/da is multiplied by in dL/dz (``rowmath.grad_scales``)
    hard_scale: Any  # c_hard: what dhard/df is multiplied by
    z_scale: Any  # c_z: the z-loss's factor of softmax(f) (``rowmath.z_scale``)


class MixtureSums(NamedTuple):
    """The second reduction's sums per row (JSD's ``mixture_sums`` phase, with its mixture
    ``m = beta p + (1 - beta) q``; ``fused_kl.terms.jsd_terms``)."""

    teacher: Any  # A = sum p (log p - log m)
    student: Any  # B = sum q (log q - log m); reverse KL's R is B with m = p


Layout = TypeVar("Layout", Stats, Coefs, MixtureSums)


def _offsets(layout: type[Layout]) -> Layout:
    return layout(*range(len(layout._fields)))


STATS = _offsets(Stats)
COEFS = _offsets(Coefs)
MIXTURE_SUMS = _offsets(MixtureSums)

# How vocabulary slices' statistics combine into the whole row's (``rowmath.combine_stats``):
# log-sum-exps by a log-sum-exp, ``reverse`` by the slices' softmax weights, the rest by a sum.
BY_LSE = (STATS.lse, STATS.lse_hard, STATS.lse_teacher)
BY_SUM = tuple(at for at in STATS if at not in BY_LSE and at != STATS.reverse)


def columns(offsets: Layout, a: Any) -> Layout:
    """The columns of ``a`` (``[..., n]``) by name, as ``offsets``' layout places them."""
    return type(offsets)(*(a[..., at] for at in offsets))
