"""The cross-entropy's ``dL/dz`` factored as ``diag(alpha) E``: no pass over the chunk writes it.

With ``a = f(z)`` (the student transform, temperature 1), ``q = softmax(a)`` and ``c_r`` the
row's ``c_hard`` (``fused_kl.rowmath.row_scales``; 0 on ignored rows), the fused cross-entropy's
gradient is ``dL/dz_j = c_r f'(z_j) (q_j - [j = y])``, ``f'(z_j) = logit_scale u_j`` with
``u_j = 1 - (a_j / softcap)^2`` when capped, else 1. With a shift ``s_r`` per row it factors as::

    dL/dz_j = alpha_r E_j,   alpha_r = c_r logit_scale exp(s_r - lse_r)
    E_j     = exp(a_j - s_r) u_j                  (j != y)
    E_y     = (q_y - 1) u_y exp(lse_r - s_r)      (the label's entry, rewritten after the GEMM)

so ``grad_x = diag(alpha) (E W)`` (the product in float32, scaled once) and
``grad_W += E^T (diag(alpha) x)``: the GEMMs read ``E`` where they read ``dL/dz``, and the
``finish`` pass (read the logits, write ``dL/dz``) is gone, as the ``stats`` pass went into the
logits GEMM's epilogue. That epilogue cannot know ``lse_r`` yet, so it writes ``E`` with the
fixed shift ``SHIFT`` in bfloat16, whose range is float32's. The shift is kept only while the
row's maximum ``a`` lies in ``[LO, HI]``: then ``E <= e^(HI - SHIFT)`` sums in float32 without
overflow; the entries it flushes to zero lie more than ``SHIFT - LO + 87`` below the row's
maximum (``q < e^-100``); and ``alpha >= c_r logit_scale e^(SHIFT - HI - log V)`` keeps
``diag(alpha) x`` a normal bfloat16 number for ``c_r logit_scale`` down to about ``1e-8``.
A column tile whose maximum leaves the window takes that maximum as its shift instead;
:func:`settle` rescales the rows holding such tiles to ``s_r`` = the row's maximum (one program per row; the others do
nothing), then writes the label entries and returns ``alpha``. No host synchronisation.

It takes bfloat16 chunks of the cross-entropy alone (no soft term, no label smoothing, no bias):
the other losses' ``dL/dz`` is not a row scale of one exponential (a dense teacher's ``p``, a
second temperature, the smoothing's ``-eps/V``), and float16's range is too narrow for ``E``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kl import rowmath
from fused_kl.loss import Loss

SHIFT: tl.constexpr = tl.constexpr(16.0)
LO: tl.constexpr = tl.constexpr(-40.0)
HI: tl.constexpr = tl.constexpr(56.0)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


def takes(x: torch.Tensor, bias: torch.Tensor | None, loss: Loss) -> bool:
    """Whether a chunk's ``dL/dz`` factors (the module docstring), before the GEMM's own checks."""
    return x.dtype == torch.bfloat16 and bias is None and loss.hard and not loss.soft and loss.label_smoothing == 0.0


@triton.jit
def _exp_tile(f, cap, CAPPED: tl.constexpr):
    """``(E, each row's log-sum-exp, each row's max)`` of a tile of ``a = f(z)`` (``-inf`` past
    the vocabulary): ``exp(a - shift) u`` with the shift ``SHIFT`` on rows whose max lies in the
    window, the max itself on the others."""
    m = tl.max(f, axis=1)
    shift = tl.where((m >= LO) & (m <= HI), SHIFT, m)
    e = tl.exp2(f * LOG2E - (shift * LOG2E)[:, None])
    lse = shift + tl.log(tl.sum(e, axis=1))
    if CAPPED:
        r = f / cap
        e = e * (1.0 - r * r)
    return e, lse, m


@triton.jit
def _repair_kernel(z_ptr, tile_max_ptr, shift_ptr, bad_ptr, rows, V, BN: tl.constexpr):
    """Row ``r`` of ``E`` rescaled to the shift ``shift[r]`` where ``bad[r]``: each column tile
    holds ``exp(a - its shift) u``, its shift told by its max as in :func:`_exp_tile`."""
    r = tl.program_id(0)
    if tl.load(bad_ptr + r) != 0:
        s = tl.load(shift_ptr + r)
        row = z_ptr + r.to(tl.int64) * V
        for start in range(0, V, BN):
            cols = start + tl.arange(0, BN)
            keep = cols < V
            m = tl.load(tile_max_ptr + (start // BN) * rows + r)
            factor = tl.exp(tl.where((m >= LO) & (m <= HI), SHIFT, m) - s)
            v = tl.load(row + cols, mask=keep, other=0.0).to(tl.float32)
            tl.store(row + cols, (v * factor).to(tl.bfloat16), mask=keep)


def combine(parts: torch.Tensor) -> torch.Tensor:
    """``fused_kl.rowmath.STATS`` (local to this vocabulary slice) from the column tiles'
    ``(log-sum-exp, max, f(z_y))``; the soft term's columns repeat the hard term's."""
    lse = rowmath.combine_lse(parts[0], lambda a: a.amax(0), lambda a: a.sum(0), torch)
    zero = torch.zeros_like(lse)
    return torch.stack([lse, lse, zero, zero, zero, parts[2].sum(0)], dim=1)


def settle(
    z: torch.Tensor, tile_max: torch.Tensor, bn: int, stats: torch.Tensor, y: torch.Tensor, c_hard: torch.Tensor,
    loss: Loss,
) -> torch.Tensor:  # fmt: skip
    """Make ``z`` the chunk's ``E`` (rows out of the window rewritten, the label entries written)
    and return ``alpha``; ``stats`` are the rows' combined ``STATS``, ``y`` the local labels."""
    rows, v = z.shape
    bad = ((tile_max < LO.value) | (tile_max > HI.value)).any(0)
    shift = torch.where(bad, tile_max.amax(0), SHIFT.value)
    _repair_kernel[(rows,)](z, tile_max, shift, bad.to(torch.int8), rows, v, BN=bn)
    lse, f_y = stats[:, 1], stats[:, 5]
    inside = (y >= 0) & (y < v)
    at = torch.where(inside, y, 0)[:, None]
    u_y = 1.0 if loss.softcap is None else 1.0 - (f_y / loss.softcap) ** 2
    label = (torch.exp(f_y - lse) - 1.0) * u_y * torch.exp(lse - shift)
    z.scatter_(1, at, torch.where(inside, label, z.gather(1, at)[:, 0].float())[:, None].to(z.dtype))
    return c_hard * loss.logit_scale * torch.exp(shift - lse)
