"""The DLPack bridge: torch tensors through the Pallas kernel, JAX arrays through Triton.

Both directions hand device buffers across with DLPack, without copies and without a trip
through host memory:

* ``torch_through_pallas`` (``torch_kl`` backend ``"jax"``): the tensors become JAX arrays,
  a jitted ``jax_kl`` forward (cached per shape, dtype and options by ``jax.jit``) computes
  the loss and gradients with the Pallas kernel, and the results come back as tensors that
  share JAX's buffers. Stream order comes from the DLPack protocol itself: the consumer
  passes its stream to ``__dlpack__``, and the producer makes that stream wait for its work.
* ``jax_through_triton`` (``jax_kl`` backend ``"triton"``): a ``buffer_callback`` inside the
  jitted program receives XLA's device buffers and its stream; ``torch_kl``'s chunked
  Triton forward runs on that stream (``torch.cuda.ExternalStream``) and writes straight into
  the output buffers. On CPU the same callback runs with the Triton interpreter.

Each framework is imported only when its direction is used, so ``torch_kl`` works without
JAX and ``jax_kl`` without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

from .contract import Options

_FLOATS_JAX_TAKES = ("float32", "bfloat16", "float16")


def _to_jax(t: Any) -> Any:
    """A torch tensor as a JAX array over the same memory (dense layout, no autograd)."""
    import jax
    import torch

    t = t.detach()
    if t.is_floating_point() and str(t.dtype).removeprefix("torch.") not in _FLOATS_JAX_TAKES:
        t = t.float()  # float64 targets: JAX runs without x64 by default
    elif not t.is_floating_point() and t.dtype != torch.int32:
        t = t.to(torch.int32)  # labels: only compared with ignore_index
    return jax.dlpack.from_dlpack(t.contiguous())


@functools.cache
def _jitted_jax_forward():
    import jax

    from jax_kl import chunked

    return jax.jit(chunked.forward, static_argnames=("opts", "with_grads"))


def torch_through_pallas(x, weight, target, labels, bias, opts: Options, needs) -> tuple:
    """``torch_kl``'s ``compute`` for backend ``"jax"``: the same outputs as ``chunked.forward``."""
    import torch

    jax_opts = dataclasses.replace(opts, backend="pallas")
    args = [None if a is None else _to_jax(a) for a in (x, weight, target, labels, bias)]
    loss, grad_x, grad_w, grad_b = _jitted_jax_forward()(*args, opts=jax_opts, with_grads=needs.any)
    back = torch.from_dlpack
    return (
        back(loss),
        back(grad_x) if needs.x else None,
        back(grad_w) if needs.weight else None,
        back(grad_b) if needs.bias else None,
    )


def _torch_stream(ctx: Any, on_gpu: bool):
    """Run torch work on XLA's stream, so it is ordered with the jitted program around it."""
    if not on_gpu:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream))


def jax_through_triton(x, weight, target, labels, bias, opts: Options, with_grads: bool) -> tuple:
    """``jax_kl``'s ``compute`` for backend ``"triton"``: the same outputs as ``chunked.forward``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    n, h = x.shape
    v = weight.shape[0]
    sds = jax.ShapeDtypeStruct
    out_types = {"loss": sds((), jnp.float32)}
    if with_grads:
        out_types |= {"grad_x": sds((n, h), x.dtype), "grad_weight": sds((v, h), weight.dtype)}
        if bias is not None:
            out_types["grad_bias"] = sds((v,), bias.dtype)
    torch_opts = dataclasses.replace(opts, backend="triton")
    on_gpu = jax.default_backend() == "gpu"
    has_labels, has_bias = labels is not None, bias is not None

    def callback(ctx, out, *buffers):
        import torch

        from torch_kl.chunked import Needs, forward

        with _torch_stream(ctx, on_gpu):
            tensors = [torch.from_dlpack(b) for b in buffers]
            tx, tw, tt = tensors[:3]
            tl = tensors[3] if has_labels else None
            tb = tensors[-1] if has_bias else None
            outs = {k: torch.from_dlpack(b) for k, b in out.items()}
            needs = Needs(x=with_grads, weight=with_grads, bias=with_grads and has_bias)
            forward(tx, tw, tt, tl, tb, torch_opts, needs, out=outs)

    args = [a for a in (x, weight, target, labels, bias) if a is not None]
    res = buffer_callback(callback, out_types, has_side_effect=False)(*args)
    if not with_grads:
        return res["loss"], None, None, None
    return res["loss"], res["grad_x"], res["grad_weight"], res.get("grad_bias")
