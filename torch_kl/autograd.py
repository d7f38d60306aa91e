"""The autograd glue: forward computes the loss and its gradients; backward scales them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fused_kl.loss import Loss
from fused_kl.options import Needs, RunOptions

from .backends import Backend
from .layout import Layout
from .teachers import TeacherArrays


def _scale_(grad: torch.Tensor, g: torch.Tensor, backend: Backend) -> torch.Tensor:
    """``grad *= g`` in place, in float32 and rounded once (as JAX's backward does): a contiguous
    gradient through the backend's ``scale_grad`` where it has one (it skips a unit ``g`` on
    the device)."""
    if grad.is_contiguous() and backend.scale_grad is not None:
        return backend.scale_grad(grad, g)
    return grad.copy_(grad.to(torch.float32) * g)


class FusedLinearLossFunction(torch.autograd.Function):
    """The fused loss of ``x @ weight.T (+ bias)``, its gradients made in the forward pass.

    ``backend.compute`` runs it (the chunk driver, or the bridge to the Pallas kernels), after
    ``ready()`` where given (the eager value check's wait). Only the gradients whose inputs
    require grad are computed; the teacher's arrays get none.
    It returns ``(loss, the rows' own losses)``; the row losses carry no gradient.
    Backward multiplies them in place by the upstream gradient (on the GPU, a no-op when it
    is 1), so no second copy of ``grad_weight`` is ever held; as a consequence a graph through
    this function can be backpropagated once.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        target,
        teacher_weight,
        teacher_bias,
        target_indices,
        labels,  # type: ignore[override]
        row_weight,
        loss: Loss,
        run: RunOptions,
        layout: Layout,
        backend: Backend,
        ready: Callable[[], None] | None,
    ):
        needs = Needs(
            x=ctx.needs_input_grad[0], weight=ctx.needs_input_grad[1], bias=bias is not None and ctx.needs_input_grad[2]
        )
        teacher = TeacherArrays(target, teacher_weight, teacher_bias, target_indices)
        value, rows, grad_x, grad_w, grad_b = backend.compute(
            x, weight, bias, teacher, labels, row_weight, loss, run, layout, needs, backend, ready=ready
        )
        ctx.grads = (grad_x, grad_w, grad_b)
        ctx.backend = backend
        ctx.mark_non_differentiable(rows)
        return value, rows

    @staticmethod
    def backward(ctx, grad_loss, grad_rows):  # type: ignore[override]
        del grad_rows  # the row losses are detached
        if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative is asked for
            raise RuntimeError(
                "fused linear loss: double backward (create_graph=True, a gradient of the gradient) is not "
                "supported: the gradients are made in the forward pass, without a graph of their own"
            )
        if ctx.grads is None:
            raise RuntimeError(
                "fused linear loss: backward ran twice through the same graph; its saved gradients "
                "were scaled in place the first time (recompute the loss instead of retain_graph=True)"
            )
        grad_x, grad_w, grad_b = (None if g is None else _scale_(g, grad_loss, ctx.backend) for g in ctx.grads)
        ctx.grads = None
        return grad_x, grad_w, grad_b, *([None] * 11)
