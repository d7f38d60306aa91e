"""The chunk driver's GEMMs (mirror of ``torch_kl/gemm.py``), at the precision docs/contract.md
asks for: the logits, ``grad_x`` and the ``grad_weight`` accumulation.

A JAX array's rows are its width apart, so at a vocabulary whose rows are not aligned (V not a
multiple of :data:`SPLIT_MULTIPLE`) a chunk's logits can be made as two arrays
(:func:`vocab_parts`, with ``Backend.vocab_parts``): the aligned columns, which the Mosaic GPU
kernels and the in-place ``grad_weight`` add can take, and the few left. Each GEMM then runs
per part on row ranges of the head. ``grad_weight`` is one ``[V, H]`` array where the in-place add
takes every chunk's aligned part (:func:`single_array`), else one accumulator a part, joined
once after the last chunk (:func:`join`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl.chunk import LabelTerm
from fused_kl.plan import label_block_columns

SPLIT_MULTIPLE = 128  # mosaic_accumulate.CTA_M, the in-place add's row tile (the TMA takes 64 bf16 columns)


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], out_dtype: jnp.dtype) -> jax.Array:
    """``a`` times ``b`` over the given axes; float32 operands in full float32 (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)


def vocab_parts(v: int, split: bool) -> tuple[slice, ...]:
    """The vocabulary's columns as the chunk takes them: with ``split`` and ``v`` not a multiple
    of :data:`SPLIT_MULTIPLE`, the largest multiple and the rest (where both are non-empty); else
    all at once."""
    aligned = v - v % SPLIT_MULTIPLE
    return (slice(0, aligned), slice(aligned, v)) if split and 0 < aligned < v else (slice(0, v),)


def logits(
    xc: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype: jnp.dtype, parts: Sequence[slice]
) -> list[jax.Array]:
    """Each part's logits ``xc weight[part]ᵀ (+ bias[part])``, ``[rows, width]``, the bias added in
    float32."""
    out = []
    for cols in parts:
        if bias is None:
            out.append(dot(xc, weight[cols], (1, 1), dtype))
        else:
            z = dot(xc, weight[cols], (1, 1), jnp.float32) + bias[cols].astype(jnp.float32)
            out.append(z.astype(dtype))
    return out


