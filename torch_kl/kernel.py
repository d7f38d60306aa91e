"""The row kernel in Triton: one chunk of logits in, its row losses and ``dL/dz`` out.

Math, per row ``i`` of the chunk (``z`` the logits, ``t`` the target, all in float32)::

    lse_i   = log sum_j exp(z_ij / T)                   (online per tile row, pass 1)
    log_q   = z / T - lse_i
    p, log_p from t by target_format:
        probs:     p = t,                log_p = log(max(t, eps))
        log_probs: p = exp(t),           log_p = t
        logits:    p = softmax(t / T_t), log_p = t / T_t - lse(t / T_t)   (as lse_i)
    S_i     = sum_j p_ij                                 (pass 1; 1 for logits)
    loss_i  = s * sum_j [p_ij * (log_p_ij - log_q_ij)]   (a term with p_ij == 0 counts 0)
    dL/dz_ij = s * (q_ij * S_i - p_ij) / T               (pass 2, written over z)

``s`` is the reduction scale and ``s_g`` the scale dL/dz is stored at (``s``, or ``s / c``
for float16: see ``fused_kl.plan.float16_unscale``), both read from device memory (no host
sync). Each row is walked in ``[TILE_R, TILE_C]`` tiles (``fused_kl.plan.TILE_COLS``): the
running max and sums are kept per tile row and combined once, after pass 1. Rows whose label
is ``ignore_index`` get ``loss_i = 0`` and ``dL/dz_i = 0``. Offsets into the full target
are 64-bit, since ``N * V`` can exceed 2**31. ``jax_kl/kernel.py`` is the same kernel in
Pallas, line for line.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kl.contract import TARGET_FORMATS, Options

PROBS: tl.constexpr = tl.constexpr(0)
LOG_PROBS: tl.constexpr = tl.constexpr(1)
LOGITS: tl.constexpr = tl.constexpr(2)
# The running maxima start here, not at -inf: a tile row that is all padding then keeps
# exp(m - m_new) = 1 and its sum 0, where -inf - -inf would make it NaN.
LOWEST: tl.constexpr = tl.constexpr(-3.0e38)


@triton.jit
def _kl_rows_kernel(
    z_ptr,
    z_stride,  # [rows, V] chunk logits, overwritten with dL/dz
    t_ptr,
    t_stride_row,
    t_stride_col,  # [N, V] full target
    labels_ptr,
    labels_stride,  # [N] full labels (unused without HAS_LABELS)
    scale_ptr,  # [2] float32: the loss's reduction scale, the stored gradient's scale
    loss_ptr,  # [N] float32 row losses
    row0,
    V,
    ignore_index,
    inv_t,
    inv_tt,
    eps,
    FORMAT: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = row0 + r
    z_row = z_ptr + r * z_stride
    t_row = t_ptr + row * t_stride_row
    # One tile: TILE_R consecutive runs of TILE_C columns; statistics are kept per tile row.
    offs = tl.arange(0, TILE_R)[:, None] * TILE_C + tl.arange(0, TILE_C)[None, :]
    BLOCK: tl.constexpr = TILE_R * TILE_C
    if HAS_LABELS:
        keep = tl.load(labels_ptr + row * labels_stride) != ignore_index
    else:
        keep = True
    scale = tl.load(scale_ptr)
    grad_scale = tl.load(scale_ptr + 1)

    # Pass 1: online log-sum-exp of the student (and teacher logits), and S = sum p.
    m = tl.full([TILE_R], LOWEST, tl.float32)
    lsum = tl.zeros([TILE_R], tl.float32)
    mt = tl.full([TILE_R], LOWEST, tl.float32)
    ltsum = tl.zeros([TILE_R], tl.float32)
    p_sum = tl.zeros([TILE_R], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=1))
        lsum = lsum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        if FORMAT == LOGITS:
            tt = tl.load(t_row + cols * t_stride_col, mask=mask, other=-float("inf")).to(tl.float32) * inv_tt
            mt_new = tl.maximum(mt, tl.max(tt, axis=1))
            ltsum = ltsum * tl.exp(mt - mt_new) + tl.sum(tl.exp(tt - mt_new[:, None]), axis=1)
            mt = mt_new
        else:
            t = tl.load(t_row + cols * t_stride_col, mask=mask, other=0.0).to(tl.float32)
            if FORMAT == LOG_PROBS:
                t = tl.where(mask, tl.exp(t), 0.0)
            p_sum += tl.sum(t, axis=1)
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(lsum * tl.exp(m - m_all), axis=0))
    if FORMAT == LOGITS:
        mt_all = tl.max(mt, axis=0)
        lse_t = mt_all + tl.log(tl.sum(ltsum * tl.exp(mt - mt_all), axis=0))
        s_p = 1.0
    else:
        s_p = tl.sum(p_sum, axis=0)
    g_scale = tl.where(keep, grad_scale * inv_t, 0.0)

    # Pass 2: the row's loss, and dL/dz written over the logits.
    acc = tl.zeros([TILE_R], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        log_q = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t - lse
        t = tl.load(t_row + cols * t_stride_col, mask=mask, other=0.0).to(tl.float32)
        if FORMAT == PROBS:
            p = t
            log_p = tl.log(tl.maximum(t, eps))
        elif FORMAT == LOG_PROBS:
            p = tl.exp(t)
            log_p = t
        else:
            log_p = t * inv_tt - lse_t
            p = tl.exp(log_p)
        term = tl.where(p == 0.0, 0.0, p * (log_p - log_q))
        acc += tl.sum(tl.where(mask, term, 0.0), axis=1)
        if WRITE_GRAD:
            g = (tl.exp(log_q) * s_p - p) * g_scale
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(loss_ptr + row, tl.where(keep, tl.sum(acc, axis=0) * scale, 0.0))


def kl_rows(
    z: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None,
    scale: torch.Tensor,
    row_loss: torch.Tensor,
    row0: int,
    opts: Options,
    tile: tuple[int, int],
    write_grad: bool,
) -> None:
    """Launch the kernel on chunk ``z`` (rows ``row0 ...`` of the batch), in place."""
    rows, v = z.shape
    if rows == 0:
        return
    _kl_rows_kernel[(rows,)](
        z,
        z.stride(0),
        target,
        target.stride(0),
        target.stride(1),
        labels if labels is not None else row_loss,
        labels.stride(0) if labels is not None else 0,
        scale,
        row_loss,
        row0,
        v,
        opts.ignore_index,
        1.0 / opts.temperature,
        1.0 / opts.teacher_temperature,
        opts.eps,
        FORMAT=TARGET_FORMATS.index(opts.target_format),
        HAS_LABELS=labels is not None,
        WRITE_GRAD=write_grad,
        TILE_R=tile[0],
        TILE_C=tile[1],
        num_warps=8 if tile[0] * tile[1] >= 2048 else 4,
    )
