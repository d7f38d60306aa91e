"""``dL/dz`` factored as ``diag(alpha) E`` plus a few entries a row: no pass over the chunk writes it.

The math, the window of row maxima that keep ``E``'s fixed shift and which chunks factor are
``fused_kl.factored``'s. Here the fused cross-entropy's gradient and a top-k teacher's
(``fused_kl.rowmath.topk``: ``c_soft f'(z_j) K q_j`` off the teacher's tokens, plus the hard
term's at ``T = 1``) are factored; the teacher's tokens' ``E_j`` are rewritten after the GEMM as
``dL/dz_j / alpha_r`` (the label's term with them where the label is one of them). The GEMMs
read ``E`` where they would read ``dL/dz``, so no ``finish`` pass (read the logits, write
``dL/dz``) runs, and the ``stats`` pass is the logits GEMM's epilogue. The label's term ``d_r``
is kept apart because it is the largest entry of a row, near ``-c_hard``: written into ``E`` as
``dL/dz_y / alpha_r`` it takes bfloat16's rounding at a mantissa ``alpha`` makes arbitrary, and
``grad_weight``'s error against float64 doubles (docs/design-notes.md); ``grad_W_y += sum_r d_r
x_r`` is summed over the rows of each label in float32 over every chunk and rounded once after
the last (:func:`add_label_rows`), so that the chunks' roundings of ``grad_W`` fall on ``E``'s
small terms alone.

The logits GEMM's epilogue sees one column tile at a time: a tile whose maximum leaves the
window takes that maximum as its shift instead, and :func:`settle` rescales the rows holding
such tiles to ``s_r`` = the row's maximum (one program a row; the others do nothing). No host
synchronisation. The top-k teacher's math needs the logits at its tokens: ``log E`` plus the
shift gives them back (closer than bfloat16 logits), and a dot product where ``E`` flushed to
zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fused_kl import factored
from fused_kl.chunk import LabelTerm, label_term
from fused_kl.loss import Loss
from fused_kl.rows import STATS, Stats

from . import triton_logits
from .triton_exp import EXP_PARTS, EXP_PARTS_AT, HI, LO, SHIFT
from .triton_terms import LOWEST, lse_step, transform


def takes(x: torch.Tensor, bias: torch.Tensor | None, loss: Loss) -> bool:
    """Whether a chunk's ``dL/dz`` factors (``fused_kl.factored.takes``, top-k teachers
    included), before the GEMM's own checks."""
    return factored.takes(x.dtype == torch.bfloat16, bias is not None, loss, topk=True)