def grad_x(
    gs: Sequence[jax.Array],
    weight: jax.Array,
    dtype: jnp.dtype,
    parts: Sequence[slice],
    label: LabelTerm | None = None,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """``diag(row_scale) sum_p gs[p] weight[p]`` (plus ``diag(label.coef) weight[label.y]``) in
    ``dtype``: the parts' products, their rows' scale (a factored chunk's ``alpha``) and the
    label's term in float32, rounded once."""
    if len(parts) == 1 and label is None and row_scale is None:
        return dot(gs[0], weight, (1, 0), dtype)
    total = sum(dot(g, weight[cols], (1, 0), jnp.float32) for g, cols in zip(gs, parts, strict=True))
    if row_scale is not None:
        total = row_scale[:, None] * total
    if label is not None:
        total = total + label.coef[:, None] * weight[label.y].astype(jnp.float32)
    return total.astype(dtype)


def single_array(
    v: int,
    h: int,
    parts: Sequence[slice],
    bounds: Sequence[tuple[int, int]],
    operand_dtype: jnp.dtype,
    accum_dtype: jnp.dtype,
    in_place: ModuleType | None,
) -> bool:
    """Whether an unaligned vocabulary's ``grad_weight`` is one ``[V, H]`` array from the first
    chunk on: where ``in_place`` takes the aligned part of every chunk (``bounds``, the chunks' row
    ranges). The rest's rows are then summed apart in float32 and written into their rows once
    after the last chunk (:func:`join`): no copy joins the parts' accumulators, nothing fills the
    array with zeros, no pass reads it whole. A
    slice of that array updated after every chunk's in-place call instead fails XLA's GPU
    compiler (dynamic-slice fusion, jax 0.11) at some shapes."""
    if len(parts) < 2 or in_place is None:
        return False
    width = parts[0].stop - parts[0].start
    acc, shape = jax.ShapeDtypeStruct((v, h), accum_dtype), jax.ShapeDtypeStruct
    return all(
        in_place.fits(acc, shape((b - a, width), operand_dtype), shape((b - a, h), operand_dtype)) for a, b in bounds
    )


def accumulate(
    accs: tuple[jax.Array, ...] | None,
    gs: Sequence[jax.Array],
    xc: jax.Array,
    dtype: jnp.dtype,
    in_place: ModuleType | None,
    one_array: bool = False,
) -> tuple[jax.Array, ...]:
    """``grad_weight``'s accumulators (``dtype``) with the chunk's ``gᵀ x`` added. With
    ``one_array`` (:func:`single_array`): ``([V, H], the rest's float32 rows)``, the ``[V, H]`` array
    made by the first chunk's kernel (``in_place.product``: its aligned rows, the rest's left for
    :func:`join`), every later chunk's aligned part added in place into them. Else one
    accumulator a part, the first chunk's written by its GEMM (no zero fill), :func:`join` makes
    them one. XLA (0.11, H200) folds the add into the GEMM (beta = 1) only with its Triton GEMMs
    off (``xla_gpu_enable_triton_gemm=False``, docs/choosing.md); otherwise each chunk after the
    first costs a product buffer and an add pass (docs/design-notes.md, GEMMs). Hence the in-place
    kernel of the Mosaic GPU backends (``in_place``), where it fits a part's accumulator."""
    if one_array:
        assert in_place is not None, "single_array promised the in-place add"
        product = dot(gs[1], xc, (0, 0), jnp.float32)
        if accs is None:  # the first chunk writes the aligned rows; join writes the rest's
            return in_place.product(gs[0], xc, sum(g.shape[1] for g in gs), dtype), product
        whole, rest = accs
        assert in_place.fits(whole, gs[0], xc), "single_array promised the in-place add"
        return in_place.accumulate(whole, gs[0], xc), rest + product
    if accs is None:
        return tuple(dot(g, xc, (0, 0), dtype) for g in gs)
    out = []
    for acc, g in zip(accs, gs, strict=True):
        if in_place is not None and in_place.fits(acc, g, xc):
            out.append(in_place.accumulate(acc, g, xc))
        else:
            out.append(acc + dot(g, xc, (0, 0), dtype))
    return tuple(out)


def join(accs: tuple[jax.Array, ...], one_array: bool = False, in_place: ModuleType | None = None) -> jax.Array:
    """The ``[V, H]`` ``grad_weight`` from :func:`accumulate`'s accumulators: with ``one_array``, the
    rest's rows written into the last rows of the first by ``in_place``; else the parts' concatenated (a copy
    where there are several)."""
    if one_array:
        # The in-place kernel's own row writer: a dynamic_update_slice whose target is that kernel's
        # output fails XLA's GPU compiler in some modes (dynamic-slice fusion, jax 0.11), and a
        # select would pass over the whole array.
        assert in_place is not None, "single_array promised the in-place add"
        whole, rest = accs
        return in_place.put_rows(whole, rest.astype(whole.dtype))
    return accs[0] if len(accs) == 1 else jnp.concatenate(accs)


def add_label_rows(acc: jax.Array, x: jax.Array, label: LabelTerm, in_place: ModuleType | None = None) -> jax.Array:
    """``acc`` (``grad_weight``'s ``[V, H]`` accumulator) with ``sum of label.coef_r x_r`` over
    the rows ``r`` labelled ``k`` added to row ``k``: the label's term of ``grad_W += dL/dzᵀ x``,
    after every chunk's GEMM. Each label's sum is made in float32 and rounded into its row once:
    by ``in_place`` (``Backend.in_place_label_rows``) where it fits, else by XLA, a block of
    columns at a time (``fused_kl.plan.label_block_columns``)."""
    n, h = x.shape
    if not n:
        return acc
    if in_place is not None and in_place.fits(acc, x):
        return in_place.add_label_rows(acc, x, label)
    v = acc.shape[0]
    key = jnp.where(label.coef != 0, label.y, v)  # v: no row
    rows, inverse = jnp.unique(key, size=n, fill_value=v, return_inverse=True)
    inverse = inverse.reshape(n)
    width = label_block_columns(n, h)
    for c0 in range(0, h, width):
        cs = slice(c0, min(h, c0 + width))
        # One block's float32 sums at a time: the barrier orders each after the previous block's adds.
        xb, acc = lax.optimization_barrier((x[:, cs], acc))
        sums = jax.ops.segment_sum(label.coef[:, None] * xb.astype(jnp.float32), inverse, num_segments=n)
        now = acc.at[rows, cs].get(mode="fill", fill_value=0).astype(jnp.float32)
        acc = acc.at[rows, cs].set((now + sums).astype(acc.dtype), mode="drop")  # row v: dropped
    return acc
