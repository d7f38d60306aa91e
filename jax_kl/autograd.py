"""The ``custom_vjp`` glue: the forward rule computes the loss and its gradients; the backward
rule scales them by the cotangent (mirror of ``torch_kl/autograd.py``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from fused_kl.loss import Loss, with_values
from fused_kl.options import Needs, RunOptions

from .backends import Backend
from .layout import Layout
from .teachers import TeacherArrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def fused_linear_loss(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None, teacher: TeacherArrays, labels: jax.Array | None,
    row_weight: jax.Array | None, values: tuple, loss: Loss, run: RunOptions, layout: Layout, backend: Backend,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(the fused loss of x @ weight.T (+ bias), the rows' own losses)``; outside ``jax.grad``
    only the loss is computed. ``backend.compute`` runs it (the chunk driver, or the bridge to
    Triton). The row losses carry no gradient. ``values``: the traced hyperparameters
    (``fused_kl.loss.VALUES``, None where ``loss`` holds the value), which get no gradient."""
    loss = with_values(loss, values)
    return backend.compute(x, weight, bias, teacher, labels, row_weight, loss, run, layout, Needs(), backend)[:2]


# The backends whose forward rule JAX can differentiate (plain jax.numpy): the gradient of their
# gradient, jax.hessian, jvp of grad. The others run kernels with no JVP rule (pallas_call, a
# callback into torch); a tangent reaching them is refused by name (:func:`_refuse_tangents`).
TWICE_DIFFERENTIABLE = ("xla",)


@functools.cache
def _refuse_tangents(backend: str):
    """The identity, whose JVP rule raises: second derivatives through ``backend``."""

    @jax.custom_jvp
    def identity(arrays):
        return arrays

    @identity.defjvp
    def _(primals, tangents):
        raise ValueError(
            f"backend: {backend!r} supports first derivatives only (jax.grad, jax.vjp); a second derivative "
            "(jax.hessian, or any transform of jax.grad: grad, jacfwd, jacrev, jvp) needs backend='xla'"
        )

    return identity


def _needs_and_values(
    x: Any, weight: Any, bias: Any, teacher: TeacherArrays, labels: Any, row_weight: Any, backend: Backend
) -> tuple[Needs, tuple]:
    """With ``symbolic_zeros=True`` a forward rule gets each array as ``CustomVJPPrimal``: its
    ``value``, and whether it is ``perturbed`` (its gradient is asked for). The gradients to
    make, and the arrays: under ``jax.grad(..., argnums=0)`` a frozen head costs no
    ``grad_weight`` GEMM, through the Triton bridge too (it has no dead code for XLA to drop).
    A second derivative through a backend that has none is refused here (:func:`_refuse_tangents`)."""
    needs = Needs(x=x.perturbed, weight=weight.perturbed, bias=bias is not None and bias.perturbed)
    values = jax.tree.map(lambda p: p.value, (x, weight, bias, teacher, labels, row_weight))
    if backend.name not in TWICE_DIFFERENTIABLE:
        values = (*_refuse_tangents(backend.name)(values[:3]), *values[3:])
    return needs, values


def compute_primals(
    primals: tuple, loss: Loss, run: RunOptions, layout: Layout, backend: Backend
) -> tuple[jax.Array, jax.Array, tuple]:
    """A forward rule's work (every layout's): ``(loss, row losses, (grad_x, grad_weight,
    grad_bias))`` of the primals ``(x, weight, bias, teacher, labels, row_weight)``, each gradient
    made only where it is asked for (:func:`_needs_and_values`)."""
    needs, arrays = _needs_and_values(*primals, backend)
    value, rows, *grads = backend.compute(*arrays, loss, run, layout, needs, backend)
    return value, rows, tuple(grads)


def _forward(x, weight, bias, teacher, labels, row_weight, values, loss, run, layout, backend):
    loss = with_values(loss, jax.tree.map(lambda p: p.value, values))
    value, rows, grads = compute_primals((x, weight, bias, teacher, labels, row_weight), loss, run, layout, backend)
    return (value, rows), grads


def scale_grad(grad: jax.Array | None, ct: jax.Array) -> jax.Array | None:
    """A saved gradient times the upstream cotangent ``ct``, multiplied in float32 so a
    low-precision gradient is rounded once (the backward pass of every layout)."""
    return None if grad is None else (grad.astype(jnp.float32) * ct).astype(grad.dtype)


def loss_cotangent(cts: tuple) -> jax.Array:
    """The loss's cotangent of ``(loss, row losses)``; the row losses' is dropped (they are detached)."""
    ct = cts[0]
    return jnp.zeros((), jnp.float32) if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct


def _backward(loss, run, layout, backend, res, cts):
    del loss, run, layout, backend
    grad_x, grad_w, grad_b = res
    ct = loss_cotangent(cts)
    # The teacher, labels, row weights and traced hyperparameters get no gradient (stop_gradient semantics).
    return scale_grad(grad_x, ct), scale_grad(grad_w, ct), scale_grad(grad_b, ct), None, None, None, None


fused_linear_loss.defvjp(_forward, _backward, symbolic_zeros=True)
