"""The ``"pallas"`` backend: torch tensors through ``jax_kl``'s Pallas kernels, zero-copy.

The tensors become JAX arrays over the same device memory (DLPack), a jitted ``jax_kl``
chunk driver (cached per shape, dtype and options by ``jax.jit``) computes the loss and the
gradients, and the results come back as tensors sharing JAX's buffers. Stream order comes
from the DLPack protocol: the consumer passes its stream to ``__dlpack__`` and the producer
makes it wait for its work. ``jax_kl/backends/triton_bridge.py`` is the other direction.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from fused_kl.loss import Loss
from fused_kl.options import RunOptions

_FLOATS_JAX_TAKES = (torch.float32, torch.bfloat16, torch.float16)


def _to_jax(t: torch.Tensor | None) -> Any:
    """A tensor as a JAX array over the same memory (dense layout, no autograd)."""
    if t is None:
        return None
    import jax

    t = t.detach()
    if t.is_floating_point() and t.dtype not in _FLOATS_JAX_TAKES:
        t = t.float()  # float64 targets: JAX runs without x64 by default
    elif not t.is_floating_point() and t.dtype != torch.int32:
        t = t.to(torch.int32)  # labels and token ids
    return jax.dlpack.from_dlpack(t.contiguous())


@functools.cache
def _jitted_forward():
    import jax

    from jax_kl.driver import forward

    return jax.jit(forward, static_argnames=("loss", "run", "layout", "with_grads"))


def torch_through_pallas(
    x, weight, bias, teacher, labels, loss: Loss, run: RunOptions, layout, needs, ready=None
) -> tuple:  # fmt: skip
    """``torch_kl``'s compute for backend ``"pallas"``: the same outputs as ``torch_kl.driver.forward``
    (``ready()``, the value check's wait, runs first: JAX's program reads the labels at once)."""
    if ready is not None:
        ready()
    from jax_kl.layout import SINGLE
    from jax_kl.teachers import TeacherArrays

    del layout  # single device: checked at validation
    jax_teacher = TeacherArrays(*(_to_jax(a) for a in (teacher.target, teacher.weight, teacher.bias, teacher.indices)))
    value, grad_x, grad_w, grad_b = _jitted_forward()(
        _to_jax(x), _to_jax(weight), _to_jax(bias), jax_teacher, _to_jax(labels), loss=loss,
        run=dataclasses.replace(run, backend="pallas"), layout=SINGLE, with_grads=needs.any,
    )  # fmt: skip
    back = torch.from_dlpack
    return (
        back(value),
        back(grad_x) if needs.x else None,
        back(grad_w) if needs.weight else None,
        back(grad_b) if needs.bias else None,
    )