@triton.jit
def _tiles_kernel(part_ptr, lse_ptr, shift_ptr, bad_ptr, rows, tiles, BR: tl.constexpr, BT: tl.constexpr):
    """Per row, from the column tiles' log-sum-exps and maxima (``part_ptr``: ``triton_exp.ExpParts``): the
    slice's log-sum-exp, the shift ``E`` ends with (``SHIFT``, or the row's max
    where a tile left the window) and whether a tile left it. ``[BT, BR]`` blocks: many tiles
    in flight at once, the rows contiguous."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    live = r < rows
    m_lse = tl.full([BR], LOWEST, tl.float32)  # the tiles' log-sum-exps combined online, in base e
    s = tl.zeros([BR], tl.float32)
    m_max = tl.full([BR], LOWEST, tl.float32)
    bad = tl.zeros([BR], tl.int1)
    for t0 in range(0, tiles, BT):
        t = t0 + tl.arange(0, BT)
        at = t[:, None] * rows + r[None, :]
        keep = (t < tiles)[:, None] & live[None, :]
        lse = tl.load(part_ptr + EXP_PARTS_AT.value.lse * tiles * rows + at, mask=keep, other=LOWEST)
        m = tl.load(part_ptr + EXP_PARTS_AT.value.row_max * tiles * rows + at, mask=keep, other=0.0)
        m_lse, s = lse_step(m_lse, s, lse, AXIS=0, BASE_E=True)
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
    f = transform(tl.sum(acc, axis=0), tl.cast(scale, tl.float32), tl.cast(cap, tl.float32), CAPPED)
    tl.store(out_ptr + r, tl.where(inside, f, 0.0))


@triton.jit
def _repair_kernel(z_ptr, tile_max_ptr, shift_ptr, flag_ptr, rows, V, z_stride, BN: tl.constexpr):
    """Row ``r`` of ``E`` rescaled to the shift ``shift[r]`` where ``flag[r]`` is 1, zeroed where
    it is 2: each column tile holds ``exp(a - its shift) u``, its shift told by its max as in
    :func:`exp_tile`."""
    r = tl.program_id(0)
    flag = tl.load(flag_ptr + r)
    if flag != 0:
        s = tl.load(shift_ptr + r)
        kept = tl.where(flag == 2, 0.0, 1.0)
        row = z_ptr + r.to(tl.int64) * z_stride
        for start in range(0, V, BN):
            cols = start + tl.arange(0, BN)
            keep = cols < V
            m = tl.load(tile_max_ptr + (start // BN) * rows + r)
            factor = tl.exp(tl.where((m >= LO) & (m <= HI), SHIFT, m) - s) * kept
            v = tl.load(row + cols, mask=keep, other=0.0).to(tl.float32)
            tl.store(row + cols, (v * factor).to(tl.bfloat16), mask=keep)


@triton.jit
def exponents_at(z_ptr, z_stride, tile_max_ptr, x_ptr, w_ptr, r, at, keep, rows, H, x_to_a, BN: tl.constexpr,
                 BK: tl.constexpr, BH: tl.constexpr):  # fmt: skip
    """Row ``r``'s exponents ``a = f(z) / T`` at the columns ``at`` (where ``keep``): ``log E`` plus
    the column tile's shift (``E``'s rounding moves them by at most ``2**-9``), or ``x_to_a (x_r .
    W_j)`` where ``E`` flushed to zero (rare: ``a`` far below the shift)."""
    e = tl.load(z_ptr + r * z_stride + at, mask=keep, other=1.0).to(tl.float32)
    m = tl.load(tile_max_ptr + (at // BN) * rows + r, mask=keep, other=0.0)
    a = tl.log(e) + tl.where((m >= LO) & (m <= HI), SHIFT, m)
    flushed = keep & (e == 0.0)
    if tl.sum(flushed.to(tl.int32), axis=0) > 0:
        dot = tl.zeros([BK], tl.float32)
        for start in range(0, H, BH):
            cols = start + tl.arange(0, BH)
            xv = tl.load(x_ptr + r * H + cols, mask=cols < H, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + at[:, None].to(tl.int64) * H + cols[None, :],
                         mask=flushed[:, None] & (cols < H)[None, :], other=0.0).to(tl.float32)  # fmt: skip
            dot += tl.sum(wv * xv[None, :], axis=1)
        a = tl.where(flushed, dot * x_to_a, a)
    return a


@triton.jit
def _logits_at_kernel(
    z_ptr, z_stride, tile_max_ptr, at_ptr, inside_ptr, x_ptr, w_ptr, out_ptr, rows, H, n_at, t_over_scale,
    BN: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """The raw logits ``z[r, at[r, i]] = a T / logit_scale`` where ``inside`` (:func:`exponents_at`)."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BK)
    keep = (i < n_at) & (tl.load(inside_ptr + r * n_at + i, mask=i < n_at, other=0) != 0)
    at = tl.load(at_ptr + r * n_at + i, mask=keep, other=0)
    a = exponents_at(z_ptr, z_stride, tile_max_ptr, x_ptr, w_ptr, r, at, keep, rows, H, 1.0 / t_over_scale, BN, BK, BH)
    tl.store(out_ptr + r * n_at + i, a * t_over_scale, mask=i < n_at)


