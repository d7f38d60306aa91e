"""Stage 5 in PyTorch: the autograd glue. Forward computes the gradients; backward scales them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fused_kl.contract import Options

from .chunked import Needs

Compute = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]


def _scale_(grad: torch.Tensor, g: torch.Tensor, backend: str) -> torch.Tensor:
    """``grad *= g`` in place, in float32 and rounded once (as JAX's backward does).

    Where Triton runs (CUDA, or the Triton backend under the interpreter) a contiguous
    gradient goes through ``rescale``, which skips a unit ``g`` on the device.
    """
    if grad.is_contiguous() and (backend == "triton" or grad.is_cuda):
        from .rescale import scale_

        return scale_(grad, g)
    return grad.copy_(grad.to(torch.float32) * g)


class FusedLinearKLDivFunction(torch.autograd.Function):
    """``loss = KL(target || softmax((x @ weight.T + bias) / T))``, gradients from the forward pass.

    ``compute(x, weight, target, labels, bias, opts, needs)`` is the backend: the chunked
    torch/Triton loop, or the bridge to the Pallas kernel. Only the gradients whose inputs
    require grad are computed. Backward multiplies them in place by the upstream gradient
    (on the GPU, a no-op when it is 1: ``rescale``), so no second copy of ``grad_weight`` is
    ever held; as a consequence a graph through this function can be backpropagated once.
    """

    @staticmethod
    def forward(ctx, x, weight, target, labels, bias, opts: Options, compute: Compute):  # type: ignore[override]
        needs = Needs(
            x=ctx.needs_input_grad[0],
            weight=ctx.needs_input_grad[1],
            bias=bias is not None and ctx.needs_input_grad[4],
        )
        loss, grad_x, grad_w, grad_b = compute(x, weight, target, labels, bias, opts, needs)
        ctx.grads = (grad_x, grad_w, grad_b)
        ctx.backend = opts.backend
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_kl_div: backward ran twice through the same graph; its saved gradients "
                "were scaled in place the first time (recompute the loss instead of retain_graph=True)"
            )
        grads = tuple(None if g is None else _scale_(g, grad_loss, ctx.backend) for g in ctx.grads)
        ctx.grads = None
        grad_x, grad_w, grad_b = grads
        return grad_x, grad_w, None, None, grad_b, None, None
