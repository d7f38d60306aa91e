"""Stages 2-4 in JAX: plan the chunks, then per chunk one GEMM, the row kernel, two GEMMs.

The ``[N, V]`` logits never exist: each chunk's ``[chunk, V]`` logits become its ``dL/dz``
in place and die before the next chunk's are made. The chunk loop is unrolled at trace
time, so every slice is static and the kernel reads the target where it lies.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl.contract import Options
from fused_kl.plan import kernel_scales, plan_chunks

from . import plain

Kernel = Callable[..., tuple[jax.Array | None, jax.Array]]


def row_kernel(backend: str) -> Kernel:
    """The row kernel of a backend: Pallas's (imported only when asked for) or plain jnp."""
    if backend == "pallas":
        from . import kernel

        return kernel.kl_rows
    return plain.kl_rows


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], out_dtype) -> jax.Array:
    """``a`` times ``b`` over the given axes; float32 operands in full float32 (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)


def _add(acc: jax.Array | None, term: jax.Array) -> jax.Array:
    return term if acc is None else acc + term


def forward(
    x: jax.Array,
    weight: jax.Array,
    target: jax.Array,
    labels: jax.Array | None,
    bias: jax.Array | None,
    opts: Options,
    with_grads: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Loss and gradients of 2-D inputs ``x [N, H]``, ``target [N, V]``, ``labels [N]``.

    With ``with_grads=False`` only the loss is computed. Gradients nobody uses are dead
    code that XLA removes (a frozen head costs no ``grad_weight`` GEMM).
    """
    n, h = x.shape
    v = weight.shape[0]
    plan = plan_chunks(n, v, x.dtype.itemsize, opts.chunk_size)
    kernel = row_kernel(opts.backend)

    kept = jnp.float32(n) if labels is None else jnp.sum(labels != opts.ignore_index, dtype=jnp.float32)
    scale, unscale = kernel_scales(kept, opts.reduction, v, x.dtype == jnp.float16, jnp)

    accum = jnp.dtype(opts.accum_dtype) if opts.accum_dtype else weight.dtype
    row_losses, grad_x_rows = [], []
    # The first chunk's GEMM writes the accumulators: no [V, H] zero fill.
    grad_w = grad_b = None
    done = scale  # what the previous chunk produced last
    for start, stop in plan.bounds:
        # Start a chunk only once the previous one is done, so XLA cannot hoist the
        # logits GEMMs and keep several [chunk, V] buffers alive at once.
        xc, _ = lax.optimization_barrier((x[start:stop], done))
        if bias is None:
            z = _dot(xc, weight, (1, 1), x.dtype)
        else:
            z = (_dot(xc, weight, (1, 1), jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
        g, row_loss = kernel(z, target, labels, scale, start, opts, plan.tile, with_grads)
        row_losses.append(row_loss)
        done = row_loss
        if with_grads:
            grad_x_rows.append(_dot(g, weight, (1, 0), x.dtype))
            # XLA (0.11, H200) does not fold this add into the GEMM: each chunk after the first
            # costs a [V, H] product buffer and an add pass (benchmarks/RESULTS.md).
            grad_w = _add(grad_w, _dot(g, xc, (0, 0), accum))
            grad_b = _add(grad_b, jnp.sum(g, axis=0, dtype=jnp.float32))
            done = (grad_x_rows[-1], grad_w, grad_b)

    loss = jnp.sum(jnp.concatenate(row_losses)) if row_losses else jnp.float32(0.0)
    if not with_grads:
        return loss, None, None, None
    grad_x = jnp.concatenate(grad_x_rows) if grad_x_rows else jnp.zeros_like(x)
    if grad_w is None:  # no rows
        grad_w, grad_b = jnp.zeros((v, h), accum), jnp.zeros((v,), jnp.float32)

    def unscaled(grad: jax.Array, dtype) -> jax.Array:
        if unscale is not None:  # float16; exact: a power of two
            grad = grad * unscale.astype(grad.dtype)
        return grad.astype(dtype)

    return (
        loss,
        unscaled(grad_x, x.dtype),
        unscaled(grad_w, weight.dtype),
        None if bias is None else unscaled(grad_b, bias.dtype),
    )