@triton.jit
def _scale_rows_kernel(
    src_ptr, alpha_ptr, out_ptr, coef_ptr, y_ptr, w_ptr, H, src_stride, out_stride, LABEL: tl.constexpr,
    BH: tl.constexpr,
):  # fmt: skip
    """``out_r = alpha_r src_r`` (plus ``coef_r W_{y_r}`` with ``LABEL``), in float32, rounded once."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    keep = cols < H
    v = tl.load(src_ptr + r * src_stride + cols, mask=keep, other=0.0).to(tl.float32) * tl.load(alpha_ptr + r)
    if LABEL:
        coef = tl.load(coef_ptr + r).to(tl.float32)
        if coef != 0.0:
            w_row = w_ptr + tl.load(y_ptr + r).to(tl.int64) * H
            v += coef * tl.load(w_row + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * out_stride + cols, v.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _run_sum(k1, v1, k2, v2):
    """The segmented scan's step: a row's value adds the rows before it of the same key. Not
    associative for any keys, but it is on a tile's: its label keys sorted (each label's rows
    contiguous), the rows that add nothing (key ``V``) carrying zeros and never written."""
    return k2, tl.where(k1 == k2, v1 + v2, v2)


@triton.jit
def _label_rows_kernel(gw_ptr, x_ptr, coef_ptr, key_ptr, order_ptr, rows, V, H, gw_stride, gw_stride_c, x_stride,
                       x_stride_c, BR: tl.constexpr, BH: tl.constexpr):  # fmt: skip
    """``gw_k += sum_r coef_r x_r`` over the rows ``r`` whose label is ``k``: the rows sorted by
    ``key`` (their label, or ``V`` where they add nothing), each program takes ``BR`` of them
    (their loads independent of each other), sums each label's run in float32 by a segmented
    scan down the tile and rounds it into ``gw`` once, at the run's last row. A run belongs to the
    program of its first row: a later tile skips the rows of a run it did not begin, and the
    tile whose last run goes on sums the rest ``BR`` rows at a time before it writes."""
    i0 = tl.program_id(0) * BR
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    keep = cols < H
    at = i0 + tl.arange(0, BR)
    before = tl.load(key_ptr + tl.maximum(i0 - 1, 0), mask=i0 > 0, other=-1)
    k = tl.load(key_ptr + at, mask=at < rows, other=V)
    k = tl.where(k == before, V, k)
    adds = k < V
    ends = adds & (tl.load(key_ptr + at + 1, mask=at + 1 < rows, other=-1) != k)
    r = tl.load(order_ptr + at, mask=adds, other=0).to(tl.int64)
    c = tl.load(coef_ptr + r, mask=adds, other=0.0).to(tl.float32)
    xs = tl.load(x_ptr + r[:, None] * x_stride + cols[None, :] * x_stride_c, mask=adds[:, None] & keep[None, :],
                 other=0.0)  # fmt: skip
    keys = tl.broadcast_to(k.to(tl.int32)[:, None], (BR, BH))
    _, sums = tl.associative_scan((keys, c[:, None] * xs.to(tl.float32)), 0, _run_sum)
    ptrs = gw_ptr + k.to(tl.int64)[:, None] * gw_stride + cols[None, :] * gw_stride_c
    m = ends[:, None] & keep[None, :]
    g = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(ptrs, (g + sums).to(gw_ptr.dtype.element_ty), mask=m)
    last = tl.load(key_ptr + i0 + BR - 1, mask=i0 + BR - 1 < rows, other=V)
    j = i0 + BR
    if (last < V) & (last != before) & (tl.load(key_ptr + j, mask=j < rows, other=-1) == last):
        acc = tl.sum(tl.where((at == i0 + BR - 1)[:, None], sums, 0.0), axis=0)
        more = last == last
        while more:
            at_j = j + tl.arange(0, BR)
            same = tl.load(key_ptr + at_j, mask=at_j < rows, other=-1) == last  # a prefix: the keys are sorted
            r_j = tl.load(order_ptr + at_j, mask=same, other=0).to(tl.int64)
            c_j = tl.load(coef_ptr + r_j, mask=same, other=0.0).to(tl.float32)
            x_j = tl.load(x_ptr + r_j[:, None] * x_stride + cols[None, :] * x_stride_c,
                          mask=same[:, None] & keep[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(c_j[:, None] * x_j.to(tl.float32), axis=0)
            j += BR
            more = (tl.sum(same.to(tl.int32), axis=0) == BR) & (j < rows)
        row = gw_ptr + last.to(tl.int64) * gw_stride + cols * gw_stride_c
        g_last = tl.load(row, mask=keep, other=0.0).to(tl.float32)
        tl.store(row, (g_last + acc).to(gw_ptr.dtype.element_ty), mask=keep)


class Factors(NamedTuple):
    """A factored chunk's ``dL/dz = diag(alpha) E + diag(label.coef) onehot(label.y)``; ``label``
    None without the hard term."""

    alpha: torch.Tensor
    label: LabelTerm | None


@dataclass(frozen=True)
class Tiles:
    """What ``settle`` needs of the epilogue's column tiles: their row maxima ``[tiles, rows]``,
    their width, and per row ``E``'s final shift and whether a tile left the window."""

    max: torch.Tensor
    width: int
    shift: torch.Tensor
    bad: torch.Tensor


