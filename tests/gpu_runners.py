"""Runners for the GPU tests: CUDA tensors in, loss and gradients out as CUDA tensors, for
every GPU backend of both registries; JAX sees the same buffers (DLPack)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

import jax_kl
import torch_kl
from fused_kl.checks import BackendUnavailable
from jax_kl.backends import REGISTRY as JAX_REGISTRY
from torch_kl.backends import REGISTRY as TORCH_REGISTRY

GPU_BACKENDS = tuple(f"torch/{b}" for b in TORCH_REGISTRY if b != "torch") + tuple(
    f"jax/{b}" for b in JAX_REGISTRY if b != "xla"
)
ARRAY_OPTIONS = ("teacher_weight", "teacher_bias", "target_indices", "row_weight")


def run_gpu(backend: str, x, w, t, labels=None, bias=None, *, fn: str = "fused_linear_kl_div", **options):
    """``(loss, grad_x, grad_weight, grad_bias)`` as CUDA tensors of the inputs' dtypes.
    ``fn="fused_linear_cross_entropy"`` ignores ``t``."""
    framework, name = backend.split("/")
    ce = fn == "fused_linear_cross_entropy"
    if framework == "torch":
        leaves = [None if a is None else a.detach().clone().requires_grad_() for a in (x, w, bias)]
        head = (leaves[0], leaves[1]) if ce else (leaves[0], leaves[1], t)
        loss = getattr(torch_kl, fn)(*head, labels, bias=leaves[2], backend=name, **options)
        loss.backward()
        return (loss.detach(), *(None if a is None else a.grad for a in leaves))
    if isinstance(options.get("accum_dtype"), torch.dtype):
        options["accum_dtype"] = str(options["accum_dtype"]).removeprefix("torch.")
    arrays = {k: _to_jax(options.pop(k)) for k in ARRAY_OPTIONS if options.get(k) is not None}
    jx = [None if a is None else _to_jax(a) for a in (x, w, None if ce else t, labels, bias)]
    try:
        loss, grads = _jax_value_and_grad(name, fn, tuple(sorted(options.items())), tuple(sorted(arrays)))(
            *jx, *(arrays[k] for k in sorted(arrays))
        )
    except BackendUnavailable as e:  # the Mosaic GPU kernels refuse shapes the TMA cannot move, saying so
        if e.backend == "pallas_mosaic":
            pytest.skip(str(e))
        raise
    back = lambda a: None if a is None else torch.from_dlpack(a)
    return (back(loss), *(back(g) for g in grads))


def _to_jax(a):
    j = jax.dlpack.from_dlpack(a.detach())
    return j.astype(jnp.int32) if jnp.issubdtype(j.dtype, jnp.integer) and j.dtype != jnp.int32 else j


_CACHE: dict = {}


def _jax_value_and_grad(name: str, fn: str, options: tuple, array_names: tuple):
    key = (name, fn, options, array_names)
    if key not in _CACHE:

        def f(x, w, t, lab, b, *arrays):
            kw = dict(options) | dict(zip(array_names, arrays, strict=True))
            head = (x, w) if t is None else (x, w, t)
            return getattr(jax_kl, fn)(*head, lab, bias=b, backend=name, **kw)

        _CACHE[key] = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 4)))
    return _CACHE[key]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative-norm error, computed on the device in float64."""
    a, ref = a.double(), ref.double().to(a.device)
    d = torch.linalg.vector_norm(ref)
    e = torch.linalg.vector_norm(a - ref)
    return float(e / d) if d > 0 else float(e)
