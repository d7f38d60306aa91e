"""The row phases as Triton kernels: one program per row of a chunk of logits.

The math is ``fused_kl.terms``'s docstring, translated to ``tl`` term by term in ``triton_terms``;
``jax_kl/backends/pallas_triton.py`` is the same kernels in Pallas. Three phases, each a kernel,
with the driver's per-row math (and, for a sharded vocabulary, the all-reduces) between them:

* ``stats``: online log-sum-exps of the student (at ``T`` and, for the hard term, at 1) and of
  teacher logits, the teacher's mass ``S = sum p``, ``sum f(z)``, ``f(z_y)`` and, online with
  the student's log-sum-exp, reverse KL's sum (``fused_kl.rows.Stats.reverse``);
* ``mixture_sums`` (JSD): the second reduction, ``A, B``, which needs the student's log-sum-exp first;
* ``finish``: ``dL/dz`` written over the logits, and the forward KL's row sums.

Each reads and writes its per-row columns where ``fused_kl.rows`` places them.

Each row is walked in ``[TILE_R, TILE_C]`` tiles (``fused_kl.plan``): running maxima and sums
are kept per tile row and combined once. Offsets into the teacher are 64-bit (``N * V`` can
exceed 2**31). Float arguments are cast to float32 on entry: ``torch.compile`` passes Python
floats as float64, which would otherwise turn the loop-carried statistics into float64.
At HBM speed these passes are bound by their arithmetic: ``triton_terms`` says how it is kept short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kl import rows
from fused_kl.loss import KINDS, Loss

from .triton_terms import (
    COEFS,
    FORWARD,
    LOG2E,
    LOG_PROBS,
    LOGITS,
    LOWEST,
    MIXTURE_SUMS,
    N_COEFS,
    N_MIXTURE_SUMS,
    N_STATS,
    NO_TEACHER,
    PROBS,
    STATS,
    fast_log,
    log_mix,
    log_softmax,
    lse_of,
    lse_step,
    reverse_part,
    reverse_step,
    scaled,
    slope,
    soft_direction,
    teacher_probs,
    transform,
)

FORMATS = ("probs", "log_probs", "logits")


@triton.jit
def _stats_kernel(
    z_ptr, z_stride, t_ptr, t_stride_r, t_stride_c, y_ptr, out_ptr, V,
    inv_t, scale, cap, inv_tt, t_scale, t_cap, eps,
    FORMAT: tl.constexpr, CAPPED: tl.constexpr, T_CAPPED: tl.constexpr, HARD: tl.constexpr,
    HARD_LSE: tl.constexpr, MASS: tl.constexpr, REV: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    inv_t, scale, cap = tl.cast(inv_t, tl.float32), tl.cast(scale, tl.float32), tl.cast(cap, tl.float32)
    inv_tt, t_scale, t_cap = tl.cast(inv_tt, tl.float32), tl.cast(t_scale, tl.float32), tl.cast(t_cap, tl.float32)
    eps = tl.cast(eps, tl.float32)
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * z_stride
    t_row = t_ptr + r * t_stride_r
    offs = tl.arange(0, TILE_R)[:, None] * TILE_C + tl.arange(0, TILE_C)[None, :]
    BLOCK: tl.constexpr = TILE_R * TILE_C
    m = tl.full([TILE_R], LOWEST, tl.float32)
    s = tl.zeros([TILE_R], tl.float32)
    mh = tl.full([TILE_R], LOWEST, tl.float32)
    sh = tl.zeros([TILE_R], tl.float32)
    mt = tl.full([TILE_R], LOWEST, tl.float32)
    st = tl.zeros([TILE_R], tl.float32)
    mass = tl.zeros([TILE_R], tl.float32)
    f_sum = tl.zeros([TILE_R], tl.float32)
    u = tl.zeros([TILE_R], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.where(mask, scaled(z, scale, cap, inv_t * LOG2E, CAPPED), -float("inf"))
        if FORMAT != NO_TEACHER:
            t = tl.load(t_row + cols * t_stride_c, mask=mask, other=0.0).to(tl.float32)
        if FORMAT == LOGITS:  # the teacher's log2 p before its log-sum-exp
            b = scaled(t, t_scale, t_cap, inv_tt * LOG2E, T_CAPPED)
            mt, st = lse_step(mt, st, tl.where(mask, b, -float("inf")))
        elif FORMAT == LOG_PROBS:
            b = t * LOG2E
        elif FORMAT == PROBS:  # (only reverse KL reads it: dead code otherwise)
            b = fast_log(tl.maximum(t, eps)) * LOG2E
        if REV:
            m, s, u = reverse_step(m, s, u, a, b)
        else:
            m, s = lse_step(m, s, a)
        if HARD_LSE:
            mh, sh = lse_step(mh, sh, tl.where(mask, scaled(z, scale, cap, LOG2E, CAPPED), -float("inf")))
        if HARD:
            f_sum += tl.sum(tl.where(mask, transform(z, scale, cap, CAPPED), 0.0), axis=1)
        if MASS:
            p = t
            if FORMAT == LOG_PROBS:
                p = tl.exp(t)
            mass += tl.sum(tl.where(mask, p, 0.0), axis=1)
    lse = lse_of(m, s)
    lse_h = lse
    if HARD_LSE:
        lse_h = lse_of(mh, sh)
    lse_t = 0.0
    if FORMAT == LOGITS:
        lse_t = lse_of(mt, st)
    label_logit = 0.0
    if HARD:
        y = tl.load(y_ptr + r)
        inside = (y >= 0) & (y < V)
        z_y = tl.load(z_row + tl.where(inside, y, 0)).to(tl.float32)
        label_logit = tl.where(inside, transform(z_y, scale, cap, CAPPED), 0.0)
    rho = 0.0
    if REV:
        rho = reverse_part(m, s, u)
    out = out_ptr + r * N_STATS
    tl.store(out + STATS.value.lse, lse)
    tl.store(out + STATS.value.lse_hard, lse_h)
    tl.store(out + STATS.value.lse_teacher, lse_t)
    tl.store(out + STATS.value.mass, tl.sum(mass, axis=0))
    tl.store(out + STATS.value.logit_sum, tl.sum(f_sum, axis=0))
    tl.store(out + STATS.value.label_logit, label_logit)
    tl.store(out + STATS.value.reverse, rho)


@triton.jit
def _mixture_sums_kernel(
    z_ptr, z_stride, t_ptr, t_stride_r, t_stride_c, stats_ptr, out_ptr, V,
    inv_t, scale, cap, inv_tt, t_scale, t_cap, eps, beta,
    FORMAT: tl.constexpr, CAPPED: tl.constexpr, T_CAPPED: tl.constexpr, TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):  # fmt: skip
    inv_t, scale, cap = tl.cast(inv_t, tl.float32), tl.cast(scale, tl.float32), tl.cast(cap, tl.float32)
    inv_tt, t_scale, t_cap = tl.cast(inv_tt, tl.float32), tl.cast(t_scale, tl.float32), tl.cast(t_cap, tl.float32)
    eps, beta = tl.cast(eps, tl.float32), tl.cast(beta, tl.float32)
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * z_stride
    t_row = t_ptr + r * t_stride_r
    offs = tl.arange(0, TILE_R)[:, None] * TILE_C + tl.arange(0, TILE_C)[None, :]
    BLOCK: tl.constexpr = TILE_R * TILE_C
    lse = tl.load(stats_ptr + r * N_STATS + STATS.value.lse)
    lse_t = tl.load(stats_ptr + r * N_STATS + STATS.value.lse_teacher)
    acc_a = tl.zeros([TILE_R], tl.float32)
    acc_b = tl.zeros([TILE_R], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        q, log_q = log_softmax(z, lse, inv_t, scale, cap, CAPPED)
        t = tl.load(t_row + cols * t_stride_c, mask=mask, other=0.0).to(tl.float32)
        p, log_p = teacher_probs(t, lse_t, inv_tt, t_scale, t_cap, eps, FORMAT, T_CAPPED)
        pos, log_m = log_mix(p, q, beta)
        acc_a += tl.sum(tl.where(mask & (p > 0), p * (log_p - log_m), 0.0), axis=1)
        acc_b += tl.sum(tl.where(mask & pos, q * (log_q - log_m), 0.0), axis=1)
    out = out_ptr + r * N_MIXTURE_SUMS
    tl.store(out + MIXTURE_SUMS.value.teacher, tl.sum(acc_a, axis=0))
    tl.store(out + MIXTURE_SUMS.value.student, tl.sum(acc_b, axis=0))


@triton.jit
def _finish_kernel(
    z_ptr, z_stride, t_ptr, t_stride_r, t_stride_c, y_ptr, coef_ptr, out_ptr, V,
    inv_t, scale, cap, inv_tt, t_scale, t_cap, eps, beta, keep_label, smooth_per_v,
    FORMAT: tl.constexpr, KIND: tl.constexpr, CAPPED: tl.constexpr, T_CAPPED: tl.constexpr,
    HARD: tl.constexpr, HARD_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):  # fmt: skip
    inv_t, scale, cap = tl.cast(inv_t, tl.float32), tl.cast(scale, tl.float32), tl.cast(cap, tl.float32)
    inv_tt, t_scale, t_cap = tl.cast(inv_tt, tl.float32), tl.cast(t_scale, tl.float32), tl.cast(t_cap, tl.float32)
    eps, beta = tl.cast(eps, tl.float32), tl.cast(beta, tl.float32)
    keep_label, smooth_per_v = tl.cast(keep_label, tl.float32), tl.cast(smooth_per_v, tl.float32)
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * z_stride
    t_row = t_ptr + r * t_stride_r
    offs = tl.arange(0, TILE_R)[:, None] * TILE_C + tl.arange(0, TILE_C)[None, :]
    BLOCK: tl.constexpr = TILE_R * TILE_C
    coef = coef_ptr + r * N_COEFS
    lse = tl.load(coef + COEFS.value.lse)
    lse_h = tl.load(coef + COEFS.value.lse_hard)
    lse_t = tl.load(coef + COEFS.value.lse_teacher)
    k = tl.load(coef + COEFS.value.soft_const)
    c_soft = tl.load(coef + COEFS.value.soft_scale)
    c_hard = tl.load(coef + COEFS.value.hard_scale)
    c_z = tl.load(coef + COEFS.value.z_scale)
    live = (c_soft != 0.0) | (c_hard != 0.0) | (c_z != 0.0)  # ignored rows: exactly 0, never NaN
    y = -1
    if HARD:
        y = tl.load(y_ptr + r)
    acc = tl.zeros([TILE_R], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        q, log_q = log_softmax(z, lse, inv_t, scale, cap, CAPPED)
        if FORMAT != NO_TEACHER:
            t = tl.load(t_row + cols * t_stride_c, mask=mask, other=0.0).to(tl.float32)
            p, log_p = teacher_probs(t, lse_t, inv_tt, t_scale, t_cap, eps, FORMAT, T_CAPPED)
        else:
            p = q
            log_p = log_q
        if KIND == FORWARD:
            acc += tl.sum(tl.where(mask & (p != 0.0), p * (log_p - log_q), 0.0), axis=1)
        if WRITE_GRAD:
            g = c_soft * soft_direction(q, log_q, p, log_p, k, beta, KIND)
            if HARD:
                q_hard = q  # at T = 1 the hard term's softmax is the soft term's
                if HARD_LSE:
                    q_hard = log_softmax(z, lse_h, 1.0, scale, cap, CAPPED)[0]
                g += (c_hard + c_z) * q_hard - c_hard * (tl.where(cols == y, keep_label, 0.0) + smooth_per_v)
            g = tl.where(live, g * slope(z, scale, cap, CAPPED), 0.0)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + r, tl.sum(acc, axis=0))


def kernel_floats(loss: Loss) -> dict:
    """The float arguments every kernel takes, and the transform flags."""
    teacher = loss.teacher
    return dict(
        inv_t=1.0 / loss.temperature,
        scale=loss.logit_scale,
        cap=loss.softcap or 1.0,
        inv_tt=1.0 / teacher.temperature if teacher else 1.0,
        t_scale=teacher.logit_scale if teacher else 1.0,
        t_cap=(teacher.softcap or 1.0) if teacher else 1.0,
        CAPPED=loss.softcap is not None,
        T_CAPPED=teacher is not None and teacher.softcap is not None,
    )


def _format(loss: Loss, t: torch.Tensor | None) -> int:
    return NO_TEACHER if t is None else FORMATS.index(loss.teacher.dense_format)  # type: ignore[union-attr]


def _teacher_args(z: torch.Tensor, t: torch.Tensor | None) -> tuple:
    return (z, 0, 0) if t is None else (t, t.stride(0), t.stride(1))


def _launch(tile: tuple[int, int]) -> dict:
    return dict(TILE_R=tile[0], TILE_C=tile[1], num_warps=8 if tile[0] * tile[1] >= 2048 else 4)


def stats(
    z: torch.Tensor, t: torch.Tensor | None, y: torch.Tensor | None, loss: Loss, tile: tuple[int, int]
) -> torch.Tensor:
    """``fused_kl.rows.Stats`` of each row of the chunk (local to this vocabulary slice)."""
    n, v = z.shape
    out = torch.empty(n, len(rows.STATS), dtype=torch.float32, device=z.device)
    if n:
        teacher = t is not None
        fmt, rev = _format(loss, t), teacher and loss.kind == "reverse"
        if fmt == LOGITS and not rev:  # two log-sum-exps a column: half-height tiles ran 12 % faster (H200)
            tile = (max(tile[0] // 2, 1), tile[1])
        _stats_kernel[(n,)](
            z, z.stride(0), *_teacher_args(z, t), out if y is None else y, out, v, **kernel_floats(loss),
            eps=loss.teacher.eps if teacher else 1e-10, FORMAT=fmt, HARD=y is not None,
            HARD_LSE=loss.separate_hard_lse, MASS=teacher and loss.kind == "forward" and not loss.teacher.has_logits,
            REV=rev, **_launch(tile),
        )  # fmt: skip
    return out


def mixture_sums(
    z: torch.Tensor, t: torch.Tensor, stats: torch.Tensor, loss: Loss, tile: tuple[int, int]
) -> torch.Tensor:
    """Phase 2 (JSD): each row's ``fused_kl.rows.MixtureSums``."""
    n, v = z.shape
    out = torch.empty(n, len(rows.MIXTURE_SUMS), dtype=torch.float32, device=z.device)
    if n:
        _mixture_sums_kernel[(n,)](
            z, z.stride(0), *_teacher_args(z, t), stats, out, v, **kernel_floats(loss), eps=loss.teacher.eps,
            beta=loss.beta, FORMAT=_format(loss, t), **_launch(tile),
        )  # fmt: skip
    return out


def finish(
    z: torch.Tensor,
    t: torch.Tensor | None,
    y: torch.Tensor | None,
    coefs: torch.Tensor,
    loss: Loss,
    v_total: int,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Phase 3: ``dL/dz`` written over ``z`` (if ``write_grad``); returns ``(z or None, the rows'
    forward-KL sums)``."""
    n, v = z.shape
    out = torch.empty(n, dtype=torch.float32, device=z.device)
    if n:
        _finish_kernel[(n,)](
            z, z.stride(0), *_teacher_args(z, t), coefs if y is None else y, coefs, out, v, **kernel_floats(loss),
            eps=loss.teacher.eps if loss.teacher else 1e-10, beta=loss.beta, keep_label=1.0 - loss.label_smoothing,
            smooth_per_v=loss.label_smoothing / v_total, FORMAT=_format(loss, t), KIND=KINDS.index(loss.kind),
            HARD=y is not None, HARD_LSE=loss.separate_hard_lse, WRITE_GRAD=write_grad, **_launch(tile),
        )  # fmt: skip
    return (z if write_grad else None), out
