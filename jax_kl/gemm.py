"""The chunk driver's GEMMs (mirror of ``torch_kl/gemm.py``), at the precision docs/contract.md
asks for: the logits, ``grad_x`` and the ``grad_weight`` accumulation.

A JAX array's rows are its width apart, so at a vocabulary whose rows are not aligned (V not a
multiple of :data:`SPLIT_MULTIPLE`) a chunk's logits can be made as two arrays
(:func:`vocab_parts`, with ``Backend.vocab_parts``): the aligned columns, which the Mosaic GPU
kernels and the in-place ``grad_weight`` add can take, and the few left. Each GEMM then runs
per part on row ranges of the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import jax
import jax.numpy as jnp
from jax import lax

SPLIT_MULTIPLE = 128  # mosaic_accumulate.CTA_M, the in-place add's row tile (the TMA takes 64 bf16 columns)


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], out_dtype) -> jax.Array:
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


def logits(xc: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype, parts: Sequence[slice]) -> list[jax.Array]:
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


def grad_x(gs: Sequence[jax.Array], weight: jax.Array, dtype, parts: Sequence[slice]) -> jax.Array:
    """``sum_p gs[p] weight[p]`` in ``dtype``: the parts' products summed in float32, rounded once."""
    if len(parts) == 1:
        return dot(gs[0], weight, (1, 0), dtype)
    return sum(dot(g, weight[cols], (1, 0), jnp.float32) for g, cols in zip(gs, parts, strict=True)).astype(dtype)


def accumulate(
    accs: list[jax.Array] | None, gs: Sequence[jax.Array], xc: jax.Array, dtype, in_place: ModuleType | None
) -> list[jax.Array]:
    """Each part's ``grad_weight`` rows plus ``gᵀ x``, the first chunk's (``accs`` None) written,
    not added. XLA (0.11, H200) folds the add into the GEMM (beta = 1) only with its Triton GEMMs
    off (``xla_gpu_enable_triton_gemm=False``, docs/choosing.md); otherwise each chunk after the
    first costs a product buffer and an add pass (docs/design-notes.md, GEMMs). Hence the
    in-place kernel of the Mosaic GPU backends (``in_place``), where it fits the part."""
    if accs is None:
        return [dot(g, xc, (0, 0), dtype) for g in gs]
    out = []
    for acc, g in zip(accs, gs, strict=True):
        if in_place is not None and in_place.fits(acc, g, xc):
            out.append(in_place.accumulate(acc, g, xc))
        else:
            out.append(acc + dot(g, xc, (0, 0), dtype))
    return out


def joined(accs: list[jax.Array]) -> jax.Array:
    """The parts' ``grad_weight`` rows as one ``[V, H]`` array (with several parts, one copy at
    the end of the call: each part is added in place while the chunks run)."""
    return accs[0] if len(accs) == 1 else jnp.concatenate(accs)