def exp_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, loss: Loss, z: torch.Tensor
) -> tuple[Callable[[torch.Tensor | None], torch.Tensor], Tiles] | None:
    """Write the chunk's ``E`` into ``z`` and return ``(stats, Tiles)``: ``stats(y)`` makes the
    ``Stats`` local to this vocabulary slice, ``y`` the local labels (None without the hard
    term; only it reads them). ``None`` without touching ``z`` when the chunk's gradient does
    not factor or the GEMM does not take these operands."""
    if not (takes(x, bias, loss) and triton_logits.fits(x, weight, bias, z)):
        return None
    parts, width = triton_logits.launch(x, weight, None, loss, z, exp=True)
    (rows, h), v = x.shape, weight.shape[0]
    lse, shift = (torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(2))
    bad = torch.empty(rows, dtype=torch.int8, device=x.device)
    _tiles_kernel[(triton.cdiv(rows, 32),)](parts, lse, shift, bad, rows, parts.shape[1], BR=32, BT=64)

    def stats(y: torch.Tensor | None) -> torch.Tensor:
        zero = torch.zeros_like(lse)
        f_y = zero
        if y is not None:
            f_y = torch.empty_like(lse)
            _label_logit_kernel[(rows,)](
                x, weight, y, f_y, h, v, loss.logit_scale, loss.softcap or 1.0, CAPPED=loss.softcap is not None,
                BH=512,
            )  # fmt: skip
        columns = Stats(lse, lse, lse_teacher=zero, mass=zero, logit_sum=zero, label_logit=f_y, reverse=zero)
        return torch.stack(columns, dim=1)

    return stats, Tiles(parts[EXP_PARTS.row_max], width, shift, bad)


def logits_at(
    z: torch.Tensor, tiles: Tiles, at: torch.Tensor, inside: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
    loss: Loss,
) -> torch.Tensor:  # fmt: skip
    """The chunk's raw logits ``[rows, n_at]`` at the columns ``at`` (where ``inside``), from ``E``
    before :func:`settle` changes it (see ``_logits_at_kernel``)."""
    rows, n_at = at.shape
    out = torch.empty(rows, n_at, dtype=torch.float32, device=z.device)
    if rows and n_at:
        _logits_at_kernel[(rows,)](
            z, z.stride(0), tiles.max, at.contiguous(), inside.to(torch.int8).contiguous(), x, weight, out, rows,
            x.shape[1], n_at, loss.temperature / loss.logit_scale, BN=tiles.width, BK=triton.next_power_of_2(n_at),
            BH=128,
        )  # fmt: skip
    return out


