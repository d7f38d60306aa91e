"""Runners for the GPU tests: CUDA tensors in, loss and gradients out as CUDA tensors, for
every GPU backend (both native kernels and both bridges); JAX sees the same buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

import jax_kl
import torch_kl

GPU_BACKENDS = ("torch/triton", "torch/jax", "jax/pallas", "jax/triton")


def run_gpu(backend: str, x, w, t, labels=None, bias=None, **options):
    """``(loss, grad_x, grad_weight, grad_bias)`` as CUDA tensors of the inputs' dtypes."""
    framework, name = backend.split("/")
    if framework == "torch":
        leaves = [None if a is None else a.detach().clone().requires_grad_() for a in (x, w, bias)]
        loss = torch_kl.fused_linear_kl_div(leaves[0], leaves[1], t, labels, bias=leaves[2], backend=name, **options)
        loss.backward()
        return (loss.detach(), *(None if a is None else a.grad for a in leaves))
    if isinstance(options.get("accum_dtype"), torch.dtype):
        options["accum_dtype"] = str(options["accum_dtype"]).removeprefix("torch.")
    jx = [None if a is None else jax.dlpack.from_dlpack(a.detach()) for a in (x, w, t, labels, bias)]
    if jx[3] is not None and jx[3].dtype != jnp.int32:
        jx[3] = jx[3].astype(jnp.int32)
    loss, grads = _jax_value_and_grad(name, tuple(sorted(options.items())))(*jx)
    back = lambda a: None if a is None else torch.from_dlpack(a)
    return (back(loss), *(back(g) for g in grads))


_CACHE: dict = {}


def _jax_value_and_grad(name: str, options: tuple):
    key = (name, options)
    if key not in _CACHE:

        def f(x, w, t, lab, b):
            return jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, backend=name, **dict(options))

        _CACHE[key] = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 4)))
    return _CACHE[key]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative-norm error, computed on the device in float64."""
    a, ref = a.double(), ref.double().to(a.device)
    d = torch.linalg.vector_norm(ref)
    e = torch.linalg.vector_norm(a - ref)
    return float(e / d) if d > 0 else float(e)
