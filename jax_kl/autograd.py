"""The ``custom_vjp`` glue: the forward rule computes the loss and its gradients; the backward
rule scales them by the cotangent (mirror of ``torch_kl/autograd.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from fused_kl.loss import Loss
from fused_kl.options import RunOptions

from .layout import Layout
from .teachers import TeacherArrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def fused_linear_loss(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None, teacher: TeacherArrays, labels: jax.Array | None,
    loss: Loss, run: RunOptions, layout: Layout, compute: Callable,
) -> jax.Array:  # fmt: skip
    """The fused loss of ``x @ weight.T (+ bias)``; outside ``jax.grad`` only the loss is
    computed. ``compute`` is the backend (the chunk driver, or the bridge to Triton)."""
    return compute(x, weight, bias, teacher, labels, loss, run, layout, False)[0]


def _forward(x, weight, bias, teacher, labels, loss, run, layout, compute):
    value, grad_x, grad_w, grad_b = compute(x, weight, bias, teacher, labels, loss, run, layout, True)
    return value, (grad_x, grad_w, grad_b)


def scale_grad(grad: jax.Array | None, ct: jax.Array) -> jax.Array | None:
    """A saved gradient times the upstream cotangent ``ct``, multiplied in float32 so a
    low-precision gradient is rounded once (the backward pass of every layout)."""
    return None if grad is None else (grad.astype(jnp.float32) * ct).astype(grad.dtype)


def _backward(loss, run, layout, compute, res, ct):
    del loss, run, layout, compute
    grad_x, grad_w, grad_b = res
    # The teacher and labels get no gradient (stop_gradient semantics).
    return scale_grad(grad_x, ct), scale_grad(grad_w, ct), scale_grad(grad_b, ct), None, None


fused_linear_loss.defvjp(_forward, _backward)
