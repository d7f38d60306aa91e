"""The ``"triton"`` backend: JAX arrays through ``torch_kl``'s Triton kernels, zero-copy.

A ``buffer_callback`` inside the jitted program receives XLA's device buffers and its stream;
``torch_kl``'s chunk driver runs on that stream (``torch.cuda.ExternalStream``) and writes
straight into the output buffers. On CPU the same callback runs the Triton interpreter.
``torch_kl/backends/pallas_bridge.py`` is the other direction.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fused_kl.loss import Loss
from fused_kl.options import RunOptions


def _torch_stream(ctx: Any, on_gpu: bool):
    """Run torch work on XLA's stream, so it is ordered with the jitted program around it."""
    if not on_gpu:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream))


def jax_through_triton(x, weight, bias, teacher, labels, loss: Loss, run: RunOptions, layout, with_grads: bool):
    """``jax_kl``'s compute for backend ``"triton"``: the same outputs as ``jax_kl.driver.forward``."""
    from jax.experimental.buffer_callback import buffer_callback

    del layout  # single device: checked at validation
    n, h = x.shape
    v = weight.shape[0]
    sds = jax.ShapeDtypeStruct
    out_types = {"loss": sds((), jnp.float32)}
    if with_grads:
        out_types |= {"grad_x": sds((n, h), x.dtype), "grad_weight": sds((v, h), weight.dtype)}
        if bias is not None:
            out_types["grad_bias"] = sds((v,), bias.dtype)
    torch_run = dataclasses.replace(run, backend="triton")
    on_gpu = jax.default_backend() == "gpu"
    named = {
        "x": x,
        "weight": weight,
        "bias": bias,
        "labels": labels,
        "target": teacher.target,
        "weight_t": teacher.weight,
        "bias_t": teacher.bias,
        "indices": teacher.indices,
    }
    names = [k for k, a in named.items() if a is not None]

    def callback(ctx, out, *buffers):
        import torch

        from torch_kl.driver import Needs, forward
        from torch_kl.layout import SINGLE
        from torch_kl.teachers import TeacherArrays

        with _torch_stream(ctx, on_gpu):
            t = dict.fromkeys(named) | {k: torch.from_dlpack(b) for k, b in zip(names, buffers, strict=True)}
            outs = {k: torch.from_dlpack(b) for k, b in out.items()}
            needs = Needs(x=with_grads, weight=with_grads, bias=with_grads and bias is not None)
            tt = TeacherArrays(t["target"], t["weight_t"], t["bias_t"], t["indices"])
            forward(t["x"], t["weight"], t["bias"], tt, t["labels"], loss, torch_run, SINGLE, needs, out=outs)

    # Under jax.vmap, one call per batch element.
    call = buffer_callback(callback, out_types, has_side_effect=False, vmap_method="sequential")
    res = call(*(named[k] for k in names))
    if not with_grads:
        return res["loss"], None, None, None
    return res["loss"], res["grad_x"], res["grad_weight"], res.get("grad_bias")
