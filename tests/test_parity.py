"""Cross-framework parity: the same tensors, handed to JAX with DLPack, give the same loss
and gradients in ``torch_kl`` and ``jax_kl``, for every option of the shared matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from harness import TOLERANCE, make_inputs, rel_err
from test_backends import CASES

import jax_kl
import torch_kl

# Each torch backend beside its mirror image in JAX.
PAIRS = (("torch", "xla"), ("triton", "pallas"))


def _torch_run(backend, x, w, t, lab, b, options):
    leaves = [a.detach().clone().requires_grad_() if a is not None else None for a in (x, w, b)]
    loss = torch_kl.fused_linear_kl_div(leaves[0], leaves[1], t, lab, bias=leaves[2], backend=backend, **options)
    loss.backward()
    return [float(loss)] + [None if a is None else a.grad.double().numpy() for a in leaves]


def _jax_run(backend, x, w, t, lab, b, options):
    def f(x, w, b):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, backend=backend, **options)

    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, b)
    return [float(loss)] + [None if g is None else jax.numpy.asarray(g, jnp.float32).__array__() for g in grads]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("case", list(CASES))
def test_frameworks_agree(pair: tuple[str, str], case: str) -> None:
    shape, options = CASES[case]
    inp = make_inputs(**shape)
    dt = getattr(torch, inp.dtype)
    x, w = torch.tensor(inp.x).to(dt), torch.tensor(inp.weight).to(dt)
    b = None if inp.bias is None else torch.tensor(inp.bias).to(dt)
    t = torch.tensor(inp.target)
    lab = None if inp.labels is None else torch.tensor(inp.labels, dtype=torch.int32)
    to_jax = lambda a: None if a is None else jax.dlpack.from_dlpack(a)  # the same memory
    jax_options = dict(options)
    torch_options = dict(options)
    if "accum_dtype" in options:
        torch_options["accum_dtype"] = getattr(torch, options["accum_dtype"])

    got_t = _torch_run(pair[0], x, w, t, lab, b, torch_options)
    got_j = _jax_run(pair[1], *map(to_jax, (x, w, t, lab, b)), jax_options)
    tol = TOLERANCE[inp.dtype]
    assert abs(got_t[0] - got_j[0]) <= tol * max(abs(got_t[0]), 1e-6), (got_t[0], got_j[0])
    for name, a, c in zip(("grad_x", "grad_weight", "grad_bias"), got_t[1:], got_j[1:], strict=False):
        assert (a is None) == (c is None), name
        if a is not None:
            assert rel_err(c, a) <= tol, f"{name}: {rel_err(c, a):.3g}"
