"""jax_kl behaviour beyond the shared matrix: transformations, dead gradients, memory."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_inputs
from reference import reference

import jax_kl

BACKENDS = ("xla", "pallas")


def _arrays(inp):
    lab = None if inp.labels is None else jnp.asarray(inp.labels, jnp.int32)
    b = None if inp.bias is None else jnp.asarray(inp.bias)
    return jnp.asarray(inp.x), jnp.asarray(inp.weight), jnp.asarray(inp.target), lab, b


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_of_a_larger_function(backend: str) -> None:
    inp = make_inputs(11, 5, 23, bias=True)
    x, w, t, lab, b = _arrays(inp)

    def f(x, w, b):
        loss = jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, temperature=1.5, backend=backend, chunk_size=4)
        return 3.0 * loss + jnp.sum(jnp.sin(x))

    ref = reference(inp.x, inp.weight, inp.target, inp.labels, bias=inp.bias, temperature=1.5)
    for transform in (jax.grad, lambda f, **kw: lambda *a: jax.value_and_grad(f, **kw)(*a)[1]):
        gx, gw, gb = jax.jit(transform(f, argnums=(0, 1, 2)))(x, w, b)
        np.testing.assert_allclose(gx, 3 * ref.grad_x + np.cos(inp.x), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(gw, 3 * ref.grad_weight, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(gb, 3 * ref.grad_bias, rtol=2e-5, atol=1e-6)
    # Eagerly, without jit, too.
    np.testing.assert_allclose(jax.grad(f)(x, w, b), 3 * ref.grad_x + np.cos(inp.x), rtol=2e-5, atol=1e-6)


def test_target_is_a_constant() -> None:
    inp = make_inputs(7, 4, 13)
    x, w, t, lab, _ = _arrays(inp)
    gt = jax.grad(lambda t: jax_kl.fused_linear_kl_div(x, w, t, lab, backend="xla"))(t)
    assert gt.shape == t.shape and not np.any(np.asarray(gt))


def _dots(fn, *args) -> int:
    """The number of matrix products in the optimised program."""
    return len(re.findall(r"\bdot\(", jax.jit(fn).lower(*args).compile().as_text()))


def test_unused_gradients_are_dead_code() -> None:
    inp = make_inputs(12, 4, 19, ignore_frac=None)
    x, w, t, _, _ = _arrays(inp)

    def loss(x, w):
        return jax_kl.fused_linear_kl_div(x, w, t, backend="xla", chunk_size=4)

    chunks = 3
    assert _dots(loss, x, w) == chunks  # primal: the logits GEMM only
    assert _dots(jax.grad(loss, argnums=(0, 1)), x, w) == 3 * chunks
    assert _dots(jax.grad(loss, argnums=0), x, w) == 2 * chunks  # frozen head: no grad_weight GEMM
    assert _dots(jax.grad(loss, argnums=1), x, w) == 2 * chunks  # frozen input: no grad_x GEMM


def test_no_logits_sized_buffer() -> None:
    """Forward + backward make no [N, V] array: every value the program computes is a chunk at most.

    (The Pallas backend is checked on the GPU, by the compiled program's temporary bytes:
    on CPU it runs in interpret mode, whose buffers say nothing about the GPU kernel's.)
    """
    n, h, v, chunk = 512, 8, 256, 64
    spec = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n, h), (v, h), (n, v))]

    def loss(x, w, t):
        return jax_kl.fused_linear_kl_div(x, w, t, backend="xla", chunk_size=chunk)

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*spec).compile().as_text()
    made = [
        int(a) * int(b)
        for line in hlo.splitlines()
        if "parameter(" not in line
        for a, b in re.findall(r"= \w+\[(\d+),(\d+)\]", line)
    ]
    assert made and max(made) <= chunk * v < n * v


def test_auto_backend_on_cpu_is_xla() -> None:
    from jax_kl.validate import resolve_backend

    assert resolve_backend("auto") == "xla"


@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean"])
def test_kernel_scales_are_strongly_typed_float32(reduction: str) -> None:
    """A weakly typed scale operand breaks the Pallas kernel's GPU lowering (seen on the H200)."""
    from fused_kl.plan import kernel_scales

    for kept in (jnp.float32(3), jnp.float32(0)):
        scales, _ = kernel_scales(kept, reduction, 5, False, jnp)
        assert scales.dtype == jnp.float32 and not scales.weak_type
