"""The exponentials ``E`` the logits GEMM's epilogue writes for a factored chunk, as both sides
read them: the window ``[LO, HI]`` of row maxima that keep the fixed shift ``SHIFT`` (why those
values: ``fused_kl.factored``), the per-tile parts the epilogue stores, and the tile
function itself. Its own module so that the imports run one way: ``triton_factored`` (what reads
``E``) imports ``triton_logits`` (the GEMM), and both import this.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from fused_kl import factored

from .triton_terms import LOG2E

SHIFT: tl.constexpr = tl.constexpr(factored.SHIFT)
LO: tl.constexpr = tl.constexpr(factored.LO)
HI: tl.constexpr = tl.constexpr(factored.HI)


class ExpParts(NamedTuple):
    """What the logits GEMM's epilogue stores per column tile and row where it writes ``E``
    (``[len(ExpParts), tiles, rows]``): :func:`exp_tile`'s log-sum-exp and max."""

    lse: Any
    row_max: Any


EXP_PARTS = ExpParts(*range(len(ExpParts._fields)))
EXP_PARTS_AT: tl.constexpr = tl.constexpr(EXP_PARTS)  # in the kernels: ``EXP_PARTS_AT.value.lse``


@triton.jit
def exp_tile(a, f, cap, CAPPED: tl.constexpr):
    """``(E, each row's log-sum-exp, each row's max)`` of a tile of exponents ``a = f(z) / T``
    (``-inf`` past the vocabulary): ``exp(a - shift) u`` with the shift ``SHIFT`` on rows whose
    max lies in the window, the max itself on the others."""
    m = tl.max(a, axis=1)
    shift = tl.where((m >= LO) & (m <= HI), SHIFT, m)
    e = tl.exp2(a * LOG2E - (shift * LOG2E)[:, None])
    lse = shift + tl.log(tl.sum(e, axis=1))
    if CAPPED:
        r = f / cap
        e = e * (1.0 - r * r)
    return e, lse, m
