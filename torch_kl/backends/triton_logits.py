"""The logits GEMM with the ``stats`` phase in its epilogue: one pass over the chunk fewer.

``z = x W^T (+ b)`` as a persistent Triton GEMM. While a ``[BM, BN]`` tile of logits is still in
registers, the epilogue computes that tile's share of ``fused_kl.rows.Stats`` with the same
``triton_terms`` terms (log-sum-exps of ``f(z)/T`` and, for the hard term, of ``f(z)``; ``sum
f(z)``) and stores it per column tile; :func:`logits_with_stats` combines the tiles like
vocabulary shards. The statistics are those of the logits as stored (rounded to their dtype),
the values the later phases read.

It serves every chunk whose ``stats`` phase reads no dense teacher (``Loss.stats_read_teacher``):
the cross-entropy, top-k teachers, and JSD on probabilities. For the chunks whose
``dL/dz`` factors (``triton_factored``: the bfloat16 cross-entropy and top-k teachers) the
epilogue writes ``exp(f(z) / T - shift)`` from the float32 accumulator instead of the logits.
Where the statistics need the teacher, the epilogue would read the teacher's tile after the
GEMM's main loop, exposed, which costs what the ``stats`` kernel's pass saves; so would the
teacher head's log-sum-exp in its own GEMM's epilogue (docs/design-notes.md, GEMMs).

The same GEMM with nothing in its epilogue (:func:`plain_logits`) makes a teacher head's logits.

On Hopper the tiles move by TMA (tensor descriptors); elsewhere (the CPU interpreter's tests)
by masked pointer loads. Inputs the kernel does not take get ``None`` back, and the caller runs
cuBLAS and the ``stats`` kernel.

``jax_kl`` has no counterpart: its logits GEMM is XLA's. Its Mosaic GPU GEMM
(``jax_kl/backends/mosaic_accumulate.py``) is about 6.5 % slower than cuBLAS on an H100, more than
this epilogue saves.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_kl import rowmath
from fused_kl.loss import Loss
from fused_kl.rows import Stats

from ..ops import OPS
from .triton_exp import EXP_PARTS_AT, ExpParts, exp_tile
from .triton_phases import kernel_floats
from .triton_terms import LN2, LOG2E, transform

# The fastest tile shape on the H200 (docs/design-notes.md, GEMMs): a 128 x 256 tile, 3 stages and
# one program per SM run the chunk's logits GEMM within 1 % of cuBLAS, with the statistics epilogue
# within 3 %; split stores, 4 stages, other groups and tiles measured no faster.
GPU_CONFIG = dict(BM=128, BN=256, BK=64, GROUP=8, num_warps=8, num_stages=3)
INTERPRET_CONFIG = dict(BM=16, BN=32, BK=16, GROUP=2, num_warps=4, num_stages=1)


class StatsParts(NamedTuple):
    """What the epilogue stores per column tile and row with the statistics
    (``[len(StatsParts), tiles, rows]``), combined into ``Stats`` by :func:`_combine`."""

    lse: Any  # of f(z) / T
    lse_hard: Any  # of f(z)
    logit_sum: Any  # sum f(z)


STATS_PARTS = StatsParts(*range(len(StatsParts._fields)))
STATS_PARTS_AT: tl.constexpr = tl.constexpr(STATS_PARTS)  # in the kernel: ``STATS_PARTS_AT.value.lse``
PARTS = max(len(StatsParts._fields), len(ExpParts._fields))  # one buffer serves both epilogues


@triton.jit
def _grouped(tile, num_m, num_n, GROUP: tl.constexpr):
    """Row block and column block of a tile, GROUP row blocks sweeping the columns together so
    the weight tile they share is read from L2."""
    width = GROUP * num_n
    first = (tile // width) * GROUP
    size = tl.minimum(num_m - first, GROUP)
    return first + (tile % width) % size, (tile % width) // size


@triton.jit
def _tile_lse(f, c):
    """Each row's log-sum-exp of ``c * f`` (``c > 0``), with one FMA and one ``exp2`` an element:
    the epilogue's arithmetic is exposed between two tiles' MMAs."""
    m = tl.max(f, axis=1)
    k = c * LOG2E
    return c * m + tl.log2(tl.sum(tl.exp2(f * k - (m * k)[:, None]), axis=1)) * LN2


@triton.jit
def _logits_kernel(
    x, w, z, bias_ptr, part_ptr, M, V, H, z_stride, inv_t, scale, cap,
    CAPPED: tl.constexpr, SUM_F: tl.constexpr, EXP: tl.constexpr, STATS: tl.constexpr,
    HARD_LSE: tl.constexpr, HAS_BIAS: tl.constexpr, TMA: tl.constexpr, F16: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, NPROG: tl.constexpr,
):  # fmt: skip
    inv_t, scale, cap = tl.cast(inv_t, tl.float32), tl.cast(scale, tl.float32), tl.cast(cap, tl.float32)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(V, BN)
    part_stride = num_n * M
    for tile in tl.range(tl.program_id(0), num_m * num_n, NPROG, flatten=True):
        pm, pn = _grouped(tile, num_m, num_n, GROUP)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, H, BK):
            if TMA:
                xa = x.load([pm * BM, k])
                wb = w.load([pn * BN, k])
            else:
                ks = k + tl.arange(0, BK)
                xa = tl.load(x + rows[:, None].to(tl.int64) * H + ks[None, :],
                             mask=(rows[:, None] < M) & (ks[None, :] < H), other=0.0)  # fmt: skip
                wb = tl.load(w + cols[:, None].to(tl.int64) * H + ks[None, :],
                             mask=(cols[:, None] < V) & (ks[None, :] < H), other=0.0)  # fmt: skip
            if UPCAST:
                xa, wb = xa.to(tl.float32), wb.to(tl.float32)
            acc = tl.dot(xa, wb.T, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        valid = (cols < V)[None, :]
        partial = (pn + 1) * BN > V  # the last column tile: no mass past the vocabulary
        out = part_ptr + pn * M + rows
        live = rows < M
        if EXP:  # f(z) from the float32 accumulator, exponentiated (triton_factored's epilogue)
            f = transform(acc, scale, cap, CAPPED)
            if partial:
                f = tl.where(valid, f, -float("inf"))
            values, tile_lse, tile_max = exp_tile(f * inv_t, f, cap, CAPPED)
            zq = values.to(tl.bfloat16)
        else:
            zq = acc.to(tl.float16 if F16 else tl.bfloat16)
        if TMA:
            z.store([pm * BM, pn * BN], zq)
        else:
            tl.store(z + rows[:, None].to(tl.int64) * z_stride + cols[None, :], zq,
                     mask=(rows[:, None] < M) & valid)  # fmt: skip
        if EXP:
            tl.store(out + EXP_PARTS_AT.value.lse * part_stride, tile_lse, mask=live)
            tl.store(out + EXP_PARTS_AT.value.row_max * part_stride, tile_max, mask=live)
        elif STATS:
            if CAPPED:
                f = transform(zq.to(tl.float32), scale, cap, CAPPED)
                c = 1.0
            else:  # f(z) = scale * z: the scale joins the exponent's factor
                f = zq.to(tl.float32)
                c = scale
            if partial:
                f = tl.where(valid, f, -float("inf"))
            tl.store(out + STATS_PARTS_AT.value.lse * part_stride, _tile_lse(f, c * inv_t), mask=live)
            if HARD_LSE:
                tl.store(out + STATS_PARTS_AT.value.lse_hard * part_stride, _tile_lse(f, c), mask=live)
            if SUM_F:
                f_sum = tl.sum(tl.where(valid, f, 0.0), axis=1) * c
                tl.store(out + STATS_PARTS_AT.value.logit_sum * part_stride, f_sum, mask=live)


@functools.cache
def _programs(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _interpreted(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor) -> bool:
    """Whether the fused GEMM takes these operands: half precision, contiguous ``x`` and ``weight``,
    ``z`` with contiguous rows (its row stride may exceed ``V``: ``torch_kl.driver.chunk_buffer``),
    on Hopper or newer (or in the interpreter), with rows whose bytes TMA can address (multiples
    of 16)."""
    dev = x.device
    if not (_interpreted(dev) or (dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0))):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or z.dtype != x.dtype:
        return False
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return False
    if not (x.is_contiguous() and weight.is_contiguous() and z.stride(1) == 1) or x.shape[0] == 0:
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[1], z.stride(0))) and all(
        a.data_ptr() % 16 == 0 for a in (x, weight, z)
    )


def launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, loss: Loss | None, z: torch.Tensor, exp: bool
) -> tuple[torch.Tensor, int]:
    """Run the kernel; ``(the column tiles' partial statistics [PARTS, tiles, rows], tile width)``.
    Without a ``loss`` the epilogue only stores the logits (the partials are left unwritten)."""
    (m, h), v = x.shape, weight.shape[0]
    interpreted = _interpreted(x.device)
    cfg = dict(INTERPRET_CONFIG if interpreted else GPU_CONFIG)
    bm, bn, bk = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("BK")
    # Triton 3.9's interpreter misreads bfloat16 tensor descriptors and multiplies bfloat16 tiles
    # wrongly: there, float16 takes the TMA path and bfloat16 the pointer path with float32
    # tiles (exact: the products of bfloat16 values, accumulated in float32 either way).
    bf16_interpreted = interpreted and x.dtype == torch.bfloat16
    tma = not bf16_interpreted
    tiles = triton.cdiv(m, bm) * triton.cdiv(v, bn)
    programs = min(tiles, 4 if interpreted else _programs(x.device.index or 0))
    if tma:
        operands = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
                    TensorDescriptor.from_tensor(z, [bm, bn]))  # fmt: skip
    else:
        operands = (x, weight, z)
    if loss is None:  # the logits alone: no epilogue floats nor partials
        floats, flags = (1.0, 1.0, 1.0), dict(CAPPED=False, SUM_F=False, HARD_LSE=False)
        parts = torch.empty(1, dtype=torch.float32, device=x.device)
    else:
        common = kernel_floats(loss)
        # exp: the exponent is the soft term's f / T with a (top-k) teacher, the hard term's f without
        floats = (common["inv_t"] if loss.soft or not exp else 1.0, common["scale"], common["cap"])
        flags = dict(CAPPED=common["CAPPED"], SUM_F=_sums_f(loss), HARD_LSE=loss.separate_hard_lse)
        parts = torch.empty(PARTS, triton.cdiv(v, bn), m, dtype=torch.float32, device=x.device)
    _logits_kernel[(programs,)](
        *operands, z if bias is None else bias, parts, m, v, h, z.stride(0), *floats, **flags, EXP=exp,
        STATS=loss is not None, HAS_BIAS=bias is not None, TMA=tma, F16=x.dtype == torch.float16,
        UPCAST=bf16_interpreted, BM=bm, BN=bn, BK=bk, NPROG=programs, **cfg,
    )  # fmt: skip
    return parts, bn


def logits_with_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    loss: Loss,
    z: torch.Tensor,
) -> Callable[[torch.Tensor | None], torch.Tensor] | None:
    """Write the chunk's logits ``x W^T (+ bias)`` into ``z`` and return ``stats(y)``, which makes
    their ``STATS`` (local to this vocabulary slice; ``y`` the local labels, read only there);
    or ``None`` without touching ``z`` when the fused GEMM does not take these operands or the
    ``stats`` phase must read a dense teacher (``Loss.stats_read_teacher``)."""
    if loss.stats_read_teacher or not fits(x, weight, bias, z):
        return None
    parts = launch(x, weight, bias, loss, z, exp=False)[0]
    return lambda y: _combine(parts, z, y, loss)


def plain_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor) -> bool:
    """Write ``x W^T (+ bias)`` into ``z`` with the same GEMM and nothing else in its epilogue
    (a teacher head's logits: on the H200 it runs a 1024-row block of them faster than cuBLAS,
    docs/design-notes.md); False, ``z`` untouched, where it does not take the operands."""
    if not fits(x, weight, bias, z):
        return False
    launch(x, weight, bias, None, z, exp=False)
    return True


def _sums_f(loss: Loss) -> bool:
    """Whether the row statistics need ``sum f(z)``: only label smoothing's term reads it."""
    return loss.hard and loss.label_smoothing != 0.0


def _combine(parts: torch.Tensor, z: torch.Tensor, y: torch.Tensor | None, loss: Loss) -> torch.Tensor:
    """The column tiles' partial statistics combined into each row's ``Stats``."""

    def lse(at: int) -> torch.Tensor:
        return rowmath.combine_lse(parts[at], lambda a: a.amax(0), lambda a: a.sum(0), torch)

    zero = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
    lse_z = lse(STATS_PARTS.lse)
    columns = Stats(
        lse=lse_z,
        lse_hard=lse(STATS_PARTS.lse_hard) if loss.separate_hard_lse else lse_z,
        lse_teacher=zero,
        mass=zero,
        logit_sum=parts[STATS_PARTS.logit_sum].sum(0) if _sums_f(loss) else zero,
        label_logit=zero if y is None else rowmath.label_logit(z, y, loss, OPS.gather, torch),
        reverse=zero,  # no reverse KL here: its stats read the teacher
    )
    return torch.stack(columns, dim=1)
