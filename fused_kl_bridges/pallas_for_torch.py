"""``torch_kl``'s backend ``"pallas"``: torch tensors through ``jax_kl``'s Pallas kernels, zero-copy.

The tensors become JAX arrays over the same device memory (DLPack), ``jax_kl``'s chunk driver,
jitted (cached per shape, dtype, options and needed gradients by ``jax.jit``), computes the loss
and the gradients asked for, and the results come back as tensors sharing JAX's buffers. Stream
order comes from the DLPack protocol: the consumer passes its stream to ``__dlpack__`` and the
producer makes it wait for its work. ``triton_for_jax`` is the other direction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import torch

import jax_kl.backends
from fused_kl.loss import Loss
from fused_kl.options import Needs, RunOptions
from jax_kl import driver
from jax_kl.layout import SINGLE
from jax_kl.teachers import TeacherArrays
from torch_kl.backends import Backend
from torch_kl.layout import Layout
from torch_kl.teachers import TeacherArrays as TorchTeacherArrays

_FLOATS_JAX_TAKES = (torch.float32, torch.bfloat16, torch.float16)


def to_jax(t: torch.Tensor | None) -> Any:
    """A tensor as a JAX array over the same memory (dense layout, no autograd)."""
    if t is None:
        return None
    t = t.detach()
    if t.is_floating_point() and t.dtype not in _FLOATS_JAX_TAKES:
        t = t.float()  # float64 targets: JAX runs without x64 by default
    elif not t.is_floating_point() and t.dtype != torch.int32:
        t = t.to(torch.int32)  # labels and token ids
    return jax.dlpack.from_dlpack(t.contiguous())


@functools.partial(jax.jit, static_argnames=("loss", "run", "layout", "needs", "backend"))
def _jitted(x, weight, bias, teacher, labels, row_weight, loss, run, layout, needs, backend) -> tuple:
    # The module attribute, read when traced: the driver entry a test can watch.
    return driver.forward(x, weight, bias, teacher, labels, row_weight, loss, run, layout, needs, backend)


def torch_through_pallas(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: TorchTeacherArrays,
    labels: torch.Tensor | None, row_weight: torch.Tensor | None, loss: Loss, run: RunOptions, layout: Layout,
    needs: Needs, backend: Backend, *,
    ready: Callable[[], None] | None = None,
) -> tuple:  # fmt: skip
    """``torch_kl``'s compute for backend ``"pallas"``: the same outputs as ``torch_kl.driver.forward``
    (``ready()``, the value check's wait, runs first: JAX's program reads the labels at once)."""
    del layout, backend  # single device: checked at validation; JAX's "pallas" runs the kernels
    if ready is not None:
        ready()
    jax_teacher = TeacherArrays(*(to_jax(a) for a in (teacher.target, teacher.weight, teacher.bias, teacher.indices)))
    value, rows, grad_x, grad_w, grad_b = _jitted(
        to_jax(x), to_jax(weight), to_jax(bias), jax_teacher, to_jax(labels), to_jax(row_weight), loss=loss, run=run,
        layout=SINGLE, needs=needs, backend=jax_kl.backends.resolve("pallas"),
    )  # fmt: skip
    back = torch.from_dlpack
    return back(value), back(rows), *(None if g is None else back(g) for g in (grad_x, grad_w, grad_b))
