"""The ``custom_vjp`` glue: the forward rule computes the loss and its gradients; the backward
rule scales them by the cotangent (mirror of ``torch_kl/autograd.py``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fused_kl.loss import Loss
from fused_kl.options import Needs, RunOptions

from .backends import Backend
from .layout import Layout
from .teachers import TeacherArrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def fused_linear_loss(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None, teacher: TeacherArrays, labels: jax.Array | None,
    loss: Loss, run: RunOptions, layout: Layout, backend: Backend,
) -> jax.Array:  # fmt: skip
    """The fused loss of ``x @ weight.T (+ bias)``; outside ``jax.grad`` only the loss is
    computed. ``backend.compute`` runs it (the chunk driver, or the bridge to Triton)."""
    return backend.compute(x, weight, bias, teacher, labels, loss, run, layout, Needs(), backend)[0]


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


def needs_and_values(x, weight, bias, teacher, labels, backend: Backend) -> tuple[Needs, tuple]:
    """With ``symbolic_zeros=True`` a forward rule gets each array as ``CustomVJPPrimal``: its
    ``value``, and whether it is ``perturbed`` (its gradient is asked for). The gradients to
    make, and the arrays: under ``jax.grad(..., argnums=0)`` a frozen head costs no
    ``grad_weight`` GEMM, through the Triton bridge too (it has no dead code for XLA to drop).
    A second derivative through a backend that has none is refused here (:func:`_refuse_tangents`)."""
    needs = Needs(x=x.perturbed, weight=weight.perturbed, bias=bias is not None and bias.perturbed)
    values = jax.tree.map(lambda p: p.value, (x, weight, bias, teacher, labels))
    if backend.name not in TWICE_DIFFERENTIABLE:
        values = (*_refuse_tangents(backend.name)(values[:3]), *values[3:])
    return needs, values


def _forward(x, weight, bias, teacher, labels, loss, run, layout, backend):
    needs, arrays = needs_and_values(x, weight, bias, teacher, labels, backend)
    value, grad_x, grad_w, grad_b = backend.compute(*arrays, loss, run, layout, needs, backend)
    return value, (grad_x, grad_w, grad_b)


def scale_grad(grad: jax.Array | None, ct: jax.Array) -> jax.Array | None:
    """A saved gradient times the upstream cotangent ``ct``, multiplied in float32 so a
    low-precision gradient is rounded once (the backward pass of every layout)."""
    return None if grad is None else (grad.astype(jnp.float32) * ct).astype(grad.dtype)


def _backward(loss, run, layout, backend, res, ct):
    del loss, run, layout, backend
    grad_x, grad_w, grad_b = res
    # The teacher and labels get no gradient (stop_gradient semantics).
    return scale_grad(grad_x, ct), scale_grad(grad_w, ct), scale_grad(grad_b, ct), None, None


fused_linear_loss.defvjp(_forward, _backward, symbolic_zeros=True)
