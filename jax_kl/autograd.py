"""Stage 5 in JAX: the ``custom_vjp`` glue. The forward rule computes the gradients; the
backward rule scales them by the cotangent."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from fused_kl.contract import Options

Compute = Callable[..., tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def fused_linear_kl_div_vjp(x, weight, target, labels, bias, opts: Options, compute: Compute):
    """``loss = KL(target || softmax((x @ weight.T + bias) / T))``; outside ``jax.grad``
    only the loss is computed. ``compute`` is the backend (chunked Pallas/XLA, or the bridge
    to the Triton kernel)."""
    return compute(x, weight, target, labels, bias, opts, False)[0]


def _forward(x, weight, target, labels, bias, opts, compute):
    loss, grad_x, grad_w, grad_b = compute(x, weight, target, labels, bias, opts, True)
    return loss, (grad_x, grad_w, grad_b)


def _scale(grad: jax.Array | None, ct: jax.Array) -> jax.Array | None:
    # Multiply in float32 so a low-precision gradient is rounded once.
    return None if grad is None else (grad.astype(jnp.float32) * ct).astype(grad.dtype)


def _backward(opts, compute, grads, ct):
    del opts, compute
    grad_x, grad_w, grad_b = grads
    # The target and labels get no gradient (stop_gradient semantics).
    return _scale(grad_x, ct), _scale(grad_w, ct), None, None, _scale(grad_b, ct)


fused_linear_kl_div_vjp.defvjp(_forward, _backward)
