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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fused_kl.loss import Loss

from .triton_phases import LOWEST, _transform

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
def _tiles_kernel(part_ptr, lse_ptr, shift_ptr, bad_ptr, rows, tiles, BR: tl.constexpr, BT: tl.constexpr):
    """Per row, from the column tiles' log-sum-exps and maxima (``part_ptr``: ``[2, tiles,
    rows]``): the slice's log-sum-exp, the shift ``E`` ends with (``SHIFT``, or the row's max
    where a tile left the window) and whether a tile left it. ``[BT, BR]`` blocks: many tiles
    in flight at once, the rows contiguous."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    live = r < rows
    m_lse = tl.full([BR], LOWEST, tl.float32)
    s = tl.zeros([BR], tl.float32)
    m_max = tl.full([BR], LOWEST, tl.float32)
    bad = tl.zeros([BR], tl.int1)
    for t0 in range(0, tiles, BT):
        t = t0 + tl.arange(0, BT)
        at = t[:, None] * rows + r[None, :]
        keep = (t < tiles)[:, None] & live[None, :]
        lse = tl.load(part_ptr + at, mask=keep, other=LOWEST)
        m = tl.load(part_ptr + tiles * rows + at, mask=keep, other=0.0)
        grown = tl.maximum(m_lse, tl.max(lse, axis=0))
        s = s * tl.exp(m_lse - grown) + tl.sum(tl.exp(lse - grown[None, :]), axis=0)
        m_lse = grown
        m_max = tl.maximum(m_max, tl.max(tl.where(keep, m, LOWEST), axis=0))
        bad = bad | (tl.sum((keep & ((m < LO) | (m > HI))).to(tl.int32), axis=0) > 0)
    tl.store(lse_ptr + r, m_lse + tl.log(s), mask=live)
    tl.store(shift_ptr + r, tl.where(bad, m_max, SHIFT), mask=live)
    tl.store(bad_ptr + r, bad.to(tl.int8), mask=live)


@triton.jit
def _label_logit_kernel(x_ptr, w_ptr, y_ptr, out_ptr, H, V, scale, cap, CAPPED: tl.constexpr, BH: tl.constexpr):
    """``f(x_r . W_y)`` of each row whose label lies in this vocabulary slice, else 0: one dot
    product a row, so the epilogue does not look for the label."""
    r = tl.program_id(0).to(tl.int64)
    y = tl.load(y_ptr + r)
    inside = (y >= 0) & (y < V)
    w_row = w_ptr + tl.where(inside, y, 0).to(tl.int64) * H
    acc = tl.zeros([BH], tl.float32)
    for start in range(0, H, BH):
        cols = start + tl.arange(0, BH)
        keep = cols < H
        acc += tl.load(x_ptr + r * H + cols, mask=keep, other=0.0).to(tl.float32) * tl.load(
            w_row + cols, mask=keep, other=0.0
        ).to(tl.float32)
    f = _transform(tl.sum(acc, axis=0), tl.cast(scale, tl.float32), tl.cast(cap, tl.float32), CAPPED)
    tl.store(out_ptr + r, tl.where(inside, f, 0.0))


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


@triton.jit
def _scale_rows_kernel(src_ptr, alpha_ptr, out_ptr, H, src_stride, out_stride, BH: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    keep = cols < H
    v = tl.load(src_ptr + r * src_stride + cols, mask=keep, other=0.0).to(tl.float32) * tl.load(alpha_ptr + r)
    tl.store(out_ptr + r * out_stride + cols, v.to(out_ptr.dtype.element_ty), mask=keep)


@dataclass(frozen=True)
class Tiles:
    """What ``settle`` needs of the epilogue's column tiles: their row maxima ``[tiles, rows]``,
    their width, and per row ``E``'s final shift and whether a tile left the window."""

    max: torch.Tensor
    width: int
    shift: torch.Tensor
    bad: torch.Tensor


def exp_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, loss: Loss, z: torch.Tensor
) -> tuple[torch.Tensor, Tiles] | None:
    """Write the chunk's ``E`` into ``z`` and return ``(STATS local to this vocabulary slice,
    Tiles)``, ``y`` the local labels; or ``None`` without touching ``z`` when the chunk's
    gradient does not factor or the GEMM does not take these operands."""
    from . import triton_logits  # it imports this module, for the epilogue

    if not (takes(x, bias, loss) and triton_logits.fits(x, weight, bias, z)):
        return None
    parts, width = triton_logits.launch(x, weight, None, y, loss, z, exp=True)
    (rows, h), v = x.shape, weight.shape[0]
    lse, shift, f_y = (torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(3))
    bad = torch.empty(rows, dtype=torch.int8, device=x.device)
    _tiles_kernel[(triton.cdiv(rows, 32),)](parts, lse, shift, bad, rows, parts.shape[1], BR=32, BT=64)
    _label_logit_kernel[(rows,)](
        x, weight, y, f_y, h, v, loss.logit_scale, loss.softcap or 1.0, CAPPED=loss.softcap is not None, BH=512
    )
    zero = torch.zeros_like(lse)
    return torch.stack([lse, lse, zero, zero, zero, f_y], dim=1), Tiles(parts[1], width, shift, bad)


def settle(z: torch.Tensor, tiles: Tiles, stats: torch.Tensor, y: torch.Tensor, c_hard: torch.Tensor, loss: Loss):
    """Make ``z`` the chunk's ``E`` (rows out of the window rescaled, the label entries written)
    and return ``alpha``; ``stats`` are the rows' combined ``STATS``, ``y`` the local labels."""
    rows, v = z.shape
    _repair_kernel[(rows,)](z, tiles.max, tiles.shift, tiles.bad, rows, v, BN=tiles.width)
    lse, f_y, shift = stats[:, 1], stats[:, 5], tiles.shift
    inside = (y >= 0) & (y < v)
    at = torch.where(inside, y, 0)[:, None]
    u_y = 1.0 if loss.softcap is None else 1.0 - (f_y / loss.softcap) ** 2
    label = (torch.exp(f_y - lse) - 1.0) * u_y * torch.exp(lse - shift)
    z.scatter_(1, at, torch.where(inside, label, z.gather(1, at)[:, 0].float())[:, None].to(z.dtype))
    return c_hard * loss.logit_scale * torch.exp(shift - lse)


def scale_rows(src: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = diag(alpha) src`` in ``out``'s dtype, the product in float32 (rows contiguous)."""
    rows, h = src.shape
    if rows:
        grid = (rows, triton.cdiv(h, 1024))
        _scale_rows_kernel[grid](src, alpha, out, h, src.stride(0), out.stride(0), BH=1024)
    return out