def settle(
    z: torch.Tensor,
    tiles: Tiles,
    stats: torch.Tensor,
    q_factor: torch.Tensor,
    c_hard: torch.Tensor,
    y: torch.Tensor | None,
    loss: Loss,
    sparse: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    set_at: Callable | None = None,
) -> Factors:
    """Make ``z`` the chunk's ``E`` and return its :class:`Factors`. ``q_factor``: the rows' factor
    ``w`` of ``q`` in ``dL/dz`` (``c_hard``, plus ``c_soft K`` with a top-k teacher); ``stats`` their
    combined ``Stats``; ``y`` the local labels (None without the hard term); ``sparse``: ``(at, values,
    mask)``, the top-k teacher's ``dL/dz`` at its tokens, written with ``set_at``
    (``fused_kl.chunk.ChunkOps``). Rows out of the window are rescaled; rows with no dense part
    (``w = 0``) but sparse values are zeroed first; then the sparse entries are written."""
    rows, v = z.shape
    flags, dense = tiles.bad, q_factor
    if sparse is not None:
        at, values, mask = sparse
        empty = factored.only_sparse(q_factor, values, mask)
        flags = torch.where(empty, 2, flags).to(torch.int8)
        dense = torch.where(empty, 1.0, q_factor)
    _repair_kernel[(rows,)](z, tiles.max, tiles.shift, flags, rows, v, z.stride(0), BN=tiles.width)
    lse = stats[:, STATS.lse]  # at T: the exponent's; the same as the hard term's where both are used
    alpha = factored.alpha(dense, tiles.shift, lse, loss, torch)
    label = None
    if y is not None:  # dL/dz_y = logit_scale u_y (w q_y - c_hard): alpha E_y, and the label's term
        held = None if sparse is None else factored.label_held(at, mask, y)
        label = label_term(y, v, c_hard, stats[:, STATS.label_logit], loss, held, torch)
    if sparse is not None:
        set_at(z, at, values / torch.where(alpha == 0, 1.0, alpha)[:, None], mask)
    return Factors(alpha, label)


def scale_rows(
    src: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor,
    label: LabelTerm | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = diag(alpha) src`` (plus ``diag(label.coef) weight[label.y]`` with ``label``) in
    ``out``'s dtype, the sum in float32; ``src``'s rows contiguous (``out``'s too, else it is
    written through a copy)."""
    rows, h = src.shape
    if out.stride(-1) != 1:
        scaled = scale_rows(src, alpha, torch.empty(out.shape, dtype=out.dtype, device=out.device), label, weight)
        return out.copy_(scaled)
    if rows:
        coef, y = (alpha, alpha) if label is None else label
        grid = (rows, triton.cdiv(h, 1024))
        _scale_rows_kernel[grid](
            src, alpha, out, coef, y, src if weight is None else weight, h, src.stride(0), out.stride(0),
            LABEL=label is not None, BH=1024,
        )  # fmt: skip
    return out


def add_label_rows(grad_w: torch.Tensor, x: torch.Tensor, label: LabelTerm | None) -> None:
    """``grad_w[k] += sum of label.coef_r x_r`` over the rows ``r`` labelled ``k``: the label's term of
    ``grad_W += dL/dzᵀ x``, after every chunk's GEMM (any strides)."""
    if label is None or not x.shape[0]:
        return
    rows, h = x.shape
    key, order = torch.sort(torch.where(label.coef != 0, label.y, grad_w.shape[0]), stable=True)
    # 16 rows x 64 columns on 2 warps: the fastest of six tile shapes (docs/design-notes.md, Row kernels)
    grid = (triton.cdiv(rows, 16), triton.cdiv(h, 64))
    _label_rows_kernel[grid](
        grad_w, x, label.coef, key, order, rows, grad_w.shape[0], h, *grad_w.stride(), *x.stride(), BR=16, BH=64,
        num_warps=2,
    )  # fmt: skip
