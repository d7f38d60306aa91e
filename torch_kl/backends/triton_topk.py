"""A top-k teacher's ``[rows, k]`` part of a factored chunk in one kernel.

The math is :func:`fused_kl.rowmath.topk`'s (stated there), with :func:`fused_kl.chunk.topk_part`'s
framing: the student's exponents ``a = f(z) / T`` at the teacher's tokens read from ``E``
(``triton_factored.exponents_at``), then per row the masses ``P``, ``Q``, the tail,
the soft loss, the dense factor ``K`` and ``dL/dz`` at the tokens. In torch's eager mode that
chain is about eighty small kernels a chunk; here it is one program a row (at N = 8192 on the
H200, 0.35 ms a step less GPU time; docs/design-notes.md).

It takes the chunks ``triton_factored`` takes (uncapped logits, no label smoothing, the hard term
only at ``T = 1``) whose vocabulary is not split across devices: ``Q`` is then the row's own sum,
with no collective between the sums and ``dL/dz``. A split vocabulary keeps the shared function.
``jax_kl`` has no counterpart: XLA fuses the same chain of ``jax.numpy`` operations itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kl.loss import TOPK_TAILS, Loss

from .triton_factored import Tiles, exponents_at
from .triton_terms import STATS


@triton.jit
def _topk_kernel(
    z_ptr, z_stride, tile_max_ptr, x_ptr, w_ptr, log_p_ptr, idx_ptr, y_ptr, stats_ptr, c_soft_ptr, c_hard_ptr, c_z_ptr,
    soft_ptr, k_ptr, g_ptr, at_ptr, write_ptr, rows, V, H, n_top, stats_stride, temperature, scale, eps,
    TAIL: tl.constexpr, HARD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BK)
    live = i < n_top
    idx = tl.load(idx_ptr + r * n_top + i, mask=live, other=0)
    local = live & (idx >= 0) & (idx < V)
    at = tl.where(local, idx, 0)
    a = exponents_at(
        z_ptr, z_stride, tile_max_ptr, x_ptr, w_ptr, r, at, local, rows, H, scale / temperature, BN, BK, BH
    )
    log_q = a - tl.load(stats_ptr + r * stats_stride + STATS.value.lse)
    q = tl.where(local, tl.exp(log_q), 0.0)
    t = tl.load(log_p_ptr + r * n_top + i, mask=live, other=float("-inf")).to(tl.float32)
    in_s = live & (t != float("-inf"))  # a NaN log-probability stays in, and propagates
    p = tl.exp(t)
    mass = tl.sum(p, axis=0)
    big_q = tl.sum(tl.where(in_s, q, 0.0), axis=0)
    ratio = mass * 0.0
    if TAIL == 1:  # renormalize
        p = p / tl.where(mass > 0, mass, 1.0)
        k = tl.sum(p, axis=0)
    elif TAIL == 2:  # drop
        k = mass
    else:  # bin
        p_t = tl.maximum(1.0 - mass, 0.0)
        q_t = 1.0 - big_q
        ratio = tl.where(q_t > eps, p_t / tl.where(q_t > eps, q_t, 1.0), 0.0)
        k = mass - ratio * big_q
    log_p = tl.where(p > 0, tl.log(tl.where(p > 0, p, 1.0)), 0.0)
    soft = tl.sum(tl.where(local & in_s, p * (log_p - log_q), 0.0), axis=0)
    if TAIL == 0:
        tail = p_t * (tl.log(tl.maximum(p_t, eps)) - tl.log(tl.maximum(q_t, eps)))
        soft += tl.where(p_t > 0, tail, 0.0)
    c_soft = tl.load(c_soft_ptr + r)
    c_hard = tl.load(c_hard_ptr + r)
    c_z = tl.load(c_z_ptr + r)
    g = c_soft * (k * q + tl.where(in_s, ratio * q - p, 0.0))
    if HARD:  # at T = 1: c_hard (softmax(f) - [j = y]) + c_z softmax(f), the z-loss's
        lse_hard = tl.load(stats_ptr + r * stats_stride + STATS.value.lse_hard)
        q_hard = tl.exp(a * temperature - lse_hard)
        g += (c_hard + c_z) * q_hard - c_hard * tl.where(idx == tl.load(y_ptr + r), 1.0, 0.0)
    tl.store(soft_ptr + r, soft)
    tl.store(k_ptr + r, k)
    tl.store(g_ptr + r * n_top + i, g * scale, mask=live)
    tl.store(at_ptr + r * n_top + i, at, mask=live)
    weighed = ((c_soft != 0) | (c_hard != 0) | (c_z != 0)).to(tl.int8)
    tl.store(write_ptr + r * n_top + i, local.to(tl.int8) * weighed, mask=live)


def topk_part(
    z: torch.Tensor,
    tiles: Tiles,
    topk: tuple[torch.Tensor, torch.Tensor],
    y: torch.Tensor | None,
    stats: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    loss: Loss,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_kl.chunk.topk_part`'s ``(soft loss per row, K, columns at, dL/dz there, where
    to write it)`` of a factored chunk whose ``E`` is ``z`` (before ``settle``) and whose whole
    vocabulary is here; ``stats`` the rows' ``Stats``, ``scales`` their ``(c_soft, c_hard, z_scale)``."""
    log_p, idx = (a.contiguous() for a in topk)
    stats = stats.contiguous()
    (rows, n_top), dev = idx.shape, z.device
    soft, k = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(2))
    g = torch.empty(rows, n_top, dtype=torch.float32, device=dev)
    at = torch.empty(rows, n_top, dtype=torch.int64, device=dev)  # scatter's index dtype
    write = torch.empty(rows, n_top, dtype=torch.int8, device=dev)
    teacher = loss.teacher
    assert teacher is not None
    if rows and n_top:
        c_soft, c_hard, c_z = (
            torch.broadcast_to(torch.as_tensor(c, dtype=torch.float32, device=dev), (rows,)).contiguous()
            for c in scales
        )
        _topk_kernel[(rows,)](
            z, z.stride(0), tiles.max, x, weight, log_p, idx, idx if y is None else y, stats, c_soft, c_hard, c_z,
            soft, k, g, at, write, rows, z.shape[1], x.shape[1], n_top, stats.stride(0), loss.temperature,
            loss.logit_scale, teacher.eps, TAIL=TOPK_TAILS.index(teacher.topk_tail), HARD=loss.hard, BN=tiles.width,
            BK=max(16, triton.next_power_of_2(n_top)), BH=128,  # masked past n_top; no 1-wide blocks
        )  # fmt: skip
    return soft, k, at, g, write.view(torch.bool)
