"""The chunk driver's cuBLAS GEMMs (mirror of ``jax_kl/gemm.py``): the logits where no fused
GEMM takes them, ``grad_x`` and the ``grad_weight`` accumulation.

Every one of them has the vocabulary as a dimension. cuBLAS documents that its tensor-core
kernels run best when every dimension is a multiple of 16 bytes; the chunk buffers' row stride
is already aligned (``fused_kl.plan.padded_row_stride``), and at an unaligned vocabulary the
GEMMs are made over its aligned columns and over the few columns left apart (``parts``, from
:func:`vocab_parts`): row ranges of the head and of ``grad_weight`` are views, so nothing is
copied. ``grad_x`` is the few columns' product, to which the aligned columns' GEMM adds itself
(cuBLAS's beta = 1, summed in float32): the sum is rounded once, as one GEMM's would be, besides
the small part's own rounding, and no float32 ``[rows, H]`` buffer is held.
"""

from __future__ import annotations

import torch

from fused_kl.chunk import LabelTerm
from fused_kl.plan import ROW_STRIDE_MULTIPLE, label_block_columns

_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def vocab_parts(v: int, itemsize: int, split: bool) -> tuple[slice, ...]:
    """The vocabulary's columns as the GEMMs take them: with ``split`` and rows of ``v`` elements
    of ``itemsize`` bytes not a multiple of 16 bytes, the largest multiple of
    ``ROW_STRIDE_MULTIPLE`` columns and then the rest (where both are non-empty); else all at once."""
    aligned = v - v % ROW_STRIDE_MULTIPLE
    unaligned = v * itemsize % 16 != 0
    return (slice(0, aligned), slice(aligned, v)) if split and unaligned and 0 < aligned < v else (slice(0, v),)


def has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm``/``torch.addmm`` take ``out_dtype=float32`` for ``dtype`` operands here
    (CUDA): a float32 accumulator is then written by the GEMM itself."""
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        a = torch.zeros(1, 1, dtype=dtype, device=device)
        acc = torch.zeros(1, 1, device=device)
        try:
            torch.mm(a, a, out_dtype=torch.float32, out=acc)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _OUT_DTYPE[key] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


def _accumulate_one(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif has_out_dtype(acc.device, a.dtype):
        if first:
            torch.mm(a, b, out_dtype=acc.dtype, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        if first:
            acc.zero_()
        acc.add_(torch.mm(a, b))


def accumulate(acc: torch.Tensor, g: torch.Tensor, xc: torch.Tensor, first: bool, parts: tuple[slice, ...]) -> None:
    """``acc (+)= gᵀ xc`` (``acc`` ``[V, H]``, ``g`` ``[rows, V]``) in ``acc``'s dtype, one GEMM per
    part of the vocabulary; the first chunk's product overwrites ``acc`` (no zero fill)."""
    for cols in parts:
        _accumulate_one(acc[cols], g[:, cols].t(), xc, first)


def mm_f32(g: torch.Tensor, weight: torch.Tensor, parts: tuple[slice, ...]) -> torch.Tensor:
    """``g @ weight`` accumulated and written in float32, summed over the vocabulary's parts."""
    native = has_out_dtype(g.device, g.dtype)
    out: torch.Tensor | None = None
    for cols in parts:
        a, b = g[:, cols], weight[cols]
        if native:
            f32 = torch.float32
            out = torch.mm(a, b, out_dtype=f32) if out is None else torch.addmm(out, a, b, out_dtype=f32, out=out)
        else:
            a, b = a.float(), b.float()
            out = torch.mm(a, b) if out is None else out.addmm_(a, b)
    assert out is not None  # parts is never empty
    return out


def grad_x(
    g: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, parts: tuple[slice, ...], label: LabelTerm | None = None
) -> None:
    """``out = g @ weight`` in ``out``'s dtype: the last (smallest) part's product first, the
    others added to it by GEMMs that read it (beta = 1) and round their sum once. With ``label``,
    ``diag(label.coef) weight[label.y]`` is added to the float32 product before its rounding."""
    if label is not None:
        product = mm_f32(g, weight, parts)
        out.copy_(product.addcmul_(label.coef[:, None], weight[label.y]))
        return
    first, *rest = reversed(parts)
    torch.mm(g[:, first], weight[first], out=out)
    for cols in rest:
        out.addmm_(g[:, cols], weight[cols])


def add_label_rows(grad_w: torch.Tensor, x: torch.Tensor, label: LabelTerm) -> None:
    """``grad_w[k] += sum of label.coef_r x_r`` over the rows ``r`` labelled ``k``, each label's
    sum made in float32 and rounded into its row once (``jax_kl.gemm.add_label_rows``); the sums
    are made a block of columns at a time (``fused_kl.plan.label_block_columns``). Reads the
    labels on the host (``torch.unique``): the Triton backend brings its own kernel."""
    n, h = x.shape
    v = grad_w.shape[0]
    rows, inverse = torch.unique(torch.where(label.coef != 0, label.y, v), return_inverse=True)
    kept = rows < v
    at = rows[kept]
    width = label_block_columns(n, h)
    for c0 in range(0, h, width):
        cols = slice(c0, min(h, c0 + width))
        terms = label.coef[:, None] * x[:, cols].float()
        sums = torch.zeros(rows.shape[0], terms.shape[1], device=x.device).index_add_(0, inverse, terms)
        grad_w[at, cols] = (grad_w[at, cols].float() + sums[kept]).to(grad_w.dtype)


def logits(xc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor,
           parts: tuple[slice, ...]) -> torch.Tensor:  # fmt: skip
    """``z = xc weightᵀ (+ bias)``, one GEMM per part of the vocabulary's columns."""
    for cols in parts:
        if bias is None:
            torch.mm(xc, weight[cols].t(), out=z[:, cols])
        else:
            torch.addmm(bias[cols], xc, weight[cols].t(), out=z[:, cols])
    return z
